"""Parallel ranged reads and the IO-loop plumbing the object stores share.

Both clients are asyncio-based and run on fsspec's IO loop thread. :func:`parallel_readv` splits a
read of one or several consecutive buffers into ``part_size`` ranges and fetches up to
``concurrency`` of them at once, each request's body streamed straight through the buffers it spans
(a scatter read: one request may fill many tensors, none staged); :func:`run` waits on the loop from
a caller's thread; :func:`gather_or_cancel` stops the other requests when one fails.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from fsspec.asyn import sync

from ..errors import IntegrityError

# fetch_into(start, end, views): bytes [start, end) into the consecutive buffers ``views`` (their total
# length is end - start); returns the count (short or 0 past the end of the object)
FetchInto = Callable[[int, int, list[memoryview]], Awaitable[int]]


class VersionPin:
    """The version (an ETag, a generation) that reads of one object must all come from: the first
    reply's. A store sends it as a precondition where it can (S3 ``If-Match``, a GCS ``generation``)
    and checks each reply's own; a reply without one is not checked. Used on the IO loop only."""

    __slots__ = ("version",)

    def __init__(self) -> None:
        self.version: str | None = None

    def check(self, uri: str, seen: str | None) -> None:
        """Pin ``seen`` if nothing is pinned yet; raise if it is another version than the pinned one."""
        if not seen:
            return
        if self.version is None:
            self.version = seen
        elif seen != self.version:
            raise replaced(uri, self.version, seen)


def replaced(uri: str, pinned: str, seen: str | None = None) -> IntegrityError:
    now = f", then {seen}" if seen else ""
    return IntegrityError(
        f"{uri} was replaced while it was being read (version {pinned}{now}); nothing read from it "
        f"was used: read it again"
    )


def run(loop: asyncio.AbstractEventLoop, coro_fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
    """Run ``coro_fn(*args)`` on ``loop`` (fsspec's IO thread) and wait for the result."""
    return sync(loop, coro_fn, *args)


async def gather_or_cancel(coros: list[Awaitable[Any]]) -> list[Any]:
    """Like ``asyncio.gather`` but cancels (and awaits) the rest as soon as one fails."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    if not tasks:
        return []
    done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    for t in pending:
        t.cancel()
    if pending:
        await asyncio.wait(pending)
    for t in tasks:
        if t.done() and not t.cancelled() and t.exception() is not None:
            raise t.exception()  # type: ignore[misc]
    return [t.result() for t in tasks]


async def parallel_readv(
    fetch_into: FetchInto, views: list[memoryview], offset: int, part_size: int, concurrency: int
) -> int:
    """Fill the consecutive buffers ``views`` from the object's bytes at ``offset``: requests of up to
    ``part_size`` bytes each (a request's body streams into the buffers it spans, in order; a larger
    buffer is cut), up to ``concurrency`` at once. Returns the length of the filled prefix."""
    requests: list[tuple[int, int, list[memoryview]]] = []  # (start, end in the object, the buffers it fills)
    pos, room = offset, 0
    for v in views:
        while len(v):
            if room == 0:
                requests.append((pos, pos, []))
                room = part_size
            take = v[:room]
            start, _, part = requests[-1]
            part.append(take)
            v, pos, room = v[len(take) :], pos + len(take), room - len(take)
            requests[-1] = (start, pos, part)
    if len(requests) <= 1:
        return await fetch_into(*requests[0]) if requests else 0
    sem = asyncio.Semaphore(concurrency)

    async def one(start: int, end: int, part: list[memoryview]) -> int:
        async with sem:
            return await fetch_into(start, end, part)

    got = await gather_or_cancel([one(*r) for r in requests])
    total = 0
    for (start, end, _), g in zip(requests, got, strict=True):
        total += g
        if g < end - start:
            break
    return total


def fill(views: list[memoryview], chunk: Any, pos: int) -> None:
    """Copy ``chunk`` into the consecutive buffers ``views`` from byte ``pos`` of them."""
    mv = memoryview(chunk)
    for v in views:
        if pos >= len(v):
            pos -= len(v)
            continue
        k = min(len(v) - pos, len(mv))
        v[pos : pos + k] = mv[:k]
        mv, pos = mv[k:], 0
        if not len(mv):
            return

"""Parallel ranged reads and the IO-loop plumbing the object stores share.

Both clients are asyncio-based and run on fsspec's IO loop thread. :func:`parallel_readv` splits a
read of one or several consecutive buffers into ``part_size`` ranges and fetches up to
``concurrency`` of them at once, each request's body streamed straight through the buffers it spans
(a scatter read: one request may fill many tensors, none staged); :func:`run` waits on the loop from
a caller's thread (:func:`start` does not); :func:`gather_or_cancel` stops the other requests when one fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Awaitable, Callable, Coroutine
from types import TracebackType
from typing import Any

import fsspec.asyn
from fsspec.asyn import sync

from ..errors import replaced
from ..threads import exit_safe
from .retry import settle as _retry_settle

# the code of fsspec's sync and of the coroutine it runs on the loop (``_runner``): see _let_go
_FSSPEC_SYNC_CODE = frozenset(f.__code__ for f in (fsspec.asyn.sync, getattr(fsspec.asyn, "_runner", fsspec.asyn.sync)))

# fetch_into(start, end, views): bytes [start, end) into the consecutive buffers ``views`` (their total
# length is end - start); returns the count (short or 0 past the end of the object)
FetchInto = Callable[[int, int, list[memoryview]], Awaitable[int]]


class VersionPin:
    """The version (an ETag, a generation) that reads of one object must all come from: the first one
    seen, from a reply or from the ``stat`` the caller read the size from. Each reply's own version is
    checked against it; a reply without one is not checked. A store also sends it as a precondition
    where it can: S3 ``If-Match`` with :attr:`token`, a strong ETag a GET reply carried (a HEAD's or a
    weak one is only compared); GCS ``generation=``. Versions compare without quotes or a ``W/``."""

    __slots__ = ("_lock", "token", "version")

    def __init__(self, version: str | None = None) -> None:
        self.version: str | None = _plain(version)
        self.token: str | None = None
        self._lock = threading.Lock()  # replies check on the IO loop, a stat through a view on its caller

    def check(self, uri: str, seen: str | None, *, reply: bool = True) -> None:
        """Pin ``seen`` if nothing is pinned yet; raise if it is another version than the pinned one.
        ``reply``: ``seen`` came with a GET reply (it may then serve as the precondition token)."""
        plain = _plain(seen)
        if plain is None:
            return
        with self._lock:
            if self.version is None:
                self.version = plain
            elif plain != self.version:
                raise replaced(uri, self.version, plain)
            if reply and self.token is None and seen and not seen.strip().startswith("W/"):
                self.token = seen.strip()


def _plain(version: str | None) -> str | None:
    """``W/"abc"`` / ``"abc"`` -> ``abc``; None for nothing (GCS metadata without a generation reads "None")."""
    if not version or version == "None":
        return None
    v = version.strip()
    v = v[2:] if v.startswith("W/") else v
    return v.strip('"') or None


def run(loop: asyncio.AbstractEventLoop, coro_fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
    """Run ``coro_fn(*args)`` on ``loop`` (fsspec's IO thread) and wait for the result."""
    exit_safe(loop)  # its thread work (DNS lookups) still runs in an atexit handler
    try:
        return sync(loop, coro_fn, *args)
    except BaseException as e:
        _let_go(e.__traceback__)
        raise


def _let_go(tb: TracebackType | None) -> None:
    """fsspec's ``sync`` and its ``_runner`` keep the error in locals of their finished frames, which the
    error's traceback holds: a reference cycle keeping every caller's frame (and what they hold) until the
    gc runs. Those two frames' locals are cleared; no other frame is touched (a suspended coroutine's would
    close it)."""
    while tb is not None:
        if tb.tb_frame.f_code in _FSSPEC_SYNC_CODE:
            with contextlib.suppress(RuntimeError):  # still executing: nothing to clear
                tb.tb_frame.clear()
        tb = tb.tb_next


def start(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, None]) -> None:
    """Start ``coro`` on ``loop`` from a caller's thread and return at once: the coroutine delivers its
    own result (a future it completes). Refused, as :func:`run` is, on a closed loop or from the loop's
    own thread (whoever waits there would wait forever)."""
    if loop is None or loop.is_closed():
        coro.close()
        raise RuntimeError("Loop is not running")
    try:
        here = asyncio.get_running_loop()
    except RuntimeError:
        here = None
    if here is loop:
        coro.close()
        raise NotImplementedError("Calling start() from within the IO loop")
    exit_safe(loop)
    asyncio.run_coroutine_threadsafe(coro, loop)


async def gather_or_cancel(coros: list[Awaitable[Any]]) -> list[Any]:
    """Like ``asyncio.gather`` but cancels (and awaits) the rest as soon as one fails."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    if not tasks:
        return []
    cancelled, done = False, set[asyncio.Task[Any]]()
    try:
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    except asyncio.CancelledError:  # this task cancelled: every request is, and has ended before it returns
        cancelled, pending = True, {t for t in tasks if not t.done()}
    for t in pending:
        t.cancel()
    # each has left the caller's buffers before this returns, even if this task is cancelled (again) meanwhile
    await _retry_settle(*tasks)
    if cancelled:
        raise asyncio.CancelledError()
    errors = [t.exception() for t in tasks if t.done() and not t.cancelled()]  # every one retrieved
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        try:
            raise first
        finally:  # the error's traceback holds this frame: no reference cycle through its locals (each
            # task holds its error, the one raised here too)
            del first, errors
            tasks.clear()
            done.clear()
            pending.clear()
            t = None  # type: ignore[assignment]
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

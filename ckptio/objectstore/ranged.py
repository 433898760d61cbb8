"""Parallel ranged reads and the IO-loop plumbing the object stores share.

Both clients are asyncio-based and run on fsspec's IO loop thread. :func:`parallel_readinto` splits
a read into ``part_size`` ranges and fetches up to ``concurrency`` of them at once, each streamed
straight into its slice of the caller's buffer; :func:`run` waits on the loop from a caller's
thread; :func:`gather_or_cancel` stops the other requests when one fails.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from fsspec.asyn import sync

FetchInto = Callable[[int, int, memoryview], Awaitable[int]]


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


async def parallel_readinto(
    fetch_into: FetchInto, buf: memoryview, offset: int, part_size: int, concurrency: int
) -> int:
    """Fill ``buf`` with the object's bytes from ``offset`` using parallel ranged reads.

    ``fetch_into(start, end, view)`` reads bytes ``[start, end)`` into ``view`` and returns the count
    (short or 0 past the end of the object). All ranges are requested at once, so no size lookup
    is needed; the result is the length of the contiguous prefix that was filled.
    """
    n = len(buf)
    if n <= part_size:
        return await fetch_into(offset, offset + n, buf) if n else 0
    sem = asyncio.Semaphore(concurrency)
    bounds = [(s, min(s + part_size, n)) for s in range(0, n, part_size)]

    async def one(s: int, e: int) -> int:
        async with sem:
            return await fetch_into(offset + s, offset + e, buf[s:e])

    got = await gather_or_cancel([one(s, e) for s, e in bounds])
    total = 0
    for (s, e), g in zip(bounds, got, strict=True):
        total += g
        if g < e - s:
            break
    return total

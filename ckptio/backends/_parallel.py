"""Parallel transfers shared by the object-store backends (S3, GCS).

Both clients are asyncio-based and run on fsspec's IO loop thread. This module provides the two
halves every fast object store needs, independent of the client:

* :func:`parallel_readinto`: split a read into ``part_size`` ranges and fetch up to
  ``concurrency`` of them at once, each streamed straight into its slice of the caller's buffer.
* :class:`MultipartWriter`: a streaming :class:`~ckptio.backends.base.Writer` that uploads
  ``part_size`` parts with at most ``concurrency`` in flight (memory is bounded by about
  ``(concurrency + 1) * part_size``), commits on ``close`` and aborts the upload on failure.
  Small objects (one part) go up in a single request. ``ordered=True`` (GCS resumable uploads)
  uploads parts one after another while the caller fills the next one.

A backend supplies the client calls as coroutines; errors are translated by the backend's
``translate(exc, uri)`` so callers only ever see :mod:`ckptio.errors`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import Any, Awaitable, Callable

from fsspec.asyn import sync

from .base import Buffer, Writer

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


async def parallel_readinto(fetch_into: FetchInto, buf: memoryview, offset: int, part_size: int,
                            concurrency: int) -> int:
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
    for (s, e), g in zip(bounds, got):
        total += g
        if g < e - s:
            break
    return total


class MultipartWriter(Writer):
    """Streaming writer over an object store's multipart (or resumable) upload.

    Subclasses implement the coroutines ``put_single``, ``begin``, ``upload_part``, ``complete`` and
    ``abort_upload``, and ``translate``. ``upload_part(handle, number, offset, data, total)`` gets
    ``total`` (the object's size) only for the last part, and ``None`` before it.
    """

    ordered = False  # True: parts must arrive in order (one in flight), e.g. GCS resumable uploads

    def __init__(self, uri: str, loop: asyncio.AbstractEventLoop, part_size: int, concurrency: int) -> None:
        self.uri = uri
        self._loop = loop
        self.part_size = part_size
        self._sem = threading.BoundedSemaphore(1 if self.ordered else concurrency)
        self._buf = bytearray(part_size)
        self._fill = 0
        self._free: list[bytearray] = []
        self._handle: Any = None
        self._started = False
        self._offset = 0  # bytes handed to parts so far
        self._futures: list[concurrent.futures.Future] = []
        self._state = "open"  # open -> closed | aborted

    # ---- client hooks --------------------------------------------------------------------
    async def put_single(self, data: Buffer) -> None:
        raise NotImplementedError

    async def begin(self) -> Any:
        raise NotImplementedError

    async def upload_part(self, handle: Any, number: int, offset: int, data: Buffer, total: int | None) -> Any:
        raise NotImplementedError

    async def complete(self, handle: Any, tokens: list[Any], total: int) -> None:
        raise NotImplementedError

    async def abort_upload(self, handle: Any) -> None:
        raise NotImplementedError

    def translate(self, exc: BaseException) -> BaseException:
        return exc

    # ---- Writer --------------------------------------------------------------------------
    def write(self, data: Buffer) -> int:
        if self._state != "open":
            raise ValueError(f"write to a {self._state} writer: {self.uri}")
        mv = memoryview(data).cast("B")
        total = len(mv)
        while mv:
            if self._fill == self.part_size:  # full, and more data follows: not the last part
                self._send_buffer(last=False)
            k = min(self.part_size - self._fill, len(mv))
            self._buf[self._fill: self._fill + k] = mv[:k]
            self._fill += k
            mv = mv[k:]
        return total

    def write_all(self, data: Buffer) -> None:
        """Upload ``data`` as the whole object and commit, without copying it into part buffers.

        The caller's buffer is only borrowed: every part is uploaded before this returns.
        """
        mv = memoryview(data).cast("B")
        if self._fill or self._started or len(mv) <= self.part_size:
            self.write(mv)
            return self.close()
        try:
            for start in range(0, len(mv), self.part_size):
                part = mv[start: start + self.part_size]
                self._submit(part, len(mv) if start + self.part_size >= len(mv) else None)
            self._finish()
        except BaseException as e:
            self._abort_quietly()
            raise self._translated(e) from None

    def close(self) -> None:
        if self._state != "open":
            if self._state == "aborted":
                raise ValueError(f"close after abort: {self.uri}")
            return
        try:
            if not self._started:
                data = self._buf if self._fill == self.part_size else memoryview(self._buf)[: self._fill]
                run(self._loop, self.put_single, data)
                self._state = "closed"
                return
            self._send_buffer(last=True)
            self._finish()
        except BaseException as e:
            self._abort_quietly()
            raise self._translated(e) from None
        finally:
            self._buf = bytearray()
            self._free.clear()

    def abort(self) -> None:
        if self._state != "open":
            return
        self._state = "aborted"
        self._buf = bytearray()
        self._free.clear()
        for f in self._futures:
            f.cancel()
        concurrent.futures.wait(self._futures)
        if self._started:
            try:
                run(self._loop, self.abort_upload, self._handle)
            except BaseException as e:
                raise self._translated(e) from None

    # ---- internals -----------------------------------------------------------------------
    def _translated(self, e: BaseException) -> BaseException:
        try:
            return self.translate(e)
        except Exception:  # pragma: no cover - a translate bug must not hide the real error
            return e

    def _abort_quietly(self) -> None:
        # the original error is what the caller needs; a failed abort is chained to nothing
        try:
            self.abort()
        except Exception:
            pass

    def _send_buffer(self, last: bool) -> None:
        buf, fill = self._buf, self._fill
        if fill < len(buf):
            del buf[fill:]  # the last, short part: shrink in place instead of copying
        self._submit(buf, self._offset + fill if last else None, recycle=buf)
        self._buf = self._free.pop() if self._free else bytearray(self.part_size)
        self._fill = 0

    def _submit(self, data: Buffer, total: int | None, recycle: bytearray | None = None) -> None:
        self._sem.acquire()  # bounds the parts in flight, hence memory
        try:
            self._raise_failed()
            if not self._started:
                self._handle = run(self._loop, self.begin)
                self._started = True
            number, offset = len(self._futures) + 1, self._offset
            self._offset += len(data)
            fut = asyncio.run_coroutine_threadsafe(self.upload_part(self._handle, number, offset, data, total), self._loop)
        except BaseException:
            self._sem.release()
            raise

        def done(f: concurrent.futures.Future) -> None:
            if recycle is not None and not f.cancelled() and f.exception() is None and len(recycle) == self.part_size:
                self._free.append(recycle)
            self._sem.release()

        fut.add_done_callback(done)
        self._futures.append(fut)

    def _raise_failed(self) -> None:
        for f in self._futures:
            if f.done() and not f.cancelled() and f.exception() is not None:
                raise f.exception()  # type: ignore[misc]

    def _finish(self) -> None:
        concurrent.futures.wait(self._futures, return_when=concurrent.futures.FIRST_EXCEPTION)
        self._raise_failed()
        tokens = [f.result() for f in self._futures]
        run(self._loop, self.complete, self._handle, tokens, self._offset)
        self._state = "closed"


def no_hidden_retries(session: Any) -> Any:
    """Stop an ``aiohttp.ClientSession`` from silently re-sending an idempotent request (GET, PUT,
    HEAD, DELETE) once when a pooled connection breaks: :class:`ckptio.retry.RetryPolicy` owns
    retries, and a hidden re-send of an upload chunk can corrupt a resumable upload's offsets.
    aiohttp has no public switch; the private flag is set only where it exists."""
    if hasattr(session, "_retry_connection"):
        session._retry_connection = False
    return session

"""The streaming multipart writer the object-store backends (S3, GCS) share.

:class:`MultipartWriter` is a :class:`~ckptio.backends.base.Writer` that uploads parts with at
most ``concurrency`` in flight and the bytes it copies bounded by ``max_buffer_bytes`` (large
writes go up straight from the caller's memory), commits on ``close`` and aborts the upload on
failure; every error it raises is translated. Small objects (one part) go up in a single request.
``ordered=True`` (GCS resumable uploads) uploads parts one after another while the caller fills
the next one. A backend supplies the client calls as coroutines and ``translate(exc, uri)``, so
callers only ever see :mod:`ckptio.errors`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import Any

from ..backends.base import Buffer, Writer
from ..threads import exit_safe
from ..values import parse_size
from .ranged import run

DEFAULT_MAX_BUFFER_BYTES = 48 * 1024 * 1024  # with the overhead of sending: < 64 MiB extra RSS


def constructor_options(local_vars: dict[str, Any]) -> dict[str, Any]:
    """A backend constructor's arguments, from its ``locals()`` taken before anything else is bound."""
    return {k: v for k, v in local_vars.items() if k != "self" and not k.startswith("__")}


def size_option(name: str, value: Any) -> int:
    """A byte-size backend option: an int, or a string such as ``"64MiB"`` (from a settings file)."""
    try:
        n = parse_size(value) if isinstance(value, str) else int(value)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{name}: {e}") from None
    if n <= 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")
    return n


class MultipartWriter(Writer):
    """Streaming writer over an object store's multipart (or resumable) upload.

    Subclasses implement the coroutines ``put_single``, ``begin``, ``upload_part``, ``complete`` and
    ``abort_upload``, and ``translate``. ``upload_part(handle, number, offset, data, total)`` gets
    ``total`` (the object's size) only for the last part, and ``None`` before it; ``data`` may be
    the caller's memory (send it with :class:`~.body.MemoryBody`, never keep it).

    Memory: the bytes copied into part buffers (the part being filled, parts in flight, free
    buffers) stay within ``max_buffer_bytes``: streamed parts are ``part_size`` or smaller, so that
    ``concurrency`` of them plus the one being filled fit. A ``write`` of at least
    ``max_buffer_bytes`` is uploaded straight from the caller's memory (whole parts, up to
    ``concurrency`` at once) and returns when they are up; only its unaligned ends are copied.
    """

    ordered = False  # True: parts must arrive in order (one in flight), e.g. GCS resumable uploads
    min_part_size = 1  # the store's minimum for every part but the last
    part_align = 1  # streamed part sizes are multiples of this
    max_parts: int | None = None  # with a limit, streamed parts double in size every ``max_parts // 10`` parts

    def __init__(
        self,
        uri: str,
        loop: asyncio.AbstractEventLoop,
        part_size: int,
        concurrency: int,
        max_buffer_bytes: int | None = None,
    ) -> None:
        self.uri = uri
        self._loop = loop
        exit_safe(loop)  # its thread work (DNS lookups) still runs in an atexit handler
        self.part_size = part_size
        self.max_buffer_bytes = int(max_buffer_bytes or DEFAULT_MAX_BUFFER_BYTES)
        self._slots = 1 if self.ordered else concurrency
        fit = self.max_buffer_bytes // (self._slots + 1) // self.part_align * self.part_align
        self._stream_part = max(self.min_part_size, min(part_size, fit))
        self._cv = threading.Condition()
        self._inflight = 0
        self._allocated = 0  # bytes of part buffers that exist (filling, in flight, free)
        self._free: list[bytearray] = []
        self._buf = bytearray()
        self._fill = 0
        self._cap = 0  # the size the buffer being filled may reach (it may still be growing towards it)
        self._handle: Any = None
        self._begun: concurrent.futures.Future | None = None  # the request that begins the upload
        self._started = False
        self._offset = 0  # bytes handed to parts so far
        self._futures: list[concurrent.futures.Future] = []
        self._tasks: set[asyncio.Task] = set()  # requests running on the loop (touched on the loop only)
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
        return self._write(data, lend=False)

    def write_borrowed(self, data: Buffer) -> int:
        """Like ``write``, but the caller keeps ``data`` unchanged until ``close``/``abort`` returns:
        whole parts are uploaded from it without waiting, so several writes' parts are in flight
        together (the DCP writer passes tensor memory this way)."""
        return self._write(data, lend=True)

    def _write(self, data: Buffer, lend: bool) -> int:
        if self._state != "open":
            raise ValueError(f"write to a {self._state} writer: {self.uri}")
        mv = memoryview(data).cast("B")
        total = len(mv)
        try:
            step = max(self._part_size(), self.part_size)  # parts sent from the caller's memory cost no buffers
            borrowed = len(mv) >= (step if lend else self.max_buffer_bytes)
            if borrowed and self._fill:  # top up the part being filled, then send it
                mv = self._take(mv)
                if mv:
                    self._send_buffer(last=False)
            first = len(self._futures)
            while borrowed and len(mv) > step:  # the last bytes are copied: close sends them
                self._submit(mv[:step], None)
                mv = mv[step:]
            self._copy(mv)
            self._wait(self._futures[first:] if borrowed and not lend else [])  # the caller may reuse its memory now
        except BaseException as e:
            self._abort_quietly()
            raise self._translated(e) from None
        return total

    def write_all(self, data: Buffer) -> None:
        """Upload ``data`` as the whole object and commit, without copying it into part buffers.

        The caller's buffer is only borrowed: every part is uploaded before this returns.
        """
        mv = memoryview(data).cast("B")
        if self._state == "open" and not self._fill and not self._started and len(mv) <= self.part_size:
            # one request, straight from the caller's memory: it must not outlive this call (an
            # interrupted wait cancels it and waits for it, so the caller's memory is free again)
            fut = asyncio.run_coroutine_threadsafe(self._tracked(self.put_single(mv)), self._loop)
            try:
                fut.result()
                self._state = "closed"
                return None
            except BaseException as e:
                fut.cancel()
                self._abort_quietly()  # abort waits until no request reads the caller's memory (_settle)
                raise self._translated(e) from None
        if self._fill or self._started or len(mv) <= self.part_size:
            self.write(mv)
            return self.close()
        try:
            for start in range(0, len(mv), self.part_size):
                part = mv[start : start + self.part_size]
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
                data = self._buf if self._fill == len(self._buf) else memoryview(self._buf)[: self._fill]
                run(self._loop, self.put_single, data)
                self._state = "closed"
                return
            self._send_buffer(last=True)
            self._finish()
        except BaseException as e:
            self._abort_quietly()
            raise self._translated(e) from None
        finally:
            self._release_buffers()

    def abort(self) -> None:
        if self._state != "open":
            return
        self._state = "aborted"
        for f in self._futures:  # parts not started never start; those running are cancelled
            f.cancel()
        run(self._loop, self._settle)  # ... and have stopped reading their bytes (maybe the caller's) now
        concurrent.futures.wait(self._futures)
        self._futures = []  # each keeps its done callback, which holds this writer: no reference cycle
        self._release_buffers()
        if not self._started and self._begun is not None:  # a Ctrl-C while the upload began: it may be there
            concurrent.futures.wait([self._begun])
            self._started = not self._begun.cancelled() and self._begun.exception() is None
            self._handle = self._begun.result() if self._started else None
        if self._started:
            try:
                run(self._loop, self.abort_upload, self._handle)
            except BaseException as e:
                raise self._translated(e) from None

    # ---- internals -----------------------------------------------------------------------
    async def _tracked(self, coro: Any) -> Any:
        """Run a request's coroutine as a task that :meth:`_settle` can wait for."""
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            return await coro
        finally:
            self._tasks.discard(task)

    async def _settle(self) -> None:
        """Cancel the requests still running and wait until they have ended. Cancelling the future
        ``run_coroutine_threadsafe`` returned marks it done at once, while its task may still be sending
        the part or hashing it on a worker thread (lent bytes: the caller's memory)."""
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks)

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

    def _release_buffers(self) -> None:
        with self._cv:
            self._buf, self._fill, self._cap = bytearray(), 0, 0
            self._free.clear()
            self._allocated = 0

    def _part_size(self) -> int:
        """The size of the next streamed part: it grows when a part-count limit would be reached."""
        if self.max_parts is None:
            return self._stream_part
        return min(self._stream_part << (len(self._futures) // (self.max_parts // 10)), 5 << 30)

    def _copy(self, mv: memoryview) -> None:
        """Copy ``mv`` into part buffers, sending each full one when more data follows."""
        while mv:
            if self._fill == self._cap:
                if self._fill:  # full, and more data follows: not the last part
                    self._send_buffer(last=False)
                self._buf, self._cap = self._new_buffer()
            mv = self._take(mv)

    def _take(self, mv: memoryview) -> memoryview:
        """Copy what fits of ``mv`` into the buffer being filled; return the rest."""
        k = min(self._cap - self._fill, len(mv))
        if len(self._buf) == self._fill:  # a growing first buffer: append (no zero-filled pages)
            self._buf += mv[:k]
        else:
            self._buf[self._fill : self._fill + k] = mv[:k]
        self._fill += k
        return mv[k:]

    def _new_buffer(self) -> tuple[bytearray, int]:
        """A buffer to fill and the size it may reach. The first buffer of an upload starts empty and
        grows as bytes arrive: a small object costs its own size, not a whole part of fresh memory."""
        size = self._part_size()
        with self._cv:
            while True:
                self._raise_failed()
                if self._free and len(self._free[-1]) == size:
                    return self._free.pop(), size
                while self._free:  # a smaller size from before the parts grew
                    self._allocated -= len(self._free.pop())
                if self._allocated + size <= max(self.max_buffer_bytes, 2 * size):
                    self._allocated += size
                    return (bytearray() if not self._started else bytearray(size)), size
                self._cv.wait()

    def _send_buffer(self, last: bool) -> None:
        buf, fill = self._buf, self._fill
        recycle = fill == self._cap
        data = buf if recycle else memoryview(buf)[:fill]  # the last, short part
        self._buf, self._fill, self._cap = bytearray(), 0, 0
        self._submit(data, self._offset + fill if last else None, recycle=buf if recycle else None)

    def _submit(self, data: Buffer, total: int | None, recycle: bytearray | None = None) -> None:
        with self._cv:  # bounds the parts in flight
            while True:
                self._raise_failed()
                if self._inflight < self._slots:
                    self._inflight += 1
                    break
                self._cv.wait()
        try:
            if not self._started:  # a future abort() waits for: a begin whose wait was interrupted
                self._begun = asyncio.run_coroutine_threadsafe(self.begin(), self._loop)  # may still start one
                self._handle = self._begun.result()
                self._started = True
            number, offset = len(self._futures) + 1, self._offset
            self._offset += len(data)
            fut = asyncio.run_coroutine_threadsafe(
                self._tracked(self.upload_part(self._handle, number, offset, data, total)), self._loop
            )
        except BaseException:
            with self._cv:
                self._inflight -= 1
                self._cv.notify_all()
            raise

        def done(f: concurrent.futures.Future) -> None:
            with self._cv:
                self._inflight -= 1
                if recycle is not None and self._state == "open":
                    if len(recycle) == self._part_size():
                        self._free.append(recycle)
                    else:
                        self._allocated -= len(recycle)
                self._cv.notify_all()

        fut.add_done_callback(done)
        self._futures.append(fut)

    def _raise_failed(self) -> None:
        for f in self._futures:
            if f.done() and not f.cancelled() and f.exception() is not None:
                raise f.exception()  # type: ignore[misc]

    def _wait(self, futures: list[concurrent.futures.Future]) -> None:
        if futures:
            concurrent.futures.wait(futures, return_when=concurrent.futures.FIRST_EXCEPTION)
            self._raise_failed()

    def _finish(self) -> None:
        self._wait(self._futures)
        tokens = [f.result() for f in self._futures]
        run(self._loop, self.complete, self._handle, tokens, self._offset)
        self._state = "closed"
        self._futures = []  # each keeps its done callback, which holds this writer: no reference cycle

"""Reading ``.fpk`` files: the sources their bytes come from (the metadata: :mod:`.meta`; the payloads:
:mod:`.payloads`).

A source is a local file descriptor (a local file, or any backend's ``local_file``), an open binary
file, or ranged reads from any backend. Local load: parallel preads into fresh buffers (populated
with one madvise first), each payload verified as it is read (in ``osio.HOT_PIECE`` pieces, each hashed
while in the CPU cache: :meth:`Source.read_each`), or a private mapping with
``mmap=True``; an object whose backend holds its bytes in this process (``Backend.held``: memory://)
is copied out of them the same way (a full load of one of up to ``WHOLE_LOCAL_MAX``: whole, into one
buffer its payloads are views of, :class:`BufferSource`), and so is a backend whose reads are local
(``Backend.reads_local``: an incremental step's blocks), straight into the buffers. Remote full load: the first
``min(part_size, HEAD_PREFETCH)`` bytes and the last ``TAIL_PREFETCH`` are read ahead (header, footer
and metadata, and the first payloads, in two requests); once the small one is in, the rest is read in
ranged reads shared out evenly over ``concurrency`` connections (at most ``part_size`` each) that wait for
nothing read ahead (a payload straddling the first range fetches only its part outside it), so each
byte is fetched once; the header is checked as soon as it lands. An object of up to ``MIDDLE_MAX`` has
its middle read too as soon as the first reply tells the size (a load that may return views), so all of
it is read ahead, in ranges sized from what the store's replies showed (:mod:`.pacing`).
Payload checksums are verified over an incremental step's blocks too (``Backend.assembled``: a
block's name proves its bytes are some stored block's, a payload checksum that they are this tensor's);
a verified load reads them without their block hashes (``Backend.for_checked_reads``: each byte hashed
once), and on a mismatch reads them again with those hashes, whose error names a damaged block.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import functools
import gc
import io
import os
import stat as _stat
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from ...backends.base import Backend, Held, start_sized
from ...errors import IntegrityError
from ...osio import (
    address,
    anonymous,
    copy_bytes,
    open_for_reading,
    preadinto,
    preadinto_each,
    preadv_into,
    translate_os_errors,
)
from ...threads import all_of, shared_pool
from . import pacing
from .layout import ALIGN, CHUNK
from .source import Source, fill

TAIL_PREFETCH = 256 << 10  # remote loads read this much of the end at once: footer and metadata in one request
# ... and at most this much of the start (the header, the first payloads; a smaller object whole) in another:
# one S3 connection streams ~90 MB/s, so a larger first range, fetched before the layout is known, would
# hold the load back (32 MiB through the benchmark's realistic proxy with a 16 MiB first range: 0.28 s)
HEAD_PREFETCH = 8 << 20
# a remote load's first GET: the caller faults in this much of the buffer while the reply's headers are awaited,
# then up to the size they tell. One step of osio.fault_in_ahead: a 1 MiB load gains as much as with 1 MiB
# guessed, and a 6 KB one pays 0.2 ms of CPU, not 0.7 (GCS emulator, 91 rounds)
FAULT_GUESS = 256 << 10
# A remote load reads the object's end with its first range where that needs no size (an S3 suffix
# range) and the store is slow to answer: its last first replies took over SLOW_STORE (the median of
# the last few, per store), or this one has not told the size TAIL_EARLY after its request. The layout is then known
# a round trip sooner. Through the realistic proxy (20 ms to the first byte), the end with the first
# range, interleaved rounds: 32 MiB 0.239 -> 0.256, 256 MiB 0.493 -> 0.515 GB/s. A store that answers
# sooner (loopback moto: 4 ms, 7 at p90) keeps one request for a small object: sent to it after 5 ms,
# the second request took 1 MiB loads from 0.129 to 0.082 GB/s. A load that reports progress
# (``progress=``) does not: its counted reads must not overlap.
SLOW_STORE = 0.010
TAIL_EARLY = 0.015
# (a store is slow when the median of its last first replies' times to tell the size is over SLOW_STORE:
# pacing.first_reply, kept per store, the backend under wrappers such as a version pin)
# A full remote load of an object of up to MIDDLE_MAX bytes reads the part between its first range and its
# end at once, once the first reply tells the size, not after the end's round trip has told the layout:
# payloads there come back as views of that buffer, as those in the first range and the end do; in ranges
# of pacing.middle_piece (fewer, longer ones where one connection of the store is fast). Interleaved
# rounds, loopback moto: 32 MiB 0.358 -> 0.425, 0.416 -> 0.489, 0.436 -> 0.486 GB/s (1.13-1.26x ->
# 1.41-1.43x S3Checkpoint), 48 MiB 0.488 -> 0.553, 16 MiB 0.372 -> 0.415; through the realistic proxy
# (20 ms, 90 MB/s a connection), where the end already comes with the first range, unchanged (32 MiB
# 0.253 -> 0.249, 0.252 -> 0.251). Larger objects keep their payloads in tensors of their own.
MIDDLE_MAX = 64 << 20
LOCAL_TAIL = 4 << 10  # a local file's end: the footer and a small file's metadata in one read, not two
# A full load that may return views of an object of up to WHOLE_LOCAL_MAX whose bytes its backend holds
# (memory://, :class:`HeldSource`) copies it whole into one buffer
# (:class:`BufferSource`): the metadata and the payloads are views of it, as a small remote object's are.
# memory://, the benchmark's state (12+ tensors), every page touched after, 150 interleaved rounds, median ms,
# read by payload -> whole: 6 KiB 0.280 -> 0.227, 256 KiB 0.320 -> 0.269, 1 MiB 0.476 -> 0.435, 4 MiB
# 0.868 -> 0.857; 8 MiB 1.971 -> 2.557 (by payload, two threads copy, the GIL released): not above 4 MiB
WHOLE_LOCAL_MAX = 4 << 20


def _store_of(backend: Backend) -> Backend:
    """The backend under wrappers (a version pin, a counter): where a store's reply times are kept."""
    for _ in range(8):
        inner = getattr(backend, "inner", None)
        if not isinstance(inner, Backend):
            break
        backend = inner
    return backend


class FdSource(Source):
    concurrency = 2
    local = True
    prefetch = LOCAL_TAIL

    def __init__(self, fd: int, name: str, owned: bool) -> None:
        self.fd, self.name, self._owned = fd, name, owned
        self.mappable = owned  # a caller's open file may be written through the caller's handle
        self.size = os.fstat(fd).st_size

    def _fd(self) -> int:
        if self.fd is None:
            raise ValueError(f"{self.name}: read after the source was closed")
        return self.fd

    def readinto(self, mv: memoryview, offset: int) -> int:
        return preadinto(self._fd(), mv, offset)

    def read_each(self, mv: memoryview, offset: int, each: Callable[[memoryview], Any]) -> int:
        return preadinto_each(self._fd(), mv, offset, each)

    def read(self, offset: int, n: int) -> bytes:
        data = os.pread(self._fd(), n, offset)  # small reads (header, footer, metadata): one call, no staging
        return data if len(data) == n else super().read(offset, n)  # short: resumed, or truncated

    def readv(self, mvs: list[memoryview], offset: int) -> int:
        return preadv_into(self._fd(), mvs, offset)

    def close(self) -> None:
        if self._owned and self.fd is not None:
            os.close(self.fd)
            self.fd = None


class BackendSource(Source):
    prefetch = TAIL_PREFETCH

    def __init__(self, backend: Backend, uri: str) -> None:
        self.backend, self.name = backend.pin_version(uri), uri  # every read from one version of it
        self._store = _store_of(backend)  # what the first replies' times are kept for
        self._size: int | None = None  # looked up on first use (a full load asks for it with its first read)
        self.concurrency = backend.concurrency
        self.part_size = backend.part_size
        self.local = backend.reads_local
        if self.local:  # local disks (an incremental step's blocks): as a local file is read
            # no tail read past the footer: a read counted for progress must not overlap another
            self.prefetch, self.concurrency, self.part_size = 0, FdSource.concurrency, CHUNK
        self._ahead: list[tuple[int, memoryview, Any]] = []  # ranges read ahead: (offset, buffer, future)
        self._pool: cf.Executor | None = None
        self._checked: Backend | None = None  # after checks_payloads: the backend whose reads check blocks
        self._closing = threading.Event()  # close(): a read ahead in pieces starts no more of them

    def checks_payloads(self) -> None:
        fast = self.backend.for_checked_reads(self.name)
        if fast is not self.backend:
            self._checked, self.backend = self.backend, fast

    def blame(self, offset: int, n: int) -> None:
        checked = self._checked
        if checked is None:
            return
        scratch = memoryview(bytearray(min(n, CHUNK)))
        for pos in range(offset, offset + n, CHUNK):
            fill(lambda m, o: checked.readinto(self.name, m, o), scratch[: min(CHUNK, offset + n - pos)], pos)

    @property
    def size(self) -> int:  # type: ignore[override]  # a plain attribute on other sources
        if self._size is None:
            self._size = self.backend.stat(self.name).size
        return self._size

    def read_ahead(self, middle: bool = False) -> None:
        """For a full load: fetch the first ``min(part_size, HEAD_PREFETCH)`` bytes and the last
        ``prefetch``, two requests.

        The first needs no size: it starts at once and the object's size comes with its reply's
        headers (``Backend.read_head``), so an object of up to that size costs one request; the
        header and the first payloads come with it. The second is small (footer and metadata), so the
        layout is known after one short request and the reads of the rest start then, while the first
        is still streaming (a 256 MiB load at 90 MB/s a connection waited 0.8 s for a part-sized tail:
        2.5 s -> 1.7 s). Where the store is slow to answer (:data:`SLOW_STORE`, :data:`TAIL_EARLY`) and
        reads an object's end without its size in one request (``Backend.start_read_tail``: an S3 suffix
        range), the second starts with the first, or as soon as the size is late, not once it is known:
        the layout comes a round trip sooner (for an object the first range holds whole, its bytes go
        unused). The rest is read in about ``concurrency`` ranges (at most ``part_size`` each).

        ``middle`` (the payloads may be views of what holds them): for an object of up to
        :data:`MIDDLE_MAX`, the bytes between the first range and the end are read too, as soon as the
        size is known (:meth:`_read_middle`), instead of into each payload's tensor once the end has
        told the layout: a round trip sooner where the end is not read with the first range.
        """
        self._pool = shared_pool()  # threads started once per process, not per load
        # anonymous memory: faulted in only as far as the object fills it (no zeroing first)
        first = anonymous(min(self.part_size, HEAD_PREFETCH))
        ends: list[tuple[cf.Future[int], memoryview]] = []  # the suffix read started, and its buffer

        def start_end() -> None:  # the size is late: a remote round trip, which the end need not wait for
            # the end's bytes as aligned in it as in the file (payloads there are returned as views of it);
            # not waited for by close() if its bytes go unused: the request's views keep the buffer alive
            end = anonymous(self.prefetch + ALIGN - 1)
            end_f = self.backend.start_read_tail(self.name, end, ALIGN)
            if end_f is not None:
                ends.append((end_f, end))

        past = pacing.first_reply(self._store)
        slow = past is not None and past > SLOW_STORE
        t0 = time.monotonic()
        sized_at: list[float] = []
        head_f, size = start_sized(
            self.backend,
            self.name,
            first,
            lambda f: self._ahead.append((0, first[:0], f)),  # close() waits for the first read whatever happens
            fault_in=FAULT_GUESS,
            late=(0.0 if slow else TAIL_EARLY, start_end) if self.prefetch else None,
            told=lambda: sized_at.append(time.monotonic()),
        )
        if sized_at:
            pacing.note_first_reply(self._store, sized_at[0] - t0)
            if size > len(first):  # the body fills the first range: its speed is one connection's
                head_f.add_done_callback(functools.partial(pacing.note_body, self._store, len(first), sized_at[0]))
        if self._size is None:
            self._size = size
        head = min(self.size, len(first))
        # only the footer and (usually) the metadata: the layout is known after one small request, so the
        # reads of the rest start without waiting for a part_size body at 90 MB/s a connection
        tail = min(self.size - head, self.prefetch)
        end_at = self.size  # where the range read for the end starts
        if tail and ends:  # the suffix read: [size - got, size), less what the head holds
            end_f, end = ends[0]
            got = min(len(end) - ALIGN + 1, self.size)
            at = (self.size - got) % ALIGN  # where it put them (Backend.start_read_tail)
            skip = max(head, self.size - got) - (self.size - got)
            end_at, view = self.size - got + skip, end[at + skip : at + got]
            self._ahead.append((end_at, view, self._or_by_offset(end_f, skip, view, end_at)))
        elif tail:  # the tail holds the metadata; it starts on an ALIGN boundary, as payloads do (views of it)
            end_at = max(head, (self.size - tail) // ALIGN * ALIGN)
            buf = anonymous(self.size - end_at)
            self._ahead.append((end_at, buf, self._pool.submit(self._fetch, buf, end_at)))
        if middle and self.size <= MIDDLE_MAX and end_at > head:
            self._ahead.append((head, *self._read_middle(head, end_at)))
        self._ahead[0] = (0, first[:head], head_f)

    def _read_middle(self, lo: int, hi: int) -> tuple[memoryview, cf.Future[int]]:
        """Bytes ``[lo, hi)`` into fresh anonymous memory, each as aligned in it as in the file (payloads
        there are returned as views of it), in ranges of :func:`.pacing.middle_piece` bytes, at most
        ``concurrency`` at once (the backend's bound on requests in flight), none started once the
        source is closing (a load that failed on the head or the end waits only for those in flight):
        the buffer and a future of the count read."""
        n = hi - lo
        buf = anonymous(n + ALIGN)[lo % ALIGN :][:n]  # each byte as aligned as in the file
        step = pacing.middle_piece(self._store, n, self.concurrency, self.part_size)
        starts = iter(range(0, n, step))
        lock = threading.Lock()

        def reader() -> int:  # one connection's share: the next piece until none is left
            total = 0
            while not self._closing.is_set():
                with lock:
                    a = next(starts, None)
                if a is None:
                    break
                total += self._fetch(buf[a : a + step], lo + a)
            return total

        assert self._pool is not None  # read_ahead set it
        readers = min(max(1, self.concurrency), -(-n // step))
        return buf, all_of([self._pool.submit(reader) for _ in range(readers)])

    def _or_by_offset(self, fut: cf.Future[int], skip: int, view: memoryview, offset: int) -> cf.Future[int]:
        """A future of the suffix read ``fut``'s bytes that ``view`` holds (its count less ``skip``); if that
        read failed (refused, or any other error: it only saves a round trip), ``view`` read by offset."""
        out: cf.Future[int] = cf.Future()
        out.set_running_or_notify_cancel()
        pool = shared_pool()  # the load's pool (self._pool)

        def by_offset() -> None:
            try:
                out.set_result(self._fetch(view, offset))
            except BaseException as e:  # noqa: BLE001 - handed on through the future
                out.set_exception(e)

        def done(f: cf.Future[int]) -> None:
            if f.exception() is None:
                out.set_result(f.result() - skip)
            else:  # on the IO loop's thread: the read itself runs on the pool
                pool.submit(by_offset)

        fut.add_done_callback(done)
        return out

    def _fetch(self, mv: memoryview, offset: int) -> int:
        return fill(lambda m, o: self.backend.readinto(self.name, m, o), mv, offset)

    def read_each(self, mv: memoryview, offset: int, each: Callable[[memoryview], Any]) -> int:
        if not self.local or self._ahead:  # reads copied out of ranges read ahead: checked once whole
            return super().read_each(mv, offset, each)
        return fill(lambda m, o: self.backend.readinto_each(self.name, m, o, each), mv, offset)

    def readv(self, mvs: list[memoryview], offset: int) -> int:
        """Buffers that overlap a range read ahead are copied from it one by one; each run of the
        others is one scatter read (one request, streamed through them, no staging)."""
        total, run_at = 0, offset
        run: list[memoryview] = []

        def flush() -> bool:
            nonlocal total, run
            want = sum(len(m) for m in run)
            got = self.backend.readv(self.name, run, run_at) if run else 0
            total, run = total + got, []
            return got == want

        pos = offset
        for m in mvs:
            if any(off < pos + len(m) and pos < off + len(data) for off, data, _ in self._ahead):
                if not flush():
                    return total
                got = self.readinto(m, pos)
                total += got
                if got < len(m):
                    return total
            else:
                if not run:
                    run_at = pos
                run.append(m)
            pos += len(m)
        flush()
        return total

    def readinto(self, mv: memoryview, offset: int) -> int:
        lo, hi = offset, offset + len(mv)
        for i in range(len(self._ahead)):  # copy what is read ahead at either end of the request
            off, data = self._ahead[i][:2]
            end = off + len(data)
            start_in, end_in = off <= lo < end, lo < off < hi <= end
            if start_in or end_in:
                self._arrived(i)
            if start_in:
                k = min(hi, end) - lo
                mv[lo - offset : lo - offset + k] = data[lo - off : lo - off + k]
                lo += k
            if lo < hi and end_in:
                mv[off - offset : hi - offset] = data[: hi - off]
                hi = off
        if lo < hi:
            got = self._fetch(mv[lo - offset : hi - offset], lo)
            if got < hi - lo:
                return lo - offset + got
        return len(mv)

    def _arrived(self, i: int) -> None:
        """Wait for the ``i``-th range read ahead; IntegrityError if it came short. Its error is raised with
        no frame holding its future (the error's traceback holds the frames: a reference cycle through the
        future, which holds the error, would keep them and their buffers until the gc runs)."""
        off, data = self._ahead[i][:2]
        err = self._ahead[i][2].exception()
        if err is not None:
            try:
                raise err
            finally:
                del err
        got = self._ahead[i][2].result()
        if got != len(data):
            raise IntegrityError(f"{self.name}: truncated: bytes [{off}, {off + len(data)}) returned only {got}")

    def view(self, offset: int, n: int) -> bytes | memoryview:
        """A read-only view of a range read ahead that holds bytes ``[offset, offset + n)`` (the footer and
        metadata of a full load: no copy of the 256 KiB tail, twice), else a copy."""
        ahead = self._within_ahead(offset, n, 1)
        return ahead.toreadonly() if ahead is not None else self.read(offset, n)

    def ahead_view(self, offset: int, nbytes: int, wait: bool = True) -> memoryview | None:
        """The bytes ``[offset, offset + nbytes)`` as a view of a range read ahead that holds them all
        (once its read is in; ``wait=False``: at once, filled when :meth:`wait_ahead` returns), else
        None. A view keeps its buffer alive; nothing else writes to it."""
        # a view must be as aligned as the payload is in the file (element size; some kernels fault)
        return self._within_ahead(offset, nbytes, ALIGN, wait)

    def _within_ahead(self, offset: int, nbytes: int, align: int, wait: bool = True) -> memoryview | None:
        for i in range(len(self._ahead)):
            off, data = self._ahead[i][:2]
            if off <= offset and offset + nbytes <= off + len(data) and (offset - off + address(data)) % align == 0:
                if wait:
                    self._arrived(i)
                return data[offset - off : offset - off + nbytes]
        return None

    def outside_ahead(self, offset: int, nbytes: int) -> tuple[int, int, list[tuple[int, int]]]:
        lo, hi = offset, offset + nbytes
        inside: list[tuple[int, int]] = []
        for a_off, data, _ in self._ahead:
            a_end = a_off + len(data)
            if a_off <= lo and hi <= a_end:  # wholly inside: nothing to fetch
                inside.append((lo, hi - lo))
                return hi, hi, inside
            if a_off <= lo < a_end < hi:  # starts inside the range: fetch from its end
                inside.append((lo, a_end - lo))
                lo = a_end
            elif lo < a_off < hi <= a_end:  # ends inside: fetch up to its start
                inside.append((a_off, hi - a_off))
                hi = a_off
        return lo, hi, inside

    def wait_ahead(self) -> None:
        for i in range(len(self._ahead)):
            self._arrived(i)

    def close(self) -> None:
        """The reads ahead that have not started are cancelled; those in flight end before this returns."""
        self._closing.set()
        futures = [fut for _, _, fut in self._ahead if not fut.cancel()]
        self._pool = None
        if futures:
            cf.wait(futures)
        self._ahead = []


class BufferSource(Source):
    """A file held whole in one writable buffer of its own, aligned as its payloads are (:data:`ALIGN`):
    its metadata and payloads are views of it (:meth:`HeldSource.held_whole`)."""

    local = True

    def __init__(self, buf: memoryview, name: str) -> None:
        self.buf, self.name, self.size = buf, name, len(buf)

    def readinto(self, mv: memoryview, offset: int) -> int:
        n = max(0, min(len(mv), self.size - offset))
        mv[:n] = self.buf[offset : offset + n]
        return n

    def view(self, offset: int, n: int) -> bytes | memoryview:
        return self._span(offset, n).toreadonly()

    def ahead_view(self, offset: int, nbytes: int, wait: bool = True) -> memoryview | None:
        return self._span(offset, nbytes)

    def _span(self, offset: int, n: int) -> memoryview:
        _check_span(self, offset, n)
        return self.buf[offset : offset + n]


def _check_span(src: Source, offset: int, n: int) -> None:
    """Bytes ``[offset, offset + n)`` lie within ``src`` (a source holding the whole file); IntegrityError
    naming it if not. The layout is validated before any span is asked for: never, but never short."""
    if offset < 0 or offset + n > src.size:
        raise IntegrityError(f"{src.name}: truncated: wanted bytes [{offset}, {offset + n}) of {src.size}")


class HeldSource(Source):
    """An object whose bytes its backend holds in this process (``Backend.held``: memory://): read by
    copying out of them, one version whatever is written meanwhile; a full load of up to
    :data:`WHOLE_LOCAL_MAX` copies it whole into one buffer (:meth:`held_whole`)."""

    local = True
    concurrency = 2  # copies of large payloads release the GIL (osio.copy_bytes): two threads, as files
    prefetch = 0  # a view costs nothing: the footer and the metadata are viewed exactly, never a byte twice

    def __init__(self, held: Held, name: str) -> None:
        self.data, self._on_read, self.name, self.size = held.data, held.on_read, name, len(held.data)

    def readinto(self, mv: memoryview, offset: int) -> int:
        if offset < 0:
            raise IntegrityError(f"{self.name}: a read at offset {offset}")
        n = copy_bytes(mv, self.data, offset)
        self._on_read(n)
        return n

    def view(self, offset: int, n: int) -> bytes | memoryview:
        """Bytes ``[offset, offset + n)``: a read-only view of the held bytes, no copy."""
        _check_span(self, offset, n)
        self._on_read(n)
        return memoryview(self.data)[offset : offset + n]

    def read(self, offset: int, n: int) -> bytes:
        return bytes(self.view(offset, n))

    def readv(self, mvs: list[memoryview], offset: int) -> int:
        total = 0
        for m in mvs:
            got = self.readinto(m, offset + total)
            total += got
            if got < len(m):
                break
        return total

    def held_whole(self) -> Source:
        if self.size > WHOLE_LOCAL_MAX:
            return self
        import torch  # a full load's, which builds tensors anyway

        # from the allocator's heap (recycled, warm pages), aligned as torch aligns every allocation
        buf = memoryview(torch.empty(self.size, dtype=torch.uint8, device="cpu").numpy())  # type: ignore[arg-type]
        if address(buf) % ALIGN:
            return self
        self.readinto(buf, 0)
        return BufferSource(buf, self.name)


class FileSource(Source):
    def __init__(self, f: io.RawIOBase | io.BufferedIOBase) -> None:
        self.f, self.name = f, getattr(f, "name", "<file object>")
        self.size = f.seek(0, io.SEEK_END)
        self._lock = threading.Lock()

    def readinto(self, mv: memoryview, offset: int) -> int:
        with self._lock:
            self.f.seek(offset)
            return fill(lambda m, o: self.f.readinto(m) or 0, mv, offset)


def open_source(uri_or_file: Any, backend_options: dict) -> Source:
    if isinstance(uri_or_file, (str, os.PathLike)):
        from ...context import resolve

        backend, uri = resolve(uri_or_file, **backend_options)
        return source_for(backend, uri)
    f = uri_or_file
    try:
        fd = f.fileno()
        if _stat.S_ISREG(os.fstat(fd).st_mode):
            return FdSource(fd, getattr(f, "name", f"<fd {fd}>"), owned=False)
    except (AttributeError, OSError, io.UnsupportedOperation):
        pass
    return FileSource(f)


def source_for(backend: Backend, uri: str) -> Source:
    """The descriptor of the backend's local file when it has one (a local file, a node-local cache
    entry), the bytes it holds in memory (``Backend.held``), else ranged reads from the backend."""
    held = backend.held(uri)
    if held is not None:
        return HeldSource(held, uri)
    with backend.local_file(uri) as path:
        if path is not None:
            with translate_os_errors(uri):
                # the open file outlives the block (eviction only unlinks)
                fd = open_for_reading(path)
            return FdSource(fd, uri, owned=True)
    return BackendSource(backend, uri)


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Building ten thousands of small objects would otherwise trigger full collections over everything."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def with_source(src: Source, fn: Callable[[Source], Any]) -> Any:
    try:
        with gc_paused():
            return fn(src)
    finally:
        src.close()

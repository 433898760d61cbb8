"""OS-level I/O: the system calls and ctypes tricks that plain ``os`` calls do not cover, in one place.

``preadinto`` fills a buffer with ``preadv`` (in calls the kernel accepts), ``preadinto_each`` in
pieces handed on while in the CPU cache (checked as read); ``sync_file_range``
(Linux, via ctypes) starts writeback of a range without waiting, and ``WriteBehind`` calls it as a
file is written, so a durable save's final fsync has little left to do; ``prefault`` populates a
fresh buffer with one ``madvise(MADV_POPULATE_WRITE)`` (after checking with ``mincore`` that it is
not resident already) before a read fills it (``prefault_range`` for a raw address), and
``fault_in_ahead`` does it on a waiting thread while another thread's read is in flight
(``fault_in_striped`` for the buffers of several reads at once); ``memmove``
copies between raw addresses on the calling thread in GIL-free chunks (async staging),
``copy_bytes`` out of a ``bytes`` object the same way (memory:// reads); ``translate_os_errors``
turns an ``OSError`` into the ckptio error that names the object. Each is a no-op or declines
(returns None) where the platform lacks it.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap as _mmap
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from .errors import (
    AccessDeniedError,
    AlreadyExistsError,
    CkptioError,
    IsDirectoryError,
    NotDirectoryError,
    NotFoundError,
    TransferError,
)

PREFAULT_MIN = 1 << 20  # local reads into fresh buffers at least this large populate them first
# Local reads checked as they go are read in pieces of this much, each hashed right after its read while
# in the CPU cache (1 MiB of L2 a core here). 1 GiB from the page cache into resident memory, read then
# xxh3 over 64 MiB reads vs in pieces, 7 rounds: 2 threads 75.8 -> 57.3 ms (256 KiB 63.4, 4 MiB 62.3),
# 1 thread 139 -> 105 ms
HOT_PIECE = 1 << 20


@contextlib.contextmanager
def translate_os_errors(uri: str) -> Iterator[None]:
    """Re-raise OSErrors as ckptio errors naming ``uri`` (a ckptio error already names its object)."""
    try:
        yield
    except OSError as e:
        err = translated(e, uri)
        if err is e:
            raise
        try:
            raise err from e
        finally:  # the error's traceback holds this frame: no reference cycle (collected only by the gc)
            del err


def translated(e: OSError, uri: str) -> OSError:
    """The ckptio error naming ``uri`` for the OSError ``e`` (``e`` itself for a ckptio error, which
    names its object already, or an error with no better name)."""
    if isinstance(e, CkptioError):
        return e
    if isinstance(e, FileNotFoundError):
        return NotFoundError(uri)
    if isinstance(e, FileExistsError):
        return AlreadyExistsError(uri)
    if isinstance(e, PermissionError):
        return AccessDeniedError(uri)
    if isinstance(e, IsADirectoryError):
        return IsDirectoryError(errno.EISDIR, f"is a directory: {uri}", uri)
    if isinstance(e, NotADirectoryError):
        return NotDirectoryError(errno.ENOTDIR, f"a parent of {uri} is a file, not a directory", uri)
    if e.errno == errno.ESPIPE:  # a positioned read of a pipe
        return TransferError(errno.ESPIPE, f"not a regular file (a pipe or a socket?): {uri}", uri)
    full = {
        errno.ENOSPC: "no space left on device",
        errno.EDQUOT: "disk quota exceeded",
        errno.EFBIG: "file too large (the process's file size limit, ulimit -f, or the filesystem's)",
    }
    if e.errno in full:
        return TransferError(e.errno, f"{full[e.errno]} while writing {uri}", uri)
    if e.errno == errno.EROFS:
        return AccessDeniedError(uri, "read-only file system")
    return e


def nonblocking(path: str, flags: int) -> int:
    """``os.open`` non-blocking (an ``opener`` for :func:`open`), so a pipe put where a file should be is
    read as empty instead of waiting for a writer forever (a regular file reads as ever)."""
    return os.open(path, flags | os.O_NONBLOCK)


def open_for_reading(path: str) -> int:
    """A read-only, :func:`nonblocking` descriptor of ``path`` (the caller closes it)."""
    return nonblocking(path, os.O_RDONLY)


@contextlib.contextmanager
def reading(path: str, uri: str) -> Iterator[int]:
    """:func:`open_for_reading` for the block, closed after it; OS errors name ``uri``."""
    with translate_os_errors(uri):
        fd = open_for_reading(path)
        try:
            yield fd
        finally:
            os.close(fd)


def preadinto(fd: int, mv: memoryview, offset: int) -> int:
    """``pread`` into ``mv`` until full or EOF (in <=1 GiB calls; Linux caps one read at ~2 GiB)."""
    return preadv_into(fd, [mv], offset)


def preadinto_each(fd: int, mv: memoryview, offset: int, each: Callable[[memoryview], Any]) -> int:
    """:func:`preadinto` in :data:`HOT_PIECE` pieces, each handed to ``each`` (in order) right after its
    read, while it is still in the CPU cache: a checksum there costs a fraction of a pass over memory."""
    total, size = 0, len(mv)
    while total < size:
        piece = mv[total : total + HOT_PIECE]
        n = os.preadv(fd, [piece], offset + total)  # one call a piece (no more than HOT_PIECE)
        if 0 < n < len(piece):  # a short read before the end: go on
            n += preadinto(fd, piece[n:], offset + total + n)
        if n:
            each(piece if n == len(piece) else piece[:n])
        total += n
        if n < len(piece):
            break
    return total


def anonymous(n: int) -> memoryview:
    """``n`` (at least 1) bytes of anonymous memory: page-aligned, faulted in only as written (no zeroing
    first) and private, so a forked child (a DataLoader worker) gets a copy on write, never the pages
    of tensors the parent made from it."""
    return memoryview(_mmap.mmap(-1, max(1, n), flags=_mmap.MAP_PRIVATE))


def fresh_bytes(n: int) -> tuple[bytes, memoryview]:
    """A new ``bytes`` object of ``n`` bytes, not yet filled, and a writable view of its buffer, for a read
    that fills it before anyone else sees it: the bytes a whole-object read returns, without a copy
    out of a staging buffer (``PyBytes_FromStringAndSize(NULL, n)``, as a C extension reading into a
    new bytes object does). The view keeps the bytes alive (requests still writing into it after an
    interrupted wait write into live memory). Where the C API is not reachable (not CPython) the view is
    of a bytearray, copied by :func:`bytes_of` when done."""
    if n > 0 and _bytes_api is not None:
        new, address = _bytes_api
        out = new(None, n)
        arr = (ctypes.c_char * n).from_address(address(out))
        arr._owner = out  # type: ignore[attr-defined]  # the view holds the array, the array the bytes
        return out, memoryview(arr).cast("B")
    buf = bytearray(n)
    return b"", memoryview(buf)


def zero(view: memoryview) -> None:
    """Fill the writable, contiguous ``view`` with zeros."""
    if len(view):
        ctypes.memset(ctypes.addressof(ctypes.c_char.from_buffer(view)), 0, len(view))


def bytes_of(out: bytes, view: memoryview, n: int) -> bytes:
    """What :func:`fresh_bytes` made, once ``n`` bytes of ``view`` are filled: ``out`` itself when it was
    filled whole, else a copy of what was filled."""
    if out and n == len(out):
        return out
    return bytes(view[:n])


def _bytes_c_api() -> Any:
    try:
        new = ctypes.pythonapi.PyBytes_FromStringAndSize
        address = ctypes.pythonapi.PyBytes_AsString
    except AttributeError:  # not CPython
        return None
    new.restype, new.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_ssize_t]
    address.restype, address.argtypes = ctypes.c_void_p, [ctypes.py_object]
    return new, address


_bytes_api = _bytes_c_api()

_IOV_MAX = 1024  # Linux's limit on buffers per preadv


def preadv_into(fd: int, views: Sequence[memoryview], offset: int) -> int:
    """Scatter-read the consecutive byte buffers ``views`` from ``offset``, in as few ``preadv`` calls
    as the kernel allows (<= 1024 buffers and <= 1 GiB a call), until all are full or EOF; returns the
    count. One system call where a ``preadinto`` per buffer makes one each."""
    total, i, skip = 0, 0, 0  # bytes read; the first buffer not yet full, and how much of it is
    while i < len(views):
        batch: list[memoryview] = []
        room, j = 1 << 30, i
        while j < len(views) and len(batch) < _IOV_MAX and room > 0:
            part = (views[j][skip:] if j == i else views[j])[:room]
            if len(part):  # empty buffers take no slot: data behind 1024 of them is still read
                batch.append(part)
                room -= len(part)
            j += 1
        want = sum(len(b) for b in batch)
        n = os.preadv(fd, batch, offset + total) if want else 0
        if n == 0:
            break
        total += n
        left = skip + n
        while i < len(views) and left >= len(views[i]):
            left -= len(views[i])
            i += 1
        skip = left
    return total


_sfr: Any = None


def sync_file_range() -> Any:
    """``sync_file_range(fd, offset, nbytes, flags)`` from libc, or None where there is none (not Linux)."""
    global _sfr
    if _sfr is None:
        try:
            fn = ctypes.CDLL(None, use_errno=True).sync_file_range
            fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
            _sfr = fn
        except (OSError, AttributeError):  # not Linux
            _sfr = False
    return _sfr or None


_PAGE = _mmap.PAGESIZE


class WriteBehind:
    """Start writeback of a file as it is written, for a save that fsyncs it at the end, so the disk works
    while the caller copies, hashes and encodes what follows and the fsync has less left to wait for.

    In the first ``eager`` bytes (and the first half of ``size`` when the caller knows it) writeback
    starts after every ``step`` bytes written, never past that early part however large a write is;
    after it, after every ``every`` bytes. Measured on ``.fpk`` saves with fsync on 2 cores, against
    starting writeback every 32 MiB only: early requests saved 0.2-0.3 ms of a 2.8 ms 1 MiB save;
    starting them up to the end of the file saved 6 of 23 ms at 32 MiB on an idle machine, but cost
    0.6-1.1 ms at 1 MiB and 5-8 ms at 32 MiB while other processes kept every core busy (each request
    adds a completion the busy cores are slow to handle); the early part only lost nothing busy. Only
    whole pages: a page still being filled is not sent to be written twice. A no-op without
    ``sync_file_range``.
    """

    __slots__ = ("fd", "_fn", "_pos", "_synced", "_eager", "_step", "_every")

    def __init__(
        self, fd: int, size: int | None = None, eager: int = 512 << 10, step: int = 256 << 10, every: int = 32 << 20
    ) -> None:
        self.fd, self._fn, self._step, self._every = fd, sync_file_range(), step, every
        self._eager = eager if size is None else min(eager, size // 2)
        self._pos = self._synced = 0

    def wrote(self, n: int) -> None:
        """``n`` more bytes were written at the end of the file."""
        self._pos += n
        early = self._synced < self._eager
        if self._fn is None or self._pos - self._synced < (self._step if early else self._every):
            return
        end = self._pos - self._pos % _PAGE
        if early:  # not past the early part (one large write must not start all of it)
            end = min(end, -(-self._eager // _PAGE) * _PAGE)
        if end <= self._synced:  # a length of 0 would mean "to the end of the file"
            return
        self._fn(self.fd, self._synced, end - self._synced, 2)  # SYNC_FILE_RANGE_WRITE: start, do not wait
        self._synced = end


_MADV_POPULATE_WRITE = 23  # Linux >= 5.14
_MADV_DONTNEED = 4
_libc: Any = None
_mincore: Any = None
_populate_ok = sys.platform == "linux"


def address(view: memoryview) -> int:
    """Where a writable view's bytes lie in memory (0 for a read-only or empty one)."""
    if view.readonly or not len(view):
        return 0
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def prefault(mv: memoryview) -> None:
    """Fault in a freshly allocated buffer with one ``madvise(MADV_POPULATE_WRITE)`` before reading into it.

    ``pread`` into untouched memory takes one page fault per 4 KiB inside the copy; populating the
    range first does the same work in one call, measurably faster for fresh allocations. Memory that
    is already resident (a reused allocation) is left alone. A no-op where the kernel lacks it.
    """
    global _populate_ok
    if not _populate_ok or len(mv) < PREFAULT_MIN:
        return
    try:
        ptr = ctypes.addressof(ctypes.c_char.from_buffer(mv))
    except (TypeError, ValueError):  # a read-only buffer
        return
    prefault_range(ptr, len(mv))


def prefault_range(ptr: int, nbytes: int, least: int = PREFAULT_MIN) -> None:
    """:func:`prefault` for ``nbytes`` of writable memory at address ``ptr`` (a tensor's ``data_ptr()``);
    nothing for fewer than ``least`` bytes."""
    if nbytes < least or not _load_madvise():
        return
    start = (ptr + _PAGE - 1) // _PAGE * _PAGE
    end = (ptr + nbytes) // _PAGE * _PAGE
    if end <= start:
        return
    vec = ctypes.create_string_buffer(1)
    last = end - _PAGE
    if _mincore(start, _PAGE, vec) == 0 and vec.raw[0] & 1 and _mincore(last, _PAGE, vec) == 0 and vec.raw[0] & 1:
        return  # resident already
    _populate(start, end - start)


def _load_madvise() -> bool:
    global _libc, _mincore, _populate_ok
    if _populate_ok and _libc is None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            # keeps the GIL (PyDLL): a page's residency is a quick look-up, and a thread that released
            # the GIL for it would queue for it again behind another thread's Python
            mincore = ctypes.PyDLL(None).mincore
            mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
        except (OSError, AttributeError):  # no libc symbol
            _populate_ok = False
            return False
        # published whole, _libc last: a thread seeing _libc set (two loads' first reads at once) finds
        # both functions ready
        _mincore = mincore
        _libc = libc
    return _populate_ok


def _populate(start: int, n: int) -> bool:
    """Fault in the (page-aligned) range now; ctypes releases the GIL for the call. False if it failed."""
    global _populate_ok
    if _libc.madvise(start, n, _MADV_POPULATE_WRITE) == 0:
        return True
    if ctypes.get_errno() == errno.EINVAL:
        _populate_ok = False  # an older kernel
    return False


FAULT_AHEAD_STEP = 256 << 10  # bytes populated between two looks at whether to go on


def fault_in_ahead(
    buf: memoryview,
    size: Callable[[], int | None],
    sized: threading.Event,
    stop: Callable[[], bool],
    guess: int,
    late: tuple[float, Callable[[], None]] | None = None,
) -> int:
    """Fault in the pages of ``buf`` (fresh private anonymous memory, page-aligned: :func:`anonymous`)
    that a read in flight is about to write, on a thread that would otherwise only wait for it. The
    read's thread then writes into resident pages instead of taking a page fault per 4 KiB in its copy
    (while it holds the GIL, on an IO loop that also parses replies).

    Until ``size()`` tells how much the read brings (None until its reply's headers; ``sized`` is set
    then, or when the read ends), ``guess`` bytes are populated; after, up to that size. ``stop()`` is
    asked between steps of ``FAULT_AHEAD_STEP``. Whole pages populated past the size are given back
    (``MADV_DONTNEED``: they read as zeros after), so a small object keeps no more resident memory
    than its own pages. Returns how far it populated (or tried to), less what it gave back; where the
    size is not known by then, the caller gives back with :func:`give_back` once it is. Populating a
    page the read has already written leaves it as it is. ``late = (seconds, fn)``: ``fn()`` is called
    (once, on this thread) if the size is still unknown that long after the call, while it waits.
    Returns 0 at once where there is nothing to do (``late`` is then the caller's)."""
    if not len(buf) or not _load_madvise():
        return 0
    due = time.monotonic() + late[0] if late is not None else 0.0
    base = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    done = 0
    while _populate_ok and not stop():
        told = size()
        end = min(len(buf), -(-(guess if told is None else told) // _PAGE) * _PAGE)
        if done >= end:
            if told is not None:
                break
            if late is not None:  # the guess is populated: wait for the size, until it is late
                if not sized.wait(max(0.0, due - time.monotonic())):
                    late[1]()
                late = None
                continue
            sized.wait()  # the guess is populated: the rest once the size is known
            continue
        n = min(FAULT_AHEAD_STEP, end - done)
        ok = _populate(base + done, n)
        done += n  # on a failure too: some of its pages may be in, and past the size they are given back
        if not ok:
            break
    told = size()
    return give_back(buf, told, done) if told is not None else done


def fault_in_striped(targets: Sequence[Sequence[memoryview]], stop: threading.Event, step: int = 1 << 20) -> int:
    """Fault in the fresh buffers of several reads in flight, on a helper thread: ``targets`` holds each
    read's buffers in the order its bytes arrive; ``step`` bytes of each read in turn, so every read
    finds the pages it writes next resident (its IO thread copies into them without a page fault per
    4 KiB while it holds the GIL). Pages already resident are skipped; ``stop`` is checked between
    steps (set it when the reads are done). Returns the bytes it populated (or tried to)."""
    if not _populate_ok or not _load_madvise():
        return 0
    spans: list[list[tuple[int, int]]] = []  # per read: (address, length) of its buffers, in order
    for views in targets:
        spans.append([(address(v), len(v)) for v in views if len(v) and not v.readonly])
    done = 0
    at = [(0, 0)] * len(spans)  # per read: (buffer index, offset in it)
    while not stop.is_set():
        progressed = False
        for r, bufs in enumerate(spans):
            k, off = at[r]
            if k >= len(bufs):
                continue
            addr, n = bufs[k]
            take = min(step, n - off)
            prefault_range(addr + off, take, least=1)
            done += take
            at[r] = (k, off + take) if off + take < n else (k + 1, 0)
            progressed = True
            if stop.is_set() or not _populate_ok:
                return done
        if not progressed:
            break
    return done


def give_back(buf: memoryview, size: int, populated: int) -> int:
    """Give back the whole pages of ``buf[:populated]`` (private anonymous memory that
    :func:`fault_in_ahead` populated) that lie past ``size`` bytes: ``MADV_DONTNEED``, after which they
    read as zeros. Returns the bytes still populated."""
    keep = -(-size // _PAGE) * _PAGE
    if populated <= keep:
        return populated
    _libc.madvise(ctypes.addressof(ctypes.c_char.from_buffer(buf)) + keep, populated - keep, _MADV_DONTNEED)
    return keep


MEMMOVE_CHUNK = 64 << 20


def memmove(dst: int, src: int, nbytes: int, chunk: int = MEMMOVE_CHUNK) -> None:
    """Copy ``nbytes`` from address ``src`` to ``dst`` on the calling thread, ``chunk`` bytes per call.

    libc ``memmove`` through ctypes, which releases the GIL during each call: a single-threaded copy
    at memcpy speed that does not depend on torch's intra-op thread pool (which collapses when other
    processes keep the cores busy). The caller guarantees both ranges are valid for ``nbytes``.
    """
    for off in range(0, nbytes, chunk):
        ctypes.memmove(dst + off, src + off, min(chunk, nbytes - off))


COPY_UNLOCKED_MIN = 1 << 20  # below this, a plain slice assignment (holding the GIL) is cheaper


def copy_bytes(dst: memoryview, src: bytes, offset: int = 0) -> int:
    """Copy ``src[offset : offset + len(dst)]`` into the writable, contiguous ``dst``; returns the count.

    A large copy goes through :func:`memmove` (the GIL released), so threads copying out of memory
    (memory:// reads) run in parallel as file reads do; ``src`` must be ``bytes`` (its buffer is
    addressed directly and it stays referenced for the call)."""
    if offset < 0:
        raise ValueError(f"negative offset {offset}")
    dst = dst.cast("B") if dst.format != "B" or dst.ndim != 1 else dst
    n = max(0, min(len(dst), len(src) - offset))
    if n < COPY_UNLOCKED_MIN or type(src) is not bytes:
        dst[:n] = memoryview(src)[offset : offset + n]
        return n
    target = ctypes.c_char.from_buffer(dst)  # raises TypeError for a read-only dst, as the slice would
    source = ctypes.cast(ctypes.c_char_p(src), ctypes.c_void_p).value or 0
    memmove(ctypes.addressof(target), source + offset, n)
    del target
    return n

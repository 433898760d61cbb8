"""The small backend interface every storage implements, and everything derived from it.

A backend must provide six operations (ranged read, streaming write with a mode, stat, list,
delete) and may override the derived ones (``readinto``, ``write``, ``copy``...) when the storage
can do them faster. Optional capabilities have a default that declines: ``list_pending_writes``
yields nothing unless the storage can keep the debris of a killed writer (S3 multipart uploads,
local temporary files). Backends take and return full URIs (after alias resolution), so their errors
name the object. They raise only the exceptions in :mod:`ckptio.errors` (and built-ins they
subclass); client-specific errors are translated here at the boundary.
"""

from __future__ import annotations

import abc
import concurrent.futures as cf
import contextlib
import io
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO, ClassVar, Literal, Protocol

from .. import uri as _uri
from ..errors import NotFoundError, replaced
from ..osio import fault_in_ahead, give_back
from ..threads import shared_pool
from .readers import RangeReader

WriteMode = Literal["overwrite", "create"]
Buffer = bytes | bytearray | memoryview

DEFAULT_PART_SIZE = 32 * 1024 * 1024
DEFAULT_CONCURRENCY = 8
SMALL_OBJECT = 4 * 1024 * 1024  # an object store's read(): an object up to this size is read by one request


@dataclass(frozen=True)
class Held:
    """An object's bytes held in this process (:meth:`Backend.held`); a reader tells ``on_read`` how
    many of them it takes (copies or views: the backend's own count of bytes read)."""

    data: bytes
    on_read: Callable[[int], None]


@dataclass(frozen=True)
class ObjectInfo:
    """What ``stat``/``list`` return. ``version`` is an etag, a generation or ``mtime_ns:size``."""

    uri: str
    size: int
    mtime: float | None = None
    version: str | None = None
    is_dir: bool = False


@dataclass(frozen=True)
class PendingWrite:
    """A write that was started and neither committed nor aborted: the debris of a killed writer, or a
    write in progress. ``uri`` is the object it would create; ``since`` is when it was started (local
    temporary files: last written), in seconds since the epoch; ``handle`` is what
    :meth:`Backend.abort_pending_write` needs (an upload id, a temporary file)."""

    uri: str
    since: float
    handle: str


def check_mode(mode: str) -> None:
    if mode not in ("overwrite", "create"):
        raise ValueError(f"write mode must be 'overwrite' or 'create', got {mode!r}")


class Writer(abc.ABC):
    """A streaming writer. Nothing is visible under the final URI until ``close`` commits.

    Used as a context manager: leaving the block with an exception calls ``abort``, which
    discards everything written (temporary files, multipart uploads).
    """

    uri: str

    @abc.abstractmethod
    def write(self, data: Buffer) -> int: ...

    @abc.abstractmethod
    def close(self) -> None:
        """Commit: make the object visible under its URI (atomically where the storage can)."""

    @abc.abstractmethod
    def abort(self) -> None:
        """Discard what was written. Safe to call more than once and after a failed close."""

    def local_fileno(self) -> int | None:
        """Capability: the descriptor of the local file this writer fills, when it writes one directly
        (callers may then use OS fast paths on it: ``sync_file_range``, ``pwritev``); None otherwise.
        A wrapper that must see every byte (counting, for progress) returns None."""
        return None

    def mark_boundary(self) -> None:  # noqa: B027 - optional: a no-op unless the writer cuts blocks
        """Capability: the bytes written so far end a unit (a tensor payload), a good place to cut the
        stream into blocks (:mod:`ckptio.incremental`). Default: nothing."""

    def write_borrowed(self, data: Buffer) -> int:
        """``write`` for a caller that keeps ``data`` unchanged until ``close``/``abort`` returns, so
        the writer may upload from it later instead of copying it. Default: plain ``write``."""
        return self.write(data)

    def writelines(self, chunks: Iterable[Buffer]) -> None:
        for c in chunks:
            self.write(c)

    # file-like conveniences so formats can hand the writer to pickle/torch/json
    def writable(self) -> bool:
        return True

    def flush(self) -> None:  # noqa: B027 - a file-like no-op unless a writer buffers
        pass

    def __enter__(self) -> Writer:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


LEND_MIN = 64 << 10  # BufferedWriter keeps views of lent pieces of at least this size, and copies smaller ones


class BufferedWriter(Writer):
    """Collects everything in memory and commits with one call. For small objects and simple backends.

    ``write`` copies into a growing buffer; ``write_borrowed`` keeps a view of the caller's bytes (a
    tensor's payload; pieces under LEND_MIN are copied), and ``close`` copies every piece once into
    the object it commits. A growing buffer alone copied large saves several times over when the heap
    could not grow in place (a 32 MiB save peaked at 2-3x its size): it cannot know the final size.
    """

    def __init__(self, uri: str, commit: Callable[[bytes], None]) -> None:
        self.uri = uri
        self._pieces: list[io.BytesIO | memoryview] | None = []  # in order: copied runs and borrowed views
        self._commit = commit

    def write(self, data: Buffer) -> int:
        if self._pieces is None:
            raise ValueError(f"write to a closed writer: {self.uri}")
        if not self._pieces or not isinstance(self._pieces[-1], io.BytesIO):
            self._pieces.append(io.BytesIO())
        return self._pieces[-1].write(data)  # type: ignore[union-attr]  # the last piece is a BytesIO

    def write_borrowed(self, data: Buffer) -> int:
        mv = memoryview(data)
        if mv.nbytes < LEND_MIN:  # copied: cheaper than keeping a view (100,000 tiny tensors: 10% slower)
            return self.write(mv)
        if self._pieces is None:
            raise ValueError(f"write to a closed writer: {self.uri}")
        self._pieces.append(mv.cast("B"))
        return mv.nbytes

    def close(self) -> None:
        if self._pieces is None:
            return
        pieces, self._pieces = self._pieces, None
        if len(pieces) == 1 and isinstance(pieces[0], io.BytesIO):
            data = pieces[0].getvalue()  # the buffer itself, not a copy
        else:  # one copy of each piece into an object of the final size
            data = b"".join(p.getbuffer() if isinstance(p, io.BytesIO) else p for p in pieces)
        del pieces
        self._commit(data)

    def abort(self) -> None:
        self._pieces = None


class Backend(abc.ABC):
    """Base class of all storage backends. Subclass, implement the abstract methods, register.

    ``name`` is the registry name; ``prefixes`` are filled in by :func:`ckptio.register_backend`.
    Options come from settings or arguments; unknown options raise ``TypeError``.
    """

    name: str = "base"  # a class default; a wrapper or a registry entry sets its own on the instance
    prefixes: ClassVar[tuple[str, ...]] = ()
    # Capability: writes land in place (a local file), so a writer holds no part buffers a caller
    # would need to bound. Object stores buffer parts and say so with ``max_buffer_bytes``.
    # (A class default; wrappers set their wrapped backend's on the instance.)
    writes_in_place: bool = False
    # Capability: reads are served from this machine (its memory or disks) with no request latency to
    # hide, so readers use few threads, no read-ahead and no staging. (Wrappers: their wrapped backend's.)
    reads_local: bool = False
    # Capability: the bound on the bytes one writer buffers (an option of S3/GCS), None where there is none.
    max_buffer_bytes: int | None = None

    def __init__(self, *, part_size: int = DEFAULT_PART_SIZE, concurrency: int = DEFAULT_CONCURRENCY) -> None:
        if int(part_size) <= 0:
            raise ValueError(f"part_size must be > 0, got {part_size!r}")
        if int(concurrency) <= 0:
            raise ValueError(f"concurrency must be > 0, got {concurrency!r}")
        self.part_size = int(part_size)
        self.concurrency = int(concurrency)

    def __repr__(self) -> str:  # never includes options: they may hold secrets
        return f"<{type(self).__name__} backend {self.name!r}>"

    # ---- the required core -------------------------------------------------------------
    @abc.abstractmethod
    def read_range(self, uri: str, start: int = 0, end: int | None = None) -> bytes:
        """Bytes ``[start, end)`` of the object (``end=None``: to the end). Short at EOF."""

    @abc.abstractmethod
    def open_writer(self, uri: str, *, mode: WriteMode = "overwrite", durable: bool = True) -> Writer:
        """A streaming writer; ``mode="create"`` makes ``close`` fail with FileExistsError if the object exists."""

    @abc.abstractmethod
    def stat(self, uri: str) -> ObjectInfo:
        """Size, mtime and version token of an object (FileNotFoundError if missing)."""

    @abc.abstractmethod
    def list(self, uri: str, *, recursive: bool = False) -> Iterator[ObjectInfo]:
        """Entries under the directory/prefix ``uri``. One level yields ``is_dir`` entries for sub-prefixes."""

    @abc.abstractmethod
    def delete(self, uri: str) -> None:
        """Delete one object (FileNotFoundError if missing)."""

    # ---- derived; override when the storage does better ----------------------------------
    def readinto(self, uri: str, buf: Buffer, offset: int = 0) -> int:
        """Fill ``buf`` with bytes starting at ``offset``; returns the count (short at EOF)."""
        mv = memoryview(buf).cast("B")
        data = self.read_range(uri, offset, offset + len(mv))
        mv[: len(data)] = data
        return len(data)

    def readinto_each(self, uri: str, buf: Buffer, offset: int, each: Callable[[memoryview], Any]) -> int:
        """:meth:`readinto`, handing consecutive parts of what it read to ``each`` in order as they land
        (hashed while in the CPU cache where the storage reads in pieces: an incremental step's local
        blocks). Default: ``readinto``, then ``each`` once."""
        n = self.readinto(uri, buf, offset)
        if n:
            each(memoryview(buf).cast("B")[:n])
        return n

    def read_head(self, uri: str, buf: Buffer, on_size: Callable[[int], None]) -> int:
        """Fill ``buf`` from byte 0 (``readinto``) and call ``on_size(size)`` once with the object's size,
        as early as the storage can tell it. Object stores take it from the GET's headers (one request
        where a size lookup and a read were two); this default looks it up first. Only the object's bytes
        are written: the caller may fault in and give back (zero) the pages of ``buf`` past them while
        the read runs."""
        on_size(self.stat(uri).size)
        return self.readinto(uri, buf, 0)

    def start_read_head(self, uri: str, buf: Buffer, on_size: Callable[[int], None]) -> cf.Future[int]:
        """:meth:`read_head` started in the background: a future of its count, done once ``buf`` is filled
        (``on_size`` is called before that, maybe on another thread). Once started it is not cancelled:
        a reader that closes waits for it. This default runs ``read_head`` on the shared I/O pool; object
        stores start the request on their IO loop."""
        return shared_pool().submit(self.read_head, uri, buf, on_size)

    def start_read_tail(self, uri: str, buf: Buffer, align: int = 1) -> cf.Future[int] | None:
        """The object's last ``n = min(len(buf) - align + 1, size)`` bytes into ``buf[p : p + n]``,
        ``p = (size - n) % align`` (each byte then lies at an offset in ``buf`` congruent to its offset in
        the object, modulo ``align``), in one request that needs no size (an object store's suffix
        range), started in the background: a future of ``n``, done once they are in; once started it is
        not cancelled, and it keeps ``buf`` alive while it writes. None (this default) where the storage
        has no such request: the caller reads the end once it knows the size.
        """
        return None

    def readv(self, uri: str, views: Sequence[memoryview], offset: int = 0) -> int:
        """Fill the consecutive buffers ``views`` from the bytes at ``offset`` (a scatter read); returns
        the count (short at EOF). Object stores stream one request through several buffers; the default
        reads each buffer in place where reads are local, else stages them in one ``readinto``."""
        total = 0
        if self.reads_local:
            for v in views:
                n = self.readinto(uri, v, offset + total)
                total += n
                if n < len(v):
                    break
            return total
        buf = bytearray(sum(len(v) for v in views))
        n = self.readinto(uri, buf, offset)
        for v in views:
            k = max(0, min(len(v), n - total))
            v[:k] = memoryview(buf)[total : total + k]
            total += k
        return total

    def write(self, uri: str, data: Buffer, *, mode: WriteMode = "overwrite", durable: bool = True) -> None:
        """Write a whole object in one call."""
        with self.open_writer(uri, mode=mode, durable=durable) as w:
            w.write(data)

    def open_reader(self, uri: str, *, size: int | None = None) -> BinaryIO:
        """A seekable binary file over the object, buffered with ``part_size``-free small-read buffering."""
        if size is None:
            size = self.stat(uri).size
        return io.BufferedReader(RangeReader(self, uri, size), buffer_size=1024 * 1024)

    def copy(self, src: str, dst: str, *, mode: WriteMode = "overwrite") -> None:
        """Copy within this backend. Default streams through this process in ``part_size`` pieces."""
        with self.open_writer(dst, mode=mode) as w:
            copy_to_file(self, src, w)  # type: ignore[arg-type]

    def exists(self, uri: str) -> bool:
        return self.isfile(uri) or self.isdir(uri)

    def isfile(self, uri: str) -> bool:
        try:
            return not self.stat(uri).is_dir
        except FileNotFoundError:
            return False

    def isdir(self, uri: str) -> bool:
        try:
            next(iter(self.list(uri, recursive=False)))
            return True
        except (StopIteration, FileNotFoundError, NotADirectoryError):
            return False

    def read(self, uri: str) -> bytes:
        """The whole object. Uses ``readinto`` so large objects are fetched in parallel where supported."""
        size = self.stat(uri).size
        buf = bytearray(size)
        n = self.readinto(uri, buf, 0)
        return bytes(buf) if n == size else bytes(buf[:n])

    def rmtree(self, uri: str) -> None:
        """Delete everything under ``uri`` (missing: no error)."""
        try:
            infos = list(self.list(uri, recursive=True))
        except FileNotFoundError:
            return
        for info in infos:
            if not info.is_dir:
                with contextlib.suppress(FileNotFoundError):
                    self.delete(info.uri)

    def list_pending_writes(self, uri: str) -> Iterator[PendingWrite]:
        """Writes of objects under the prefix ``uri`` (recursive) that were started and never committed
        or aborted. Default: none, for storages where an unfinished write leaves nothing behind (memory,
        fsspec's spooled writes) or where it expires on its own (GCS resumable upload sessions, after a
        week). A write in progress in another process is listed too: callers decide by ``since``."""
        return iter(())

    def abort_pending_write(self, write: PendingWrite) -> None:  # noqa: B027 - optional: nothing to abort by default
        """Discard what a pending write left (one listed by :meth:`list_pending_writes`); already
        gone: no error."""

    @contextlib.contextmanager
    def local_file(self, uri: str) -> Iterator[str | None]:
        """Capability: for the block, the path of a local file that holds exactly the object's bytes
        without copying them (readers may ``pread``/``mmap`` it), or None when the storage has no such
        file (remote, memory). Local files yield their path, the node-local cache its verified entry.
        A missing object raises NotFoundError where the storage would have yielded a path."""
        yield None

    def held(self, uri: str) -> Held | None:
        """Capability: the object's bytes where this backend holds them in this process (memory://):
        immutable (a write replaces an object, never changes it), so one version, read without I/O;
        None for any other storage. A wrapper that must see every byte (counting, for progress)
        returns None, and so does a subclass that changes how reads are served (its ``readinto``).
        A missing object raises NotFoundError where the backend would have held it."""
        return None

    def file_path(self, uri: str) -> str | None:
        """Capability: the path of the plain local file holding ``uri``'s bytes, found without touching
        the disk (it may not exist), for a reader opening many objects; None where objects are not plain
        files at paths fixed by their URIs (remote, memory, the node-local cache)."""
        return None

    def pin_version(self, uri: str, version: str | None = None) -> Backend:
        """Capability: this backend for reading ``uri`` in several calls as one object: every read (and
        ``stat``) of ``uri`` through the result comes from one version of it, ``version`` (an
        :attr:`ObjectInfo.version` the caller holds) or the first one seen, or raises IntegrityError
        (the object was replaced meanwhile). Object stores pin an ETag or a generation.
        Default: self (a storage whose reads cannot straddle versions, or that cannot tell them apart)."""
        return self

    def assembled(self, uri: str) -> bool:
        """Capability: True when ``uri``'s bytes are assembled from separately stored blocks (an
        incremental step's recipe). Each block is checked against its own name, which proves its bytes
        are *some* stored block's, not this object's: a format checks its own checksums over them, even
        those it skips for a plain file (torch's zip CRC32). Default False."""
        return False

    def for_checked_reads(self, uri: str) -> Backend:
        """Capability: a backend for a reader that checks every byte it reads of ``uri`` against its own
        checksums (fpk payload xxh3) and, on a mismatch, reads them again through ``self`` to name a
        damaged part: an assembled object's per-block hashes are skipped, so each byte is hashed once
        (block lengths are still checked). Default: self."""
        return self

    def with_options(self, **options: Any) -> Backend:
        """Capability: this storage with some options changed (``concurrency``, ``part_size``,
        ``max_buffer_bytes``...), for a caller that tunes one save. Default: self when nothing
        changes, else a ValueError naming what this backend cannot change."""
        changed = {k: v for k, v in options.items() if getattr(self, k, object()) != v}
        if changed:
            raise ValueError(f"{self!r} cannot derive a backend with options {sorted(changed)}")
        return self

    @property
    def node_cache(self) -> NodeCache | None:
        """Capability: the node-local cache this backend reads through (:mod:`ckptio.cache`), or None.
        :mod:`ckptio.distributed` fills it on one rank per node and pins what it validated."""
        return None

    @contextlib.contextmanager
    def get_local_path(self, uri: str) -> Iterator[str]:
        """A local file holding the object's bytes for the duration of the block (a temporary copy)."""
        tmpdir = tempfile.mkdtemp(prefix="ckptio-")
        path = os.path.join(tmpdir, _uri.basename(uri) or "object")
        try:
            with open(path, "wb") as f:
                copy_to_file(self, uri, f)
            yield path
        finally:
            shutil.rmtree(tmpdir, ignore_errors=True)

    def close(self) -> None:  # noqa: B027 - optional: nothing to release by default
        """Release clients and pools. The backend may be used again afterwards (it reconnects)."""


class NodeCache(Protocol):
    """What :attr:`Backend.node_cache` returns: fill entries ahead of use and hold them."""

    def fill(self, uri: str, info: ObjectInfo | None = None) -> ObjectInfo: ...

    def fill_many(self, uris: Iterable[str], *, threads: int | None = None) -> dict[str, ObjectInfo]: ...

    def pinned(
        self, infos: Mapping[str, ObjectInfo] | Iterable[ObjectInfo]
    ) -> contextlib.AbstractContextManager[None]: ...

    def stats(self) -> dict[str, int]: ...


def copy_to_file(backend: Backend, uri: str, f: BinaryIO, *, start: int = 0, size: int | None = None) -> int:
    """Stream an object (from byte ``start``; ``size``: the object's, when known) into an open binary
    file in ``part_size`` pieces, all from one version of it (``pin_version``; a backend that cannot pin
    has the version it told the size of looked up again after the last read); returns bytes copied."""
    reads, version = backend.pin_version(uri), None
    if size is None:  # the size and the bytes of one version
        info = reads.stat(uri)
        size, version = info.size, info.version
    chunk = bytearray(min(max(size - start, 1), backend.part_size * backend.concurrency))
    mv, pos = memoryview(chunk), start
    while pos < size:
        n = reads.readinto(uri, mv[: min(len(mv), size - pos)], pos)
        if n <= 0:
            raise NotFoundError(uri, f"object shrank while reading at byte {pos} of {size}")
        f.write(mv[:n])
        pos += n
    if reads is backend and version is not None and (now := backend.stat(uri).version) != version:
        raise replaced(uri, version, now)
    return pos - start


def start_sized(
    backend: Backend,
    uri: str,
    buf: Buffer,
    started: Callable[[cf.Future[int]], None] | None = None,
    start: Callable[[Callable[[int], None]], cf.Future[int]] | None = None,
    fault_in: int | None = None,
    late: tuple[float, Callable[[], None]] | None = None,
    told: Callable[[], None] | None = None,
) -> tuple[cf.Future[int], int]:
    """``backend.start_read_head`` into ``buf``: the read's future and the object's size. For an object
    larger than ``buf`` this waits only for the size (a GET's headers, not its body), so the caller can
    start the rest while the body comes; for one that fits, for the read itself. Raises the read's error
    if it fails first; a ``read_head`` that never tells the size (a user backend's) gets a ``stat``.
    ``started(future)`` is called before the wait (a reader that must wait for the read when it closes,
    whatever happens). ``start(on_size)``: starts the read instead of ``backend.start_read_head``.
    ``fault_in``: ``buf`` is fresh anonymous memory (``osio.anonymous``), and the calling thread, instead
    of only waiting, faults in the pages the read will fill: ``fault_in`` bytes until the size is told,
    then up to the size (``osio.fault_in_ahead``); pages past the size are given back, also where the
    size comes from a ``stat`` after the read. ``late = (seconds, fn)``: ``fn()`` is called on this thread,
    before this returns, if the reply has not told the size that long after the read started (a remote
    store's round trip: the caller starts what it would otherwise start once it knows the size). ``told()``:
    called (on the read's thread) when the reply tells the size."""
    told_size: list[int] = []
    ready, sized = threading.Event(), threading.Event()
    room = memoryview(buf).nbytes

    def on_size(n: int) -> None:
        if told is not None and not told_size:
            told()
        told_size.append(n)
        sized.set()
        if n > room:  # more to fetch than ``buf`` holds: the caller starts it while this body comes
            ready.set()
        # else the read is about to end; waking the caller now would only have it wait again for the
        # body (on 2 cores a thread's wake-up costs a few tenths of a millisecond): the read's end wakes it

    fut = start(on_size) if start is not None else backend.start_read_head(uri, buf, on_size)

    def done(_: cf.Future[int]) -> None:
        ready.set()
        sized.set()  # a read that ends without telling the size: a fault-in waiting for it stops

    fut.add_done_callback(done)
    due = time.monotonic() + late[0] if late is not None else 0.0
    if started is not None:
        started(fut)
    fired: list[bool] = []

    def fire() -> None:
        fired.append(True)
        if late is not None:
            late[1]()

    populated = 0
    if fault_in is not None:
        soon = (max(0.0, due - time.monotonic()), fire) if late is not None else None
        populated = fault_in_ahead(
            memoryview(buf), lambda: told_size[0] if told_size else None, sized, ready.is_set, fault_in, late=soon
        )
    if late is not None and not fired and not sized.is_set() and not sized.wait(max(0.0, due - time.monotonic())):
        fire()
    ready.wait()
    if told_size:
        return fut, told_size[0]
    err = fut.exception()  # the read failed, or it is done without telling the size (a user backend's)
    if err is not None:
        fut = None  # type: ignore[assignment]  # the error's traceback holds this frame: no reference cycle
        try:
            raise err
        finally:
            del err
    size = backend.stat(uri).size
    if populated:
        give_back(memoryview(buf), size, populated)
    return fut, size

"""The node-local cache's store: its directory layout, locking, fills, pins and eviction (see :mod:`.eviction`).

:class:`CacheStore` owns ``cache_dir``; :class:`~ckptio.cache.backend.CachedBackend` wraps a backend
and serves its reads from the store (writes, listings and deletes pass through). Layout::

    <cache_dir>/data/<kk>/<key>-<basename>   the object's bytes (a complete file, or absent)
    <cache_dir>/data/<kk>/<key>.json         uri, version, size, block size, xxh3-64 of each block, fill id
    <cache_dir>/locks/<key>.lock             fcntl.flock: exclusive to fill or evict, shared to use
    <cache_dir>/tmp/<key>.<pid>.<rand>       a fill in progress (and ``.json``: its metadata)

``key`` is 40 hex digits hashing the URI with the remote version token (etag / generation /
``mtime_ns:size``) and the size, so a changed remote object gets a new entry and is never served
stale; every read ``stat``s the remote object unless it is *pinned* (:meth:`CacheStore.pinned`,
used by :mod:`ckptio.distributed` once one rank has validated it). Only names of these shapes are
the cache's: scans, eviction and :meth:`CacheStore.clear` ignore anything else.

Integrity: a fill records the xxh3-64 of each block of the entry (1 MiB blocks, doubled until an
entry has at most 16384), and every read verifies the bytes it serves: ``read`` / ``read_range`` /
``readinto`` hash the blocks they touch, ``open_reader`` and ``get_local_path`` / ``local_file`` hash
the whole entry before handing it out. An entry that fails, whose size or metadata is wrong, or whose
metadata has no block checksums (the old layout) is discarded and fetched again. (:meth:`fill` and
:meth:`pinned` only ensure the entry exists; whoever reads it verifies it.)

Concurrency (any number of processes and threads on one node):

- a fill holds the entry's lock exclusively, downloads into ``tmp/`` and renames into ``data/``,
  so a reader sees a complete entry or none, and concurrent fills of one object download once;
- a process killed mid-fill releases its lock with its death; the next filler of that object, or
  eviction, deletes its temporary file;
- a reader that finds an entry damaged takes the exclusive lock and discards it only if it is
  still the same fill (the fill id), so concurrent readers refetch once;
- eviction is least-recently-used (file mtime, touched on each use) down to ``max_bytes`` (data,
  metadata and dead fills' temporary files all count), and only takes entries whose lock it can
  get exclusively without waiting: an entry held by :meth:`get_local_path` is never evicted, and
  file objects from :meth:`open_reader` keep working after an eviction (the open file outlives the
  name).

A cache directory that cannot be created or written raises :class:`~ckptio.errors.AccessDeniedError`
(a ``PermissionError``) naming it, never ``FileNotFoundError``: point ``cache_dir`` elsewhere, or
pass ``cache=False``. Entries are not fsynced unless ``fsync=True``: a killed process cannot tear a
renamed file, and whatever a machine crash leaves fails verification and is fetched again.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, BinaryIO

from .. import uri as _uri
from ..backends.base import Backend, ObjectInfo
from ..errors import AccessDeniedError, CkptioError, IntegrityError, IsDirectoryError
from ..threads import Pool
from .entries import BlockHasher, Damaged, Entry, block_size
from .entries import usage as cache_usage  # also the CLI's `cache stats`: reads only
from .eviction import shrink
from .locks import FileLock
from .settings import DEFAULT_LOCK_TIMEOUT, ENV_CACHE_DIR, default_cache_dir

_UNWRITABLE = (errno.EACCES, errno.EPERM, errno.EROFS)


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    bytes_fetched: int = 0  # bytes downloaded from the wrapped backend
    evictions: int = 0
    discarded: int = 0  # invalid entries (damaged bytes, wrong size, bad or old-layout metadata) removed
    read_through: int = 0  # reads of a damaged entry that others held, served from the wrapped backend

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


def _safe_name(uri: str) -> str:
    base = _uri.basename(uri.rstrip("/")) or "object"
    return re.sub(r"[^A-Za-z0-9._-]", "_", base)[-80:]


class Pins:
    """The remote infos callers validated and hold (``CacheStore.pinned``), counted per URI."""

    def __init__(self) -> None:
        self._mu = threading.Lock()
        self._held: dict[str, tuple[ObjectInfo, int]] = {}

    def get(self, uri: str) -> ObjectInfo | None:
        with self._mu:
            held = self._held.get(uri)
        return None if held is None else held[0]

    def drop(self, uri: str, *, prefix: bool = False) -> None:
        with self._mu:
            for u in [u for u in self._held if u.startswith(uri)] if prefix else [uri]:
                self._held.pop(u, None)

    @contextlib.contextmanager
    def holding(self, infos: list[ObjectInfo]) -> Iterator[None]:
        with self._mu:
            for info in infos:
                old = self._held.get(info.uri)
                self._held[info.uri] = (info, (old[1] if old else 0) + 1)
        try:
            yield
        finally:
            with self._mu:
                for info in infos:
                    pin = self._held.get(info.uri)
                    if pin is not None:
                        if pin[1] <= 1:
                            del self._held[info.uri]
                        else:
                            self._held[info.uri] = (pin[0], pin[1] - 1)


class InUse(Exception):
    """The entry is damaged and other holders keep it from being replaced: read the wrapped backend."""


class CacheStore:
    """The cache directory of one process: fills, verified entries, pins, counters and eviction.

    Every method that may fetch takes ``inner``, the backend the objects come from, so wrappers of
    several backends (or of one backend with different options) can share one store. ``max_bytes=None``
    never evicts; ``fsync=True`` makes fills durable; ``lock_timeout`` bounds the wait for another
    process's fill. Every read is verified; ``verify`` is accepted for compatibility and changes nothing.
    """

    def __init__(
        self,
        cache_dir: str | os.PathLike | None = None,
        *,
        max_bytes: int | None = None,
        verify: bool = False,
        fsync: bool = False,
        lock_timeout: float | None = DEFAULT_LOCK_TIMEOUT,
    ) -> None:
        if max_bytes is not None and int(max_bytes) < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes!r}")
        self.cache_dir = os.path.abspath(os.path.expanduser(os.fspath(cache_dir or default_cache_dir())))
        self.max_bytes = None if max_bytes is None else int(max_bytes)
        self.verify, self.fsync, self.lock_timeout = bool(verify), bool(fsync), lock_timeout
        self._data = os.path.join(self.cache_dir, "data")
        self._locks = os.path.join(self.cache_dir, "locks")
        self._tmp = os.path.join(self.cache_dir, "tmp")
        self._make_dirs()
        self._stats = CacheStats()
        self._mu = threading.Lock()
        self._pins = Pins()
        self._metas: dict[str, tuple[tuple, Entry]] = {}  # parsed metadata, see Entry.load

    def __repr__(self) -> str:
        return f"<CacheStore {self.cache_dir!r}>"

    # ---- the directory -----------------------------------------------------------------------
    def _unusable(self, e: OSError, what: str = "not writable") -> AccessDeniedError:
        return AccessDeniedError(
            self.cache_dir,
            f"cache directory {what} ({e.strerror or e}; set cache_dir or "
            f"${ENV_CACHE_DIR} to a writable directory, or pass cache=False)",
        )

    def _make_dirs(self) -> None:
        try:
            for d in (self._data, self._locks, self._tmp):
                os.makedirs(d, exist_ok=True)
        except OSError as e:  # a parent that is a file, no permission, a read-only file system
            raise self._unusable(e, "not writable" if e.errno in _UNWRITABLE else "cannot be created") from e
        for d in (self._data, self._locks, self._tmp):
            if not os.access(d, os.W_OK | os.X_OK):
                raise self._unusable(OSError(errno.EACCES, f"cannot write in {d}"))

    @contextlib.contextmanager
    def _writing(self) -> Iterator[None]:
        """Around the cache's own file operations: a directory we cannot write is the caller's setup
        problem, not a missing object, and a directory removed under us is made again."""
        try:
            yield
        except OSError as e:
            if isinstance(e, CkptioError) or e.errno not in _UNWRITABLE:
                raise
            raise self._unusable(e) from e

    def _lock(self, path: str, exclusive: bool, uri: str) -> FileLock:
        with self._writing():
            try:
                return FileLock(path, exclusive, self.lock_timeout, uri)
            except FileNotFoundError:  # someone removed the cache directory
                self._make_dirs()
                return FileLock(path, exclusive, self.lock_timeout, uri)

    # ---- counters and pins -------------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        """Hits, misses, bytes fetched from the wrapped backend, evictions and discarded entries."""
        with self._mu:
            return self._stats.as_dict()

    def _count(self, **deltas: int) -> None:
        with self._mu:
            for k, v in deltas.items():
                setattr(self._stats, k, getattr(self._stats, k) + v)

    @contextlib.contextmanager
    def pinned(self, inner: Backend, infos: Mapping[str, ObjectInfo] | Iterable[ObjectInfo]) -> Iterator[None]:
        """Within the block, treat ``infos`` as the current remote state and hold their entries.

        Reads of these URIs do not ``stat`` the remote object, and their entries are not evicted
        (missing ones are filled first). For callers that validated the versions moments ago.
        """
        items = list(infos.values()) if isinstance(infos, Mapping) else list(infos)
        with contextlib.ExitStack() as held:
            for info in items:
                held.enter_context(self.entry(inner, info.uri, info, count=False))
            with self._pins.holding(items):
                yield

    def pinned_info(self, uri: str) -> ObjectInfo | None:
        """The info a pin holds for ``uri`` (what reads take as the remote state), or None."""
        return self._pins.get(uri)

    def unpin(self, uri: str, *, prefix: bool = False) -> None:
        """Forget the pins of ``uri`` (``prefix``: of every URI under it): it is being changed."""
        self._pins.drop(uri, prefix=prefix)

    # ---- entries -----------------------------------------------------------------------------
    def _key(self, info: ObjectInfo) -> str:
        token = info.version if info.version is not None else f"{info.mtime}:{info.size}"
        return hashlib.sha256(f"{info.uri}\n{token}\n{info.size}".encode()).hexdigest()[:40]

    def _paths(self, info: ObjectInfo) -> tuple[str, str, str]:
        key = self._key(info)
        d = os.path.join(self._data, key[:2])
        return (
            os.path.join(d, f"{key}-{_safe_name(info.uri)}"),
            os.path.join(d, f"{key}.json"),
            os.path.join(self._locks, f"{key}.lock"),
        )

    def entry_path(self, info: ObjectInfo) -> str:
        """Where the entry for this exact object version lives (it may not exist)."""
        return self._paths(info)[0]

    def remote_info(self, inner: Backend, uri: str) -> ObjectInfo:
        """The pinned info of ``uri``, else what ``inner`` says now (a directory is refused)."""
        held = self.pinned_info(uri)
        if held is not None:
            return held
        info = inner.stat(uri)
        if info.is_dir:
            raise IsDirectoryError(errno.EISDIR, f"is a directory: {uri}", uri)
        return info

    def _discard(self, data: str, meta: str) -> None:
        for p in (data, meta):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(p)

    @staticmethod
    def _serve(entry: Entry, serve: Callable[[Entry], Any] | None) -> tuple[Any, str | None]:
        """``(serve(entry), None)``, or ``(None, the entry's fill id)`` if it is damaged."""
        try:
            return (serve(entry) if serve is not None else None), None
        except Damaged:
            return None, entry.fill_id

    @contextlib.contextmanager
    def entry(
        self,
        inner: Backend,
        uri: str,
        info: ObjectInfo | None = None,
        *,
        count: bool = True,
        serve: Callable[[Entry], Any] | None = None,
    ) -> Iterator[tuple[Entry, Any]]:
        """Hold a shared lock on the entry for ``uri`` (filling it if needed); yield it and what
        ``serve(entry)`` returned. ``serve`` reads and verifies; if it finds the entry damaged, the
        entry is discarded and fetched again, or, if others hold it (a pin, an open local path), this
        raises :class:`InUse` and the caller reads the wrapped backend."""
        info = info or self.remote_info(inner, uri)
        data, meta, lockp = self._paths(info)
        damaged: str | None = None  # the fill id of an entry found damaged
        held = False  # ... and held by others when we tried to replace it
        for _ in range(8):
            with self._lock(lockp, False, uri):
                entry = Entry.load(data, meta, info.uri, info.size, self._metas)
                if isinstance(entry, Entry):
                    if entry.fill_id != damaged:
                        out, damaged = self._serve(entry, serve)
                        if damaged is None:
                            with contextlib.suppress(OSError):
                                os.utime(data)  # least recently used goes first
                            self._count(hits=int(count))
                            yield entry, out
                            return
                    elif held:
                        raise InUse(f"the cache entry {data} is damaged and in use by another reader")
            # a damaged entry is replaced now or left alone: its holders (pins, local paths) may hold it for long
            lock = self._lock(lockp, True, uri) if damaged is None else FileLock.try_exclusive(lockp)
            if lock is None:
                held = True
                continue  # back under the shared lock: a new fill is served, the same entry read through
            with lock:
                downloaded = self._fill_locked(inner, info, data, meta, damaged)
                lock.share()  # not atomic: an evictor may slip in, so check the entry survived
                entry = Entry.load(data, meta, info.uri, info.size, self._metas)
                if not (isinstance(entry, Entry) and lock.still_at(lockp)):
                    continue
                out, damaged = self._serve(entry, serve)
                if damaged is not None:
                    if downloaded:
                        raise IntegrityError(
                            f"{uri}: the cache entry {data} does not read back as it was written "
                            f"moments ago; the file system under {self.cache_dir} is corrupting "
                            f"data: check it, or pass cache=False"
                        )
                    continue
                self._count(**({"misses": 1} if downloaded else {"hits": int(count)}))
                if downloaded:
                    self._evict()  # this entry is share-locked by us, so it stays
                yield entry, out
                return
        raise TimeoutError(
            errno.ETIMEDOUT,
            f"could not hold a cache entry for {uri}: it was evicted or damaged "
            f"repeatedly (max_bytes={self.max_bytes} too small for the objects in use?)",
        )

    def _fill_locked(self, inner: Backend, info: ObjectInfo, data: str, meta: str, damaged: str | None = None) -> bool:
        """Holding the exclusive lock: make the entry valid. True if it was downloaded now.
        ``damaged``: the fill id of an entry a reader found damaged (discarded if still there)."""
        state = Entry.load(data, meta, info.uri, info.size, self._metas)
        if isinstance(state, Entry) and state.fill_id != damaged:
            return False
        if state is not None:
            self._discard(data, meta)
            self._count(discarded=1)
        key = self._key(info)
        with self._writing():
            self._make_dirs()
            for name in os.listdir(self._tmp):  # left by a filler that died holding this lock
                if name.startswith(key + "."):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(os.path.join(self._tmp, name))
            tmp = os.path.join(self._tmp, f"{key}.{os.getpid()}.{uuid.uuid4().hex[:8]}")
            f = open(tmp, "xb", buffering=0)
        try:
            with f:
                digests = download(inner, info, f, self.fsync)
            os.makedirs(os.path.dirname(data), exist_ok=True)
            record = {
                "uri": info.uri,
                "version": info.version,
                "size": info.size,
                "block_size": digests.block,
                "blocks": digests.hexdigests(),
                "fill_id": uuid.uuid4().hex,
                "fsynced": self.fsync,
                "created": time.time(),
            }
            with open(tmp + ".json", "w") as m:
                json.dump(record, m)
            os.replace(tmp + ".json", meta)
            os.replace(tmp, data)
        except BaseException:
            for p in (tmp, tmp + ".json"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(p)
            raise
        self._count(bytes_fetched=info.size)
        return True

    # ---- eviction ----------------------------------------------------------------------------
    def _evict(self) -> None:
        if self.max_bytes is not None:
            shrink(self.cache_dir, self.max_bytes, evicted=lambda: self._count(evictions=1))

    def cached_bytes(self) -> int:
        """Bytes the cache holds on disk (entries, their metadata, fills in progress or killed)."""
        return cache_usage(self.cache_dir)["bytes"]

    def usage(self) -> dict[str, int]:
        """``entries``, ``bytes`` and ``partial_bytes`` on disk (see :func:`.entries.usage`)."""
        return cache_usage(self.cache_dir)

    def clear(self) -> None:
        """Remove every entry and leftover not in use."""
        shrink(self.cache_dir, 0, everything=True, evicted=lambda: self._count(evictions=1))

    # ---- filling ahead of use ------------------------------------------------------------------
    def fill(self, inner: Backend, uri: str, info: ObjectInfo | None = None) -> ObjectInfo:
        """Make sure the current version of ``uri`` is cached; returns the remote info it was keyed by."""
        info = info or self.remote_info(inner, uri)
        with self.entry(inner, uri, info):
            return info

    def fill_many(self, inner: Backend, uris: Iterable[str], *, threads: int | None = None) -> dict[str, ObjectInfo]:
        """:meth:`fill` for many objects in parallel (``threads`` defaults to the inner concurrency)."""
        uris = list(uris)
        with Pool(max(1, min(threads or inner.concurrency, len(uris) or 1))) as pool:
            return dict(zip(uris, pool.map(lambda u: self.fill(inner, u), uris), strict=True))


def download(inner: Backend, info: ObjectInfo, f: BinaryIO, fsync: bool) -> BlockHasher:
    """Copy the object into ``f``, reading the next chunk while writing this one; its block checksums."""
    h = BlockHasher(block_size(info.size))
    chunk = max(1, min(info.size, inner.part_size * inner.concurrency))
    bufs = [bytearray(chunk), bytearray(chunk)] if info.size > chunk else [bytearray(chunk)]

    reads = inner.pin_version(info.uri, info.version)  # the bytes of the version the entry is keyed by

    def fetch(i: int, pos: int) -> tuple[memoryview, int]:
        mv = memoryview(bufs[i % len(bufs)])[: min(chunk, info.size - pos)]
        n = reads.readinto(info.uri, mv, pos)
        if n != len(mv):
            raise IntegrityError(
                f"{info.uri}: object shrank while caching (got {pos + n} of {info.size} "
                f"bytes); it changed during the read, load again"
            )
        return mv, n

    with Pool(1, thread_name_prefix="ckptio-cache") as pool:
        pos, i = 0, 0
        nxt = pool.submit(fetch, i, pos) if info.size else None
        while nxt is not None:
            mv, n = nxt.result()
            nxt = pool.submit(fetch, i + 1, pos + n) if pos + n < info.size else None
            h.update(mv)
            done = 0
            while done < n:  # one write(2) moves at most ~2 GiB and may be short on a full disk
                done += f.write(mv[done:])
            pos, i = pos + n, i + 1
        if pos != info.size:
            raise IntegrityError(f"{info.uri}: cached {pos} of {info.size} bytes; load again")
        if fsync:
            os.fsync(f.fileno())
    return h

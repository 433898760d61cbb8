"""A node-local, whole-object read cache that wraps any backend.

``CachedBackend(inner, cache_dir, max_bytes)`` serves reads from files under ``cache_dir`` and
passes writes, listings and deletes through to ``inner``. Layout::

    <cache_dir>/data/<kk>/<key>-<basename>   the object's bytes (a complete file, or absent)
    <cache_dir>/data/<kk>/<key>.json         uri, version, size, xxh3-64, boot id, fsynced
    <cache_dir>/locks/<key>.lock             fcntl.flock: exclusive to fill or evict, shared to use
    <cache_dir>/tmp/<key>.<pid>.<rand>       a fill in progress

``key`` hashes the URI with the remote version token (etag / generation / ``mtime_ns:size``) and
the size, so a changed remote object gets a new entry and is never served stale; every read
``stat``s the remote object unless it is *pinned* (:meth:`CachedBackend.pinned`, used by
:mod:`ckptio.distributed` once one rank has validated it).

Concurrency (any number of processes and threads on one node):

- a fill holds the entry's lock exclusively, downloads into ``tmp/`` and renames into ``data/``,
  so a reader sees a complete entry or none, and concurrent fills of one object download once;
- a process killed mid-fill releases its lock with its death; the next filler deletes its
  temporary file and starts over;
- an entry whose size does not match, whose metadata is missing or different, or (with
  ``verify=True``, or when written without fsync before the last reboot) whose checksum fails is
  discarded and fetched again;
- eviction is least-recently-used (file mtime, touched on each use) down to ``max_bytes``, and
  only takes entries whose lock it can get exclusively without waiting: an entry held by
  :meth:`get_local_path` is never evicted, and file objects from :meth:`open_reader` keep working
  after an eviction (the open file outlives the name).

Entries are not fsynced unless ``fsync=True``: a killed process cannot tear a renamed file, and
entries written before a machine crash are checksummed before their first use after the reboot.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import re
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, BinaryIO, Iterable, Iterator, Mapping

import xxhash

from .. import uri as _uri
from ..errors import IntegrityError, NotFoundError, SettingsError
from .base import Backend, Buffer, ObjectInfo, PendingWrite, WriteMode, Writer

ENV_CACHE_DIR = "CKPTIO_CACHE_DIR"
DEFAULT_LOCK_TIMEOUT = 1800.0
_HASH_CHUNK = 16 << 20


def default_cache_dir() -> str:
    """``$CKPTIO_CACHE_DIR``, else ``$XDG_CACHE_HOME/ckptio``, else ``~/.cache/ckptio``."""
    env = os.environ.get(ENV_CACHE_DIR)
    if env:
        return os.path.expanduser(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "ckptio")


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:  # not Linux: treat every entry as written in this boot
        return "unknown"


_BOOT_ID = _boot_id()


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    bytes_fetched: int = 0  # bytes downloaded from the wrapped backend
    evictions: int = 0
    discarded: int = 0  # invalid entries (truncated, stale metadata, bad checksum) removed

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


class _Lock:
    """An flock on ``path`` that is safe against the file being unlinked by an evictor.

    After locking, the descriptor's inode must still be the one at ``path``; if an evictor removed
    (and maybe someone recreated) the file in between, lock again.
    """

    def __init__(self, path: str, exclusive: bool, timeout: float | None, what: str) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        op = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
        delay = 0.002
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                while True:
                    try:
                        fcntl.flock(fd, op | fcntl.LOCK_NB)
                        break
                    except BlockingIOError:
                        if deadline is not None and time.monotonic() > deadline:
                            raise TimeoutError(errno.ETIMEDOUT, f"timed out after {timeout:.0f}s waiting for the "
                                               f"cache lock of {what} (another process is filling it: {path})")
                        time.sleep(delay)
                        delay = min(delay * 2, 0.05)
            except BaseException:
                os.close(fd)
                raise
            self.fd: int | None = fd
            if self.still_at(path):
                return
            self.release()

    @classmethod
    def try_exclusive(cls, path: str) -> "_Lock | None":
        """The exclusive lock if it is free right now, else None (for eviction)."""
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        lock = cls.__new__(cls)
        lock.fd = fd
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.release()
            return None
        if not lock.still_at(path):
            lock.release()
            return None
        return lock

    def still_at(self, path: str) -> bool:
        """Whether ``path`` is still the file this lock is on (an evictor unlinks lock files)."""
        try:
            return self.fd is not None and os.stat(path).st_ino == os.fstat(self.fd).st_ino
        except FileNotFoundError:
            return False

    def share(self) -> None:
        """Downgrade exclusive to shared (not atomic in flock: callers re-validate after)."""
        assert self.fd is not None
        fcntl.flock(self.fd, fcntl.LOCK_SH)

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the only descriptor releases the flock
            self.fd = None

    def __enter__(self) -> "_Lock":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


def _safe_name(uri: str) -> str:
    base = _uri.basename(uri.rstrip("/")) or "object"
    return re.sub(r"[^A-Za-z0-9._-]", "_", base)[-80:]


class CachedBackend(Backend):
    """Serve whole-object reads of ``inner`` from ``cache_dir`` (see the module docstring).

    ``max_bytes=None`` never evicts. ``verify=True`` checks every entry's xxh3-64 on each use.
    ``fsync=True`` makes fills durable. ``lock_timeout`` bounds the wait for another process's fill.
    """

    name = "cached"

    def __init__(self, inner: Backend, cache_dir: str | os.PathLike | None = None, *, max_bytes: int | None = None,
                 verify: bool = False, fsync: bool = False, lock_timeout: float | None = DEFAULT_LOCK_TIMEOUT) -> None:
        super().__init__(part_size=inner.part_size, concurrency=inner.concurrency)
        if isinstance(inner, CachedBackend):
            raise ValueError("CachedBackend cannot wrap another CachedBackend")
        if max_bytes is not None and int(max_bytes) < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes!r}")
        self.inner = inner
        self.cache_dir = os.path.abspath(os.path.expanduser(os.fspath(cache_dir or default_cache_dir())))
        self.max_bytes = None if max_bytes is None else int(max_bytes)
        self.verify, self.fsync, self.lock_timeout = bool(verify), bool(fsync), lock_timeout
        self._data = os.path.join(self.cache_dir, "data")
        self._locks = os.path.join(self.cache_dir, "locks")
        self._tmp = os.path.join(self.cache_dir, "tmp")
        for d in (self._data, self._locks, self._tmp):
            os.makedirs(d, exist_ok=True)
        self._stats = CacheStats()
        self._mu = threading.Lock()
        self._pins: dict[str, tuple[ObjectInfo, int]] = {}

    def __repr__(self) -> str:
        return f"<CachedBackend {self.cache_dir!r} over {self.inner!r}>"

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
    def pinned(self, infos: Mapping[str, ObjectInfo] | Iterable[ObjectInfo]) -> Iterator[None]:
        """Within the block, treat ``infos`` as the current remote state and hold their entries.

        Reads of these URIs do not ``stat`` the remote object, and their entries are not evicted
        (missing ones are filled first). For callers that validated the versions moments ago.
        """
        items = list(infos.values()) if isinstance(infos, Mapping) else list(infos)
        with contextlib.ExitStack() as held:
            for info in items:
                held.enter_context(self._entry(info.uri, info, count=False))
            with self._mu:
                for info in items:
                    old = self._pins.get(info.uri)
                    self._pins[info.uri] = (info, (old[1] if old else 0) + 1)
            try:
                yield
            finally:
                with self._mu:
                    for info in items:
                        pin = self._pins.get(info.uri)
                        if pin is not None:
                            if pin[1] <= 1:
                                del self._pins[info.uri]
                            else:
                                self._pins[info.uri] = (pin[0], pin[1] - 1)

    def _unpin(self, uri: str) -> None:
        with self._mu:
            self._pins.pop(uri, None)

    # ---- entries -----------------------------------------------------------------------------
    def _key(self, info: ObjectInfo) -> str:
        token = info.version if info.version is not None else f"{info.mtime}:{info.size}"
        return hashlib.sha256(f"{info.uri}\n{token}\n{info.size}".encode()).hexdigest()[:40]

    def _paths(self, info: ObjectInfo) -> tuple[str, str, str]:
        key = self._key(info)
        d = os.path.join(self._data, key[:2])
        return (os.path.join(d, f"{key}-{_safe_name(info.uri)}"), os.path.join(d, f"{key}.json"),
                os.path.join(self._locks, f"{key}.lock"))

    def entry_path(self, info: ObjectInfo) -> str:
        """Where the entry for this exact object version lives (it may not exist)."""
        return self._paths(info)[0]

    def _remote_info(self, uri: str) -> ObjectInfo:
        with self._mu:
            held = self._pins.get(uri)
        if held is not None:
            return held[0]
        info = self.inner.stat(uri)
        if info.is_dir:
            raise IsADirectoryError(errno.EISDIR, f"is a directory: {uri}", uri)
        return info

    def _valid(self, info: ObjectInfo, data: str, meta: str) -> bool | None:
        """True: usable. False: present but bad (discard). None: absent."""
        try:
            size = os.stat(data).st_size
        except FileNotFoundError:
            return None
        try:
            with open(meta) as f:
                m = json.load(f)
        except (OSError, ValueError):
            return False
        if size != info.size or m.get("size") != info.size or m.get("uri") != info.uri:
            return False
        if self.verify or (m.get("boot_id") != _BOOT_ID and not m.get("fsynced")):
            return _file_xxh3(data) == m.get("xxh3")
        return True

    def _discard(self, data: str, meta: str) -> None:
        for p in (data, meta):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(p)

    @contextlib.contextmanager
    def _entry(self, uri: str, info: ObjectInfo | None = None, *, count: bool = True) -> Iterator[tuple[str, ObjectInfo]]:
        """Hold a shared lock on a valid entry for ``uri`` (filling it if needed); yield its path."""
        info = info or self._remote_info(uri)
        data, meta, lockp = self._paths(info)
        for _ in range(8):
            with _Lock(lockp, False, self.lock_timeout, uri):
                if self._valid(info, data, meta):
                    with contextlib.suppress(OSError):
                        os.utime(data)  # least recently used goes first
                    self._count(hits=int(count))
                    yield data, info
                    return
            with _Lock(lockp, True, self.lock_timeout, uri) as lock:
                downloaded = self._fill_locked(info, data, meta)
                lock.share()  # not atomic: an evictor may slip in, so check the entry survived
                if not (os.path.exists(data) and lock.still_at(lockp)):
                    continue
                self._count(**({"misses": 1} if downloaded else {"hits": int(count)}))
                if downloaded:
                    self._evict()  # this entry is share-locked by us, so it stays
                yield data, info
                return
        raise TimeoutError(errno.ETIMEDOUT, f"could not hold a cache entry for {uri}: it was evicted repeatedly "
                           f"(max_bytes={self.max_bytes} too small for the objects in use?)")

    def _fill_locked(self, info: ObjectInfo, data: str, meta: str) -> bool:
        """Holding the exclusive lock: make the entry valid. True if it was downloaded now."""
        state = self._valid(info, data, meta)
        if state:
            return False
        if state is False:
            self._discard(data, meta)
            self._count(discarded=1)
        key = self._key(info)
        for name in os.listdir(self._tmp):  # left by a filler that died holding this lock
            if name.startswith(key + "."):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(self._tmp, name))
        tmp = os.path.join(self._tmp, f"{key}.{os.getpid()}.{uuid.uuid4().hex[:8]}")
        try:
            digest = self._download(info, tmp)
            os.makedirs(os.path.dirname(data), exist_ok=True)
            record = {"uri": info.uri, "version": info.version, "size": info.size, "xxh3": digest,
                      "boot_id": _BOOT_ID, "fsynced": self.fsync, "created": time.time()}
            with open(tmp + ".json", "w") as f:
                json.dump(record, f)
            os.replace(tmp + ".json", meta)
            os.replace(tmp, data)
        except BaseException:
            for p in (tmp, tmp + ".json"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(p)
            raise
        self._count(bytes_fetched=info.size)
        return True

    def _download(self, info: ObjectInfo, path: str) -> str:
        """Copy the object into ``path``, reading the next chunk while writing this one. Returns xxh3-64."""
        h = xxhash.xxh3_64()
        chunk = max(1, min(info.size, self.inner.part_size * self.inner.concurrency))
        bufs = [bytearray(chunk), bytearray(chunk)] if info.size > chunk else [bytearray(chunk)]

        def fetch(i: int, pos: int) -> tuple[memoryview, int]:
            mv = memoryview(bufs[i % len(bufs)])[: min(chunk, info.size - pos)]
            n = self.inner.readinto(info.uri, mv, pos)
            if n != len(mv):
                raise IntegrityError(f"{info.uri}: object shrank while caching (got {pos + n} of {info.size} "
                                     f"bytes); it changed during the read, load again")
            return mv, n

        with open(path, "xb", buffering=0) as f, ThreadPoolExecutor(1, thread_name_prefix="ckptio-cache") as pool:
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
            if self.fsync:
                os.fsync(f.fileno())
        return h.hexdigest()

    # ---- eviction ----------------------------------------------------------------------------
    def _entries(self) -> list[tuple[float, int, str, str, str]]:
        out = []
        for sub in os.listdir(self._data):
            d = os.path.join(self._data, sub)
            with contextlib.suppress(FileNotFoundError, NotADirectoryError):
                for name in os.listdir(d):
                    if name.endswith(".json") or "-" not in name:
                        continue
                    key = name.split("-", 1)[0]
                    p = os.path.join(d, name)
                    with contextlib.suppress(FileNotFoundError):
                        st = os.stat(p)
                        out.append((st.st_mtime, st.st_size, p, os.path.join(d, f"{key}.json"),
                                    os.path.join(self._locks, f"{key}.lock")))
        return out

    def _evict(self) -> None:
        if self.max_bytes is None:
            return
        entries = sorted(self._entries())
        total = sum(e[1] for e in entries)
        for _mtime, size, data, meta, lockp in entries:
            if total <= self.max_bytes:
                break
            lock = _Lock.try_exclusive(lockp)
            if lock is None:
                continue  # in use or being filled
            with lock:
                if os.path.exists(data):
                    self._discard(data, meta)
                    total -= size
                    self._count(evictions=1)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(lockp)  # holders re-check the inode, so this is safe

    def cached_bytes(self) -> int:
        """Bytes currently held in the cache directory."""
        return sum(e[1] for e in self._entries())

    def clear(self) -> None:
        """Remove every entry not in use."""
        saved, self.max_bytes = self.max_bytes, 0
        try:
            self._evict()
        finally:
            self.max_bytes = saved

    # ---- public cache operations -------------------------------------------------------------
    def fill(self, uri: str, info: ObjectInfo | None = None) -> ObjectInfo:
        """Make sure the current version of ``uri`` is cached; returns the remote info it was keyed by."""
        with self._entry(uri, info) as (_path, got):
            return got

    def fill_many(self, uris: Iterable[str], *, threads: int | None = None) -> dict[str, ObjectInfo]:
        """:meth:`fill` for many objects in parallel (``threads`` defaults to the inner concurrency)."""
        uris = list(uris)
        with ThreadPoolExecutor(max(1, min(threads or self.inner.concurrency, len(uris) or 1))) as pool:
            return dict(zip(uris, pool.map(self.fill, uris)))

    # ---- Backend: reads served from the cache ------------------------------------------------
    def read_range(self, uri: str, start: int = 0, end: int | None = None) -> bytes:
        with self.open_reader(uri) as f:
            f.seek(start)
            return f.read() if end is None else f.read(max(0, end - start))

    def readinto(self, uri: str, buf: Buffer, offset: int = 0) -> int:
        from .local import _preadinto

        with self._entry(uri) as (path, _info):
            fd = os.open(path, os.O_RDONLY)
        try:
            return _preadinto(fd, memoryview(buf).cast("B"), offset)
        finally:
            os.close(fd)

    def read(self, uri: str) -> bytes:
        with self.open_reader(uri) as f:
            return f.read()

    def open_reader(self, uri: str, *, size: int | None = None) -> BinaryIO:
        """A real file on the entry; it keeps working if the entry is evicted while open."""
        with self._entry(uri) as (path, _info):
            return open(path, "rb")

    @contextlib.contextmanager
    def get_local_path(self, uri: str) -> Iterator[str]:
        """The cache entry itself, protected from eviction for the duration of the block. Read only."""
        with self._entry(uri) as (path, _info):
            yield path

    @contextlib.contextmanager
    def as_local(self, uri: str) -> Iterator[tuple[Backend, str]]:
        """``(a local backend, the entry's path)`` for the block, so formats read (or map) a plain file."""
        from .local import LocalBackend

        with self.get_local_path(uri) as path:
            yield LocalBackend(part_size=self.part_size, concurrency=self.concurrency), path

    # ---- Backend: everything else passes through ---------------------------------------------
    def stat(self, uri: str) -> ObjectInfo:
        with self._mu:
            held = self._pins.get(uri)
        return held[0] if held is not None else self.inner.stat(uri)

    def list(self, uri: str, *, recursive: bool = False) -> Iterator[ObjectInfo]:
        return self.inner.list(uri, recursive=recursive)

    def open_writer(self, uri: str, *, mode: WriteMode = "overwrite", durable: bool = True) -> Writer:
        self._unpin(uri)
        return self.inner.open_writer(uri, mode=mode, durable=durable)

    def write(self, uri: str, data: Buffer, *, mode: WriteMode = "overwrite", durable: bool = True) -> None:
        self._unpin(uri)
        self.inner.write(uri, data, mode=mode, durable=durable)

    def delete(self, uri: str) -> None:
        self._unpin(uri)
        self.inner.delete(uri)

    def copy(self, src: str, dst: str, *, mode: WriteMode = "overwrite") -> None:
        self._unpin(dst)
        self.inner.copy(src, dst, mode=mode)

    def exists(self, uri: str) -> bool:
        return self.inner.exists(uri)

    def isfile(self, uri: str) -> bool:
        return self.inner.isfile(uri)

    def isdir(self, uri: str) -> bool:
        return self.inner.isdir(uri)

    def rmtree(self, uri: str) -> None:
        with self._mu:
            for u in [u for u in self._pins if u.startswith(uri)]:
                del self._pins[u]
        self.inner.rmtree(uri)

    def list_pending_writes(self, uri: str) -> Iterator[PendingWrite]:
        return self.inner.list_pending_writes(uri)

    def abort_pending_write(self, write: PendingWrite) -> None:
        self.inner.abort_pending_write(write)

    def close(self) -> None:
        self.inner.close()


def _file_xxh3(path: str) -> str:
    h = xxhash.xxh3_64()
    buf = bytearray(_HASH_CHUNK)
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(buf)
            if not n:
                return h.hexdigest()
            h.update(memoryview(buf)[:n])


# ---- configuration: how ``cache=`` arguments and settings become a CachedBackend -------------

CACHE_OPTIONS = ("cache_dir", "max_bytes", "cache_verify", "cache_fsync")


def cache_options(cache: Any, backend_options: dict[str, Any]) -> dict[str, Any] | None:
    """Pop cache settings out of ``backend_options`` and combine them with a ``cache=`` argument.

    ``cache``: None (use the cache when settings give ``cache_dir``), False (never), True (default
    directory unless settings give one), a path (the directory), or a mapping with ``cache_dir``,
    ``max_bytes``, ``verify``, ``fsync``, ``lock_timeout``. Returns CachedBackend keyword arguments or None.
    """
    from ..config import coerce_options

    found = {k: backend_options.pop(k) for k in CACHE_OPTIONS if k in backend_options}
    if cache is False:
        return None
    if cache is None and "cache_dir" not in found:
        return None
    opts: dict[str, Any] = {"cache_dir": found.get("cache_dir"), "max_bytes": found.get("max_bytes"),
                            "verify": found.get("cache_verify", False), "fsync": found.get("cache_fsync", False)}
    if isinstance(cache, (str, os.PathLike)):
        opts["cache_dir"] = os.fspath(cache)
    elif isinstance(cache, Mapping):
        bad = set(cache) - {"cache_dir", "max_bytes", "verify", "fsync", "lock_timeout"}
        if bad:
            raise SettingsError(f"cache=: unknown key(s) {sorted(bad)}; expected cache_dir, max_bytes, verify, "
                                f"fsync, lock_timeout")
        names = {"verify": "cache_verify", "fsync": "cache_fsync"}  # coerced as the settings keys are
        given = coerce_options({names.get(k, k): v for k, v in cache.items()}, "cache=")
        opts.update({k.replace("cache_", "") if k in names.values() else k: v for k, v in given.items()})
    elif cache not in (None, True):
        raise SettingsError(f"cache= must be True, False, a directory or a mapping, got {type(cache).__name__}")
    opts["cache_dir"] = os.path.abspath(os.path.expanduser(opts["cache_dir"] or default_cache_dir()))
    return opts

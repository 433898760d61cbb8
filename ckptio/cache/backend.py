""":class:`CachedBackend`: a backend that wraps any backend and serves its whole-object reads from
the node-local cache (:class:`~ckptio.cache.store.CacheStore`, which documents the layout, locking
and verification). Writes, listings and deletes pass through to the wrapped backend.

Capabilities: ``local_file`` yields the verified entry, held against eviction for the block (filled
on a miss); ``held`` is declined (a load reads that entry); ``node_cache`` is the wrapper itself
(``fill``, ``fill_many``, ``pinned``, ``stats``..., for :mod:`ckptio.distributed`); ``with_options``
wraps the wrapped backend's derived backend over the same store; ``max_buffer_bytes`` and
``writes_in_place`` are the wrapped backend's (writes go straight to it).
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, BinaryIO

from ..backends.base import Backend, Buffer, Held, ObjectInfo, WriteMode, Writer
from ..wrappers.forwarding import ForwardingBackend
from .entries import Entry
from .settings import DEFAULT_LOCK_TIMEOUT
from .store import CacheStore, InUse


class CachedBackend(ForwardingBackend):
    """Serve whole-object reads of ``inner`` from ``cache_dir`` (see :mod:`ckptio.cache.store`).

    ``max_bytes=None`` never evicts. ``fsync=True`` makes fills durable. ``lock_timeout`` bounds the
    wait for another process's fill. Every read is verified; ``verify`` (``cache_verify``) is accepted
    for compatibility and changes nothing. ``store``: share an existing store (its directory and
    settings win over the other arguments).
    """

    name = "cached"

    def __init__(
        self,
        inner: Backend,
        cache_dir: str | os.PathLike | None = None,
        *,
        max_bytes: int | None = None,
        verify: bool = False,
        fsync: bool = False,
        lock_timeout: float | None = DEFAULT_LOCK_TIMEOUT,
        store: CacheStore | None = None,
    ) -> None:
        if isinstance(inner, CachedBackend):
            raise ValueError("CachedBackend cannot wrap another CachedBackend")
        super().__init__(inner)
        self.store = store or CacheStore(
            cache_dir, max_bytes=max_bytes, verify=verify, fsync=fsync, lock_timeout=lock_timeout
        )

    def __repr__(self) -> str:
        return f"<CachedBackend {self.cache_dir!r} over {self.inner!r}>"

    # ---- the store's settings and operations, for this backend's objects ---------------------
    @property
    def cache_dir(self) -> str:
        return self.store.cache_dir

    @property
    def max_bytes(self) -> int | None:
        return self.store.max_bytes

    @property
    def verify(self) -> bool:
        return self.store.verify

    @property
    def fsync(self) -> bool:
        return self.store.fsync

    @property
    def lock_timeout(self) -> float | None:
        return self.store.lock_timeout

    def stats(self) -> dict[str, int]:
        """Hits, misses, bytes fetched from the wrapped backend, evictions and discarded entries."""
        return self.store.stats()

    def cached_bytes(self) -> int:
        """Bytes the cache holds on disk (entries, their metadata, fills in progress or killed)."""
        return self.store.cached_bytes()

    def usage(self) -> dict[str, int]:
        """``entries``, ``bytes`` and ``partial_bytes`` on disk (see :func:`ckptio.cache.entries.usage`)."""
        return self.store.usage()

    def clear(self) -> None:
        """Remove every entry and leftover not in use."""
        self.store.clear()

    def entry_path(self, info: ObjectInfo) -> str:
        """Where the entry for this exact object version lives (it may not exist)."""
        return self.store.entry_path(info)

    def pinned(self, infos: Mapping[str, ObjectInfo] | Iterable[ObjectInfo]) -> contextlib.AbstractContextManager[None]:
        """Within the block, treat ``infos`` as the current remote state and hold their entries.

        Reads of these URIs do not ``stat`` the remote object, and their entries are not evicted
        (missing ones are filled first). For callers that validated the versions moments ago.
        """
        return self.store.pinned(self.inner, infos)

    def fill(self, uri: str, info: ObjectInfo | None = None) -> ObjectInfo:
        """Make sure the current version of ``uri`` is cached; returns the remote info it was keyed by."""
        return self.store.fill(self.inner, uri, info)

    def fill_many(self, uris: Iterable[str], *, threads: int | None = None) -> dict[str, ObjectInfo]:
        """:meth:`fill` for many objects in parallel (``threads`` defaults to the inner concurrency)."""
        return self.store.fill_many(self.inner, uris, threads=threads)

    # ---- capabilities ------------------------------------------------------------------------
    @property
    def node_cache(self) -> CachedBackend:
        return self

    @contextlib.contextmanager
    def local_file(self, uri: str) -> Iterator[str | None]:
        """The verified entry (filled on a miss), held against eviction for the block. An entry found
        damaged while others hold it: the wrapped backend's own ``local_file`` (None if it has none)."""
        with contextlib.ExitStack() as held:
            try:
                entry, _ = held.enter_context(self._entry(uri, serve=lambda e: _on_fd(e, e.verify)))
                path: str | None = entry.path
            except InUse as e:
                self._read_through(uri, e)
                path = held.enter_context(self.inner.local_file(uri))
            yield path

    def held(self, uri: str) -> Held | None:
        return None  # declined: a load reads the verified entry (local_file), which this wrapper fills

    def with_options(self, **options: Any) -> Backend:
        inner = self.inner.with_options(**options)
        return self if inner is self.inner else CachedBackend(inner, store=self.store)

    # ---- Backend: reads served from the cache ------------------------------------------------
    def _entry(self, uri: str, **kwargs: Any) -> contextlib.AbstractContextManager[tuple[Entry, Any]]:
        return self.store.entry(self.inner, uri, **kwargs)

    def _read_through(self, uri: str, e: InUse) -> None:
        self.store._count(read_through=1)
        warnings.warn(f"{e}; reading {uri} from {self.inner.name} until it is free to be replaced", stacklevel=4)

    def _read(self, uri: str, serve: Callable[[Entry], Any], through: Callable[[], Any]) -> Any:
        try:
            with self._entry(uri, serve=serve) as (_entry, out):
                return out
        except InUse as e:
            self._read_through(uri, e)
            return through()

    def read_range(self, uri: str, start: int = 0, end: int | None = None) -> bytes:
        return self._read(
            uri, lambda e: _on_fd(e, lambda fd: e.read(fd, start, end)), lambda: self.inner.read_range(uri, start, end)
        )

    def readinto(self, uri: str, buf: Buffer, offset: int = 0) -> int:
        mv = memoryview(buf).cast("B")
        return self._read(
            uri,
            lambda e: _on_fd(e, lambda fd: e.readinto(fd, mv, offset)),
            lambda: self.inner.readinto(uri, mv, offset),
        )

    def read(self, uri: str) -> bytes:
        return self.read_range(uri)

    def open_reader(self, uri: str, *, size: int | None = None) -> BinaryIO:
        """A real file on the entry, verified whole first; it keeps working if the entry is evicted while open."""
        return self._read(uri, _verified_file, lambda: self.inner.open_reader(uri))

    @contextlib.contextmanager
    def get_local_path(self, uri: str) -> Iterator[str]:
        """The cache entry itself, verified whole, protected from eviction for the duration of the block. Read only."""
        with contextlib.ExitStack() as held:
            try:
                entry, _ = held.enter_context(self._entry(uri, serve=lambda e: _on_fd(e, e.verify)))
                path = entry.path
            except InUse as e:
                self._read_through(uri, e)
                path = held.enter_context(self.inner.get_local_path(uri))
            yield path

    # ---- Backend: the pinned stat; writes pass through, unpinning (the rest: ForwardingBackend) --------
    def stat(self, uri: str) -> ObjectInfo:
        held = self.store.pinned_info(uri)
        return held if held is not None else self.inner.stat(uri)

    def open_writer(self, uri: str, *, mode: WriteMode = "overwrite", durable: bool = True) -> Writer:
        self.store.unpin(uri)
        return self.inner.open_writer(uri, mode=mode, durable=durable)

    def write(self, uri: str, data: Buffer, *, mode: WriteMode = "overwrite", durable: bool = True) -> None:
        self.store.unpin(uri)
        self.inner.write(uri, data, mode=mode, durable=durable)

    def delete(self, uri: str) -> None:
        self.store.unpin(uri)
        self.inner.delete(uri)

    def copy(self, src: str, dst: str, *, mode: WriteMode = "overwrite") -> None:
        self.store.unpin(dst)
        self.inner.copy(src, dst, mode=mode)

    def rmtree(self, uri: str) -> None:
        self.store.unpin(uri, prefix=True)
        self.inner.rmtree(uri)

    def close(self) -> None:
        self.inner.close()


def _on_fd(entry: Entry, fn: Callable[[int], Any]) -> Any:
    fd = os.open(entry.path, os.O_RDONLY)
    try:
        return fn(fd)
    finally:
        os.close(fd)


def _verified_file(entry: Entry) -> BinaryIO:
    f = open(entry.path, "rb")
    try:
        entry.verify(f.fileno())
    except BaseException:
        f.close()
        raise
    return f

"""The base of backend wrappers: a backend that forwards the operations a wrapper does not change
(metadata, listings, deletes, pending writes) to the backend it wraps, each one by name.

A wrapper subclasses it and implements or declines every capability itself (``local_file``,
``with_options``, ``node_cache``...); nothing is forwarded by attribute lookup.
"""

from __future__ import annotations

from collections.abc import Iterator

from ..backends.base import Backend, Buffer, ObjectInfo, PendingWrite, WriteMode, Writer


class ForwardingBackend(Backend):
    """``inner``'s metadata, listing, delete and pending-write operations, forwarded."""

    def __init__(self, inner: Backend) -> None:
        super().__init__(part_size=inner.part_size, concurrency=inner.concurrency)
        self.inner = inner
        self.writes_in_place = inner.writes_in_place
        self.reads_local = inner.reads_local
        self.max_buffer_bytes = inner.max_buffer_bytes

    def stat(self, uri: str) -> ObjectInfo:
        return self.inner.stat(uri)

    def list(self, uri: str, *, recursive: bool = False) -> Iterator[ObjectInfo]:
        return self.inner.list(uri, recursive=recursive)

    def delete(self, uri: str) -> None:
        self.inner.delete(uri)

    def exists(self, uri: str) -> bool:
        return self.inner.exists(uri)

    def isfile(self, uri: str) -> bool:
        return self.inner.isfile(uri)

    def isdir(self, uri: str) -> bool:
        return self.inner.isdir(uri)

    def list_pending_writes(self, uri: str) -> Iterator[PendingWrite]:
        return self.inner.list_pending_writes(uri)

    def abort_pending_write(self, write: PendingWrite) -> None:
        self.inner.abort_pending_write(write)


class PinnedView(ForwardingBackend):
    """The base of a view of ``inner`` whose reads of ``uri`` come from one version of it
    (:meth:`Backend.pin_version`): writes, copies and removals are ``inner``'s, and the view taken with other
    options pins the same version. A subclass pins the reads and keeps the version in ``pinned``."""

    uri: str

    @property
    def pinned(self) -> str | None:
        """The version the reads of ``uri`` are pinned to (None until the first read or stat finds it)."""
        raise NotImplementedError

    def with_options(self, **options: object) -> Backend:
        derived = self.inner.with_options(**options)
        return self if derived is self.inner else derived.pin_version(self.uri, self.pinned)

    def open_writer(self, uri: str, *, mode: WriteMode = "overwrite", durable: bool = True) -> Writer:
        return self.inner.open_writer(uri, mode=mode, durable=durable)

    def write(self, uri: str, data: Buffer, *, mode: WriteMode = "overwrite", durable: bool = True) -> None:
        self.inner.write(uri, data, mode=mode, durable=durable)

    def copy(self, src: str, dst: str, *, mode: WriteMode = "overwrite") -> None:
        self.inner.copy(src, dst, mode=mode)

    def rmtree(self, uri: str) -> None:
        self.inner.rmtree(uri)

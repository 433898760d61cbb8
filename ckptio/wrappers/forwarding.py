"""The base of backend wrappers: a backend that forwards the operations a wrapper does not change
(metadata, listings, deletes, pending writes) to the backend it wraps, each one by name.

A wrapper subclasses it and implements or declines every capability itself (``local_file``,
``with_options``, ``node_cache``...); nothing is forwarded by attribute lookup.
"""

from __future__ import annotations

from collections.abc import Iterator

from ..backends.base import Backend, ObjectInfo, PendingWrite


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

"""Reads of one local file pinned to one version of it (:meth:`ckptio.backends.local.LocalBackend.pin_version`).

A file is known by its device, inode, size and mtime: each read through the view opens the path and
checks them on its descriptor before and after reading, so a file renamed over the path (another inode)
or rewritten in place (another mtime or size) before or while a read runs is an IntegrityError, never a
mix of two files.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from typing import TypeVar

from ..errors import replaced
from ..osio import bytes_of, fresh_bytes, preadinto, preadv_into, reading
from ..wrappers.forwarding import PinnedView
from .base import Backend, Buffer, ObjectInfo

T = TypeVar("T")


def version_of(st: os.stat_result) -> str:
    """A local file's :attr:`ObjectInfo.version`."""
    return f"{st.st_mtime_ns}:{st.st_size}"


class PinnedFile(PinnedView):
    """``inner`` (a LocalBackend) with every read and ``stat`` of ``uri`` (at ``path``) from one file: the
    one the first of them found, of ``version`` when given. Other objects and every other operation are
    ``inner``'s."""

    def __init__(self, inner: Backend, uri: str, path: str, version: str | None = None) -> None:
        super().__init__(inner)
        self.name, self.uri, self.path = inner.name, uri, path
        self._version = version
        self._file: tuple[int, int, int, int] | None = None  # device, inode, mtime, size
        self._lock = threading.Lock()

    def _check(self, st: os.stat_result) -> None:
        seen, now = (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size), version_of(st)
        with self._lock:
            if self._file is None and self._version in (None, now):
                self._file, self._version = seen, now
            elif seen != self._file:
                raise replaced(self.uri, str(self._version), now if now != self._version else "another file")

    def _read(self, uri: str, read: Callable[[int], T]) -> T:
        with reading(self.path, uri) as fd:
            self._check(os.fstat(fd))
            out = read(fd)
            self._check(os.fstat(fd))  # written while it read: another mtime
            return out

    def readinto(self, uri: str, buf: Buffer, offset: int = 0) -> int:
        if uri != self.uri:
            return self.inner.readinto(uri, buf, offset)
        return self._read(uri, lambda fd: preadinto(fd, memoryview(buf).cast("B"), offset))

    def readv(self, uri: str, views: Sequence[memoryview], offset: int = 0) -> int:
        if uri != self.uri:
            return self.inner.readv(uri, views, offset)
        return self._read(uri, lambda fd: preadv_into(fd, [memoryview(v).cast("B") for v in views], offset))

    def read_range(self, uri: str, start: int = 0, end: int | None = None) -> bytes:
        if uri != self.uri:
            return self.inner.read_range(uri, start, end)

        def read(fd: int) -> bytes:
            out, view = fresh_bytes(max(0, (os.fstat(fd).st_size if end is None else end) - start))
            return bytes_of(out, view, preadinto(fd, view, start))

        return self._read(uri, read)

    def stat(self, uri: str) -> ObjectInfo:
        info = self.inner.stat(uri)
        if uri == self.uri and not info.is_dir:
            self._read(uri, lambda fd: None)  # the size and the bytes of one file
            if info.version != self._version:  # replaced between the two looks
                raise replaced(uri, str(self._version), info.version)
        return info

    @property
    def pinned(self) -> str | None:
        return self._version

    def pin_version(self, uri: str, version: str | None = None) -> Backend:
        if uri != self.uri:
            return self.inner.pin_version(uri, version)
        if version is not None:
            self._read(uri, lambda fd: None)
            if version != self._version:
                raise replaced(uri, version, self._version)
        return self

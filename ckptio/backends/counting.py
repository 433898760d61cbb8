"""A backend wrapper that reports the bytes it moves, for progress on any call.

``CountingBackend(inner, add)`` forwards everything to ``inner`` and calls ``add(n)`` for every
``n`` bytes read (``read_range``/``readinto``) or written (its writers). The io layer wraps the
resolved backend in it when a caller passes ``progress=``; the wrapped backend stays cached as is.
Reads a format serves from ``get_local_path`` (a local or cached file opened directly) are not
counted; the caller reports those as done when the call returns.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from .base import Backend, Buffer, ObjectInfo, WriteMode, Writer


class _CountingWriter(Writer):
    def __init__(self, inner: Writer, add: Callable[[int], None]) -> None:
        self.uri, self._inner, self._add = inner.uri, inner, add

    def write(self, data: Buffer) -> int:
        n = self._inner.write(data)
        self._add(n)
        return n

    def write_borrowed(self, data: Buffer) -> int:
        n = self._inner.write_borrowed(data)
        self._add(n)
        return n

    def close(self) -> None:
        self._inner.close()

    def abort(self) -> None:
        self._inner.abort()


class CountingBackend(Backend):
    def __init__(self, inner: Backend, add: Callable[[int], None]) -> None:
        super().__init__(part_size=inner.part_size, concurrency=inner.concurrency)
        self.inner, self._add = inner, add
        self.name = inner.name

    def read_range(self, uri: str, start: int = 0, end: int | None = None) -> bytes:
        data = self.inner.read_range(uri, start, end)
        self._add(len(data))
        return data

    def readinto(self, uri: str, buf: Buffer, offset: int = 0) -> int:
        n = self.inner.readinto(uri, buf, offset)
        self._add(n)
        return n

    def open_writer(self, uri: str, *, mode: WriteMode = "overwrite", durable: bool = True) -> Writer:
        return _CountingWriter(self.inner.open_writer(uri, mode=mode, durable=durable), self._add)

    def stat(self, uri: str) -> ObjectInfo:
        return self.inner.stat(uri)

    def list(self, uri: str, *, recursive: bool = False) -> Iterator[ObjectInfo]:
        return self.inner.list(uri, recursive=recursive)

    def delete(self, uri: str) -> None:
        self.inner.delete(uri)

    def exists(self, uri: str) -> bool:
        return self.inner.exists(uri)

    def isdir(self, uri: str) -> bool:
        return self.inner.isdir(uri)

    @contextlib.contextmanager
    def get_local_path(self, uri: str) -> Iterator[str]:
        with self.inner.get_local_path(uri) as p:
            yield p

    def __getattr__(self, name: str) -> Any:  # backend-specific extras (as_local, max_buffer_bytes...)
        return getattr(self.inner, name)

"""A ckptio backend published through the ``ckptio.backends`` entry-point group (no decorator)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from ckptio.backends.base import ObjectInfo
from ckptio.backends.memory import MemoryBackend
from ckptio.errors import NotFoundError


@contextlib.contextmanager
def _named(uri: str):
    try:
        yield
    except NotFoundError:
        raise NotFoundError(uri) from None


class TestPlugBackend(MemoryBackend):
    """``testplug://`` objects, kept in the memory backend's store under their own scheme."""

    name = "testplug"
    prefixes = ("testplug://",)
    __test__ = False  # not a pytest test class

    def __init__(self, *, greeting: str = "hello", **kw) -> None:
        super().__init__(**kw)
        self.greeting = greeting

    def _k(self, uri: str) -> str:
        return "testplug/" + uri.split("://", 1)[-1]

    def read_range(self, uri: str, start: int = 0, end: int | None = None) -> bytes:
        with _named(uri):
            return super().read_range(self._k(uri), start, end)

    def readinto(self, uri, buf, offset=0):
        with _named(uri):
            return super().readinto(self._k(uri), buf, offset)

    def open_writer(self, uri: str, *, mode="overwrite", durable=True):
        return super().open_writer(self._k(uri), mode=mode, durable=durable)

    def stat(self, uri: str) -> ObjectInfo:
        with _named(uri):
            info = super().stat(self._k(uri))
        return ObjectInfo(uri, info.size, info.mtime, info.version, info.is_dir)

    def list(self, uri: str, *, recursive: bool = False) -> Iterator[ObjectInfo]:
        for info in super().list("memory://" + self._k(uri), recursive=recursive):
            rest = info.uri.split("://", 1)[1][len("testplug/") :]
            yield ObjectInfo(f"testplug://{rest}", info.size, info.mtime, info.version, info.is_dir)

    def delete(self, uri: str) -> None:
        with _named(uri):
            super().delete(self._k(uri))

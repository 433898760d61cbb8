"""Reads of one object pinned to one version of it (:meth:`ckptio.backends.base.Backend.pin_version` of an
object store), and the helpers the store's reads share with it."""

from __future__ import annotations

import concurrent.futures as cf
import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

from ..backends.base import Backend, Buffer, ObjectInfo
from ..wrappers.forwarding import PinnedView
from .ranged import VersionPin


@functools.cache
def hook_takes(get_range: Callable[..., Any], name: str) -> bool:
    """Whether a store's ``_get_range`` takes the keyword ``name`` (a subclass's hook may predate it)."""
    params = inspect.signature(get_range).parameters.values()
    return any(p.name == name or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def range_of(backend: Backend, uri: str, start: int, end: int) -> bytes:
    """Bytes ``[start, end)`` of ``uri`` through ``backend.readinto`` (short at the end)."""
    buf = bytearray(max(0, end - start))
    if not buf:
        backend.stat(uri)  # an empty range of a missing object is still an error
        return b""
    n = backend.readinto(uri, buf, start)
    return bytes(buf) if n == len(buf) else bytes(buf[:n])


class PinnedReads(PinnedView):
    """``inner`` with every read of ``uri`` pinned to one version of it (:meth:`Backend.pin_version`); a
    ``stat`` of ``uri`` through it pins or checks the version too. Other objects and every other
    operation are ``inner``'s."""

    def __init__(self, inner: Backend, uri: str, version: str | None = None) -> None:
        super().__init__(inner)
        self.inner: Any = inner  # an ObjectStoreBackend: its reads take a pin
        self.uri, self.name = uri, inner.name
        self._pin = VersionPin(version)
        cls = type(inner)  # a subclass's override from before pins existed is called without one
        self._takes = {m: hook_takes(getattr(cls, m), "pin") for m in ("readinto", "readv", "read_head")}

    def _pin_kw(self, method: str, uri: str) -> dict[str, Any]:
        return {"pin": self._pin} if uri == self.uri and self._takes[method] else {}

    def readinto(self, uri: str, buf: Buffer, offset: int = 0) -> int:
        return self.inner.readinto(uri, buf, offset, **self._pin_kw("readinto", uri))

    def readv(self, uri: str, views: Sequence[memoryview], offset: int = 0) -> int:
        return self.inner.readv(uri, views, offset, **self._pin_kw("readv", uri))

    def read_head(self, uri: str, buf: Buffer, on_size: Callable[[int], None]) -> int:
        return self.inner.read_head(uri, buf, on_size, **self._pin_kw("read_head", uri))

    def start_read_head(self, uri: str, buf: Buffer, on_size: Callable[[int], None]) -> cf.Future[int]:
        return self.inner.start_read_head(uri, buf, on_size, **self._pin_kw("read_head", uri))

    def start_read_tail(self, uri: str, buf: Buffer, align: int = 1) -> cf.Future[int] | None:
        return self.inner.start_read_tail(uri, buf, align, **({"pin": self._pin} if uri == self.uri else {}))

    def stat(self, uri: str) -> ObjectInfo:
        info = self.inner.stat(uri)
        if uri == self.uri and not info.is_dir:
            self._pin.check(uri, info.version, reply=False)  # the size and the bytes from one version
        return info

    def read_range(self, uri: str, start: int = 0, end: int | None = None) -> bytes:
        return range_of(self, uri, start, self.stat(uri).size if end is None else end)

    @property
    def pinned(self) -> str | None:
        return self._pin.version

    def pin_version(self, uri: str, version: str | None = None) -> Backend:
        if uri != self.uri:
            return self.inner.pin_version(uri, version)
        if version is not None:
            self._pin.check(uri, version, reply=False)
        return self

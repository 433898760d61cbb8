"""``memory://``: objects in a dict, for tests and examples.

Like fsspec's memory filesystem, the store is process-wide (backend instances with different
options see the same objects) and never outlives the process; :func:`ckptio.reset` empties it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

from ..errors import AlreadyExistsError, NotFoundError, replaced
from ..osio import copy_bytes
from ..wrappers.forwarding import ForwardingBackend
from .base import Backend, Buffer, BufferedWriter, Held, ObjectInfo, WriteMode, Writer, check_mode


def _key(uri: str) -> str:
    return uri.split("://", 1)[-1].strip("/")


class _Store:
    def __init__(self) -> None:
        self.objects: dict[str, tuple[bytes, float, int]] = {}
        self.lock = threading.Lock()
        self.generation = 0


_STORE = _Store()


def clear() -> None:
    """Drop every ``memory://`` object (called by :func:`ckptio.reset`)."""
    with _STORE.lock:
        _STORE.objects.clear()


class MemoryBackend(Backend):
    name = "memory"
    reads_local = True

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self._objects = _STORE.objects
        self._lock = _STORE.lock
        self.bytes_read = 0  # counted so tests can check that partial loads read only what they need

    def read_range(self, uri: str, start: int = 0, end: int | None = None) -> bytes:
        return self._slice(self._get(uri)[0], start, end)

    def read(self, uri: str) -> bytes:
        return self.read_range(uri)  # the whole slice of the stored (immutable) bytes is that object: no copy

    def readinto(self, uri: str, buf: Buffer, offset: int = 0) -> int:
        return self._copy_out(uri, self._get(uri)[0], buf, offset)

    def held(self, uri: str) -> Held:
        return Held(self._get(uri)[0], self._count)

    def _count(self, n: int) -> None:
        self.bytes_read += n

    def _slice(self, data: bytes, start: int, end: int | None) -> bytes:
        out = data[start:end]
        self.bytes_read += len(out)
        return out

    def _copy_out(self, uri: str, data: bytes, buf: Buffer, offset: int) -> int:
        if offset < 0:
            raise ValueError(f"negative offset {offset} reading {uri}")
        n = copy_bytes(memoryview(buf).cast("B"), data, offset)  # GIL released for large copies
        self.bytes_read += n
        return n

    def open_writer(self, uri: str, *, mode: WriteMode = "overwrite", durable: bool = True) -> Writer:
        check_mode(mode)
        if mode == "create" and _key(uri) in self._objects:
            raise AlreadyExistsError(uri)
        return BufferedWriter(uri, lambda data: self._put(uri, data, mode))

    def _put(self, uri: str, data: bytes, mode: WriteMode) -> None:
        k = _key(uri)
        with self._lock:
            if mode == "create" and k in self._objects:
                raise AlreadyExistsError(uri)
            _STORE.generation += 1
            self._objects[k] = (bytes(data), time.time(), _STORE.generation)

    def pin_version(self, uri: str, version: str | None = None) -> Backend:
        """A snapshot: ``uri``'s stored bytes as they are now (a write replaces them, never changes
        them), read without a copy; a ``version`` other than theirs is an IntegrityError."""
        data, mtime, gen = self._get(uri)
        if version is not None and version != str(gen):
            raise replaced(uri, version, str(gen))
        return _Snapshot(self, uri, data, ObjectInfo(uri, len(data), mtime, str(gen)))

    def _get(self, uri: str) -> tuple[bytes, float, int]:
        try:
            return self._objects[_key(uri)]
        except KeyError:
            raise NotFoundError(uri) from None

    def stat(self, uri: str) -> ObjectInfo:
        k = _key(uri)
        if k not in self._objects:
            if self.isdir(uri):
                return ObjectInfo(uri, 0, None, None, is_dir=True)
            raise NotFoundError(uri)
        data, mtime, gen = self._objects[k]
        return ObjectInfo(uri, len(data), mtime, str(gen))

    def list(self, uri: str, *, recursive: bool = False) -> Iterator[ObjectInfo]:
        scheme = uri.split("://", 1)[0] if "://" in uri else "memory"
        prefix = _key(uri)
        prefix = prefix + "/" if prefix else ""
        with self._lock:
            items = sorted(self._objects.items())
        seen_dirs: set[str] = set()
        for k, (data, mtime, gen) in items:
            if not k.startswith(prefix):
                continue
            rest = k[len(prefix) :]
            if not recursive and "/" in rest:
                d = rest.split("/", 1)[0]
                if d not in seen_dirs:
                    seen_dirs.add(d)
                    yield ObjectInfo(f"{scheme}://{prefix}{d}", 0, None, None, is_dir=True)
                continue
            yield ObjectInfo(f"{scheme}://{k}", len(data), mtime, str(gen))

    def delete(self, uri: str) -> None:
        with self._lock:
            if self._objects.pop(_key(uri), None) is None:
                raise NotFoundError(uri)


class _Snapshot(ForwardingBackend):
    """``inner`` with ``uri`` read from the bytes it held when the view was made; other objects and
    every other operation are ``inner``'s."""

    def __init__(self, inner: MemoryBackend, uri: str, data: bytes, info: ObjectInfo) -> None:
        super().__init__(inner)
        self.inner: MemoryBackend = inner
        self.name, self.uri, self._data, self._info = inner.name, uri, data, info

    def readinto(self, uri: str, buf: Buffer, offset: int = 0) -> int:
        if uri != self.uri:
            return self.inner.readinto(uri, buf, offset)
        return self.inner._copy_out(uri, self._data, buf, offset)

    def read_range(self, uri: str, start: int = 0, end: int | None = None) -> bytes:
        if uri != self.uri:
            return self.inner.read_range(uri, start, end)
        return self.inner._slice(self._data, start, end)

    def read(self, uri: str) -> bytes:
        return self.read_range(uri)

    def stat(self, uri: str) -> ObjectInfo:
        return self._info if uri == self.uri else self.inner.stat(uri)

    def held(self, uri: str) -> Held:
        return Held(self._data, self.inner._count) if uri == self.uri else self.inner.held(uri)

    def pin_version(self, uri: str, version: str | None = None) -> Backend:
        if uri != self.uri:
            return self.inner.pin_version(uri, version)
        if version is not None and version != self._info.version:
            raise replaced(uri, version, self._info.version)
        return self

    def open_writer(self, uri: str, *, mode: WriteMode = "overwrite", durable: bool = True) -> Writer:
        return self.inner.open_writer(uri, mode=mode, durable=durable)

"""Any other fsspec protocol (``hdfs://``, ``abfs://``, ``sftp://``, ``memory``-like...) as a ckptio backend.

Keyword options other than the base ones (``part_size``, ``concurrency``) are fsspec storage
options, passed to ``fsspec.filesystem(protocol, ...)``. The writer spools to memory (then to a
local temporary file beyond ``part_size``) and uploads on ``close``, so nothing is visible before
commit. ``mode="create"`` checks for the object first: atomic only where the filesystem itself is.
"""

from __future__ import annotations

import contextlib
import errno
import os
import tempfile
from collections.abc import Iterator
from typing import Any

import fsspec

from ..errors import AccessDeniedError, AlreadyExistsError, CkptioError, NotDirectoryError, NotFoundError, TransferError
from ..threads import exit_safe
from .base import DEFAULT_CONCURRENCY, DEFAULT_PART_SIZE, Backend, Buffer, ObjectInfo, WriteMode, Writer, check_mode

_MTIME_KEYS = ("mtime", "LastModified", "last_modified", "updated", "modified", "created", "ctime")
_VERSION_KEYS = ("generation", "ETag", "etag", "version_id", "VersionId")


def _timestamp(v: Any) -> float | None:
    if v is None:
        return None
    if isinstance(v, (int, float)):
        return float(v)
    ts = getattr(v, "timestamp", None)
    return float(ts()) if callable(ts) else None


class FsspecBackend(Backend):
    """Adapter from fsspec's ``AbstractFileSystem`` to the ckptio backend interface."""

    name = "fsspec"
    accepts_any_options = True  # storage options are the filesystem's own keyword arguments

    def __init__(
        self,
        *,
        protocol: str,
        part_size: int = DEFAULT_PART_SIZE,
        concurrency: int = DEFAULT_CONCURRENCY,
        **storage_options: Any,
    ) -> None:
        super().__init__(part_size=part_size, concurrency=concurrency)
        self.protocol = protocol
        self.fs = fsspec.filesystem(protocol, skip_instance_cache=True, **storage_options)
        if getattr(self.fs, "async_impl", False):  # its IO loop's thread work still runs in an atexit handler
            exit_safe(self.fs.loop)

    def __repr__(self) -> str:
        return f"<FsspecBackend protocol={self.protocol!r}>"

    def _path(self, uri: str) -> str:
        return self.fs._strip_protocol(uri)

    @contextlib.contextmanager
    def _translate(self, uri: str) -> Iterator[None]:
        try:
            yield
        except CkptioError:
            raise
        except FileNotFoundError as e:
            raise NotFoundError(uri) from e
        except FileExistsError as e:
            raise AlreadyExistsError(uri) from e
        except PermissionError as e:
            raise AccessDeniedError(uri) from e
        except (IsADirectoryError, NotADirectoryError):
            raise
        except OSError as e:
            raise TransferError(e.errno or errno.EIO, f"{self.protocol} error for {uri}: {e}", uri) from e

    def read_range(self, uri: str, start: int = 0, end: int | None = None) -> bytes:
        with self._translate(uri):
            return self.fs.cat_file(self._path(uri), start=start, end=end)

    def open_writer(self, uri: str, *, mode: WriteMode = "overwrite", durable: bool = True) -> Writer:
        check_mode(mode)
        if mode == "create" and self.isfile(uri):
            raise AlreadyExistsError(uri)
        return _SpoolWriter(self, uri, mode)

    def _commit(self, uri: str, mode: WriteMode, data: bytes | None, local: str | None) -> None:
        path = self._path(uri)
        with self._translate(uri):
            if mode == "create" and self.fs.exists(path):
                raise AlreadyExistsError(uri)
            parent = self.fs._parent(path)
            if parent and not self.fs.exists(parent):
                with contextlib.suppress(FileExistsError, NotImplementedError):
                    self.fs.makedirs(parent, exist_ok=True)
            if local is not None:
                self.fs.put_file(local, path)
            else:
                self.fs.pipe_file(path, data or b"")

    def stat(self, uri: str) -> ObjectInfo:
        with self._translate(uri):
            info = self.fs.info(self._path(uri))
        return self._info(uri, info)

    def _info(self, uri: str, info: dict) -> ObjectInfo:
        is_dir = info.get("type") == "directory"
        size = 0 if is_dir else int(info.get("size") or 0)
        mtime = next((t for t in (_timestamp(info.get(k)) for k in _MTIME_KEYS) if t is not None), None)
        version = next((str(info[k]) for k in _VERSION_KEYS if info.get(k) is not None), None)
        if version is None and not is_dir:
            version = f"{mtime}:{size}"
        return ObjectInfo(uri, size, mtime, version, is_dir)

    def list(self, uri: str, *, recursive: bool = False) -> Iterator[ObjectInfo]:
        root = self._path(uri).rstrip("/")
        base = uri.rstrip("/")
        with self._translate(uri):
            if not self.fs.isdir(root):
                if self.fs.exists(root):
                    raise NotDirectoryError(errno.ENOTDIR, f"not a directory: {uri}", uri)
                raise NotFoundError(uri, "no such directory")
            if recursive:
                entries = self.fs.find(root, detail=True, withdirs=False).values()
            else:
                entries = self.fs.ls(root, detail=True)
        for info in sorted(entries, key=lambda i: i["name"]):
            rel = info["name"].rstrip("/")[len(root) :].lstrip("/")
            if rel:
                yield self._info(f"{base}/{rel}", info)

    def delete(self, uri: str) -> None:
        path = self._path(uri)
        with self._translate(uri):
            if not self.fs.isfile(path):
                raise NotFoundError(uri)
            self.fs.rm_file(path)


class _SpoolWriter(Writer):
    """Memory up to ``part_size``, then a local temporary file; uploaded on ``close``."""

    def __init__(self, backend: FsspecBackend, uri: str, mode: WriteMode) -> None:
        self.uri, self._b, self._mode = uri, backend, mode
        self._buf: bytearray | None = bytearray()
        self._file: Any = None

    def write(self, data: Buffer) -> int:
        if self._buf is None:
            raise ValueError(f"write to a closed writer: {self.uri}")
        mv = memoryview(data).cast("B")
        if self._file is None and len(self._buf) + len(mv) > self._b.part_size:
            self._file = tempfile.NamedTemporaryFile(prefix="ckptio-spool-", delete=False)
            self._file.write(self._buf)
            self._buf = bytearray(b"")
        if self._file is not None:
            self._file.write(mv)
        else:
            self._buf += mv
        return len(mv)

    def close(self) -> None:
        if self._buf is None:
            return
        data, self._buf = self._buf, None
        try:
            if self._file is not None:
                self._file.close()
                self._b._commit(self.uri, self._mode, None, self._file.name)
            else:
                self._b._commit(self.uri, self._mode, bytes(data), None)
        finally:
            self._discard()

    def abort(self) -> None:
        self._buf = None
        self._discard()

    def _discard(self) -> None:
        if self._file is not None:
            self._file.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._file.name)
            self._file = None

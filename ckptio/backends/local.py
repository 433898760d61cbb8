"""Local filesystem: bare paths and ``file://``.

Writes are atomic: bytes go to a temporary file in the target directory, are fsynced, and are
renamed (``overwrite``) or hard-linked (``create``, which fails if the name exists) into place,
then the directory is fsynced. A crash never leaves a torn file under the final name; a killed
writer leaves its temporary file, ``.<name>.ckptio-tmp-<random>``, which listings hide and
``list_pending_writes`` reports (its ``since`` is the file's mtime, the last write).

A recursive listing does not follow symlinks, to files or directories alike: each is skipped with a
warning naming it (one pointing outside the tree would hand outside content to a tree copy, a dangling
one would fail it). A listing of one directory shows them as what they point to.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat as _stat
import sys
import uuid
import warnings
from collections.abc import Iterator, Sequence
from typing import Any, BinaryIO

from .. import uri as _uri
from ..errors import AccessDeniedError, AlreadyExistsError, NotDirectoryError, NotFoundError, replaced
from ..osio import WriteBehind, bytes_of, fresh_bytes, nonblocking, preadv_into, reading, translate_os_errors
from ..osio import preadinto as _preadinto
from .base import Backend, Buffer, ObjectInfo, PendingWrite, WriteMode, Writer, check_mode
from .local_pin import PinnedFile, version_of

TMP_MARKER = ".ckptio-tmp-"


def local_path(uri: str) -> str:
    """``file:///a/b`` or ``/a/b`` -> ``/a/b`` (``~`` expanded)."""
    scheme, rest = _uri.split(uri)
    if scheme not in ("", "file"):
        raise ValueError(f"not a local URI: {uri!r}")
    return os.path.expanduser(rest)


def ensure_inside(backend: Backend, root: str, target: str) -> None:
    """For a local destination: refuse ``target`` if, with symlinks resolved, it is not under ``root``.

    Tree copies and cache fills call this so a key (``../``) or a symlink already in the
    destination cannot make them write outside the directory the caller named."""
    if not isinstance(backend, LocalBackend):
        return
    real_root = os.path.realpath(local_path(root))
    real = os.path.realpath(local_path(target))
    if os.path.commonpath([real_root, real]) != real_root:
        raise AccessDeniedError(
            target, f"refusing to write outside {root} (the path leaves it through a symlink or '..')"
        )


def fsync_dir(path: str) -> None:
    with contextlib.suppress(OSError):  # some filesystems refuse O_RDONLY on directories
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _open_replaced(path: str) -> int | None:
    """A read-only descriptor of the regular file at ``path`` on a block-device filesystem (ext4, xfs on
    a disk), else None. Not on NFS, FUSE, tmpfs or overlay (device major 0): there an open file renamed
    over is silly-renamed or fetched, and nothing is discarded anyway."""
    try:
        st = os.lstat(path)
        if not _stat.S_ISREG(st.st_mode) or os.major(st.st_dev) == 0:
            return None
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if os.fstat(fd).st_ino == st.st_ino:
            return fd
    except OSError:
        pass
    os.close(fd)
    return None


def _missing_dirs(directory: str) -> list[str]:
    """``directory`` and those of its ancestors that do not exist, deepest first (what makedirs will make).

    The path is kept as given, never normalized: ``lnk/../new`` is made (and its parent synced) where the
    kernel resolves it, in the symlink target's parent, not where ``lnk`` stands."""
    out: list[str] = []
    d = directory or "."
    while not os.path.exists(d):
        out.append(d)
        parent = os.path.dirname(d) or "."
        if parent == d:
            break
        d = parent
    return out


def _sync_parents(made: list[str]) -> None:
    """Make the entry of each directory in ``made`` durable in its parent."""
    for d in made:
        fsync_dir(os.path.dirname(d) or ".")


def makedirs(path: str, durable: bool = True) -> None:
    """``os.makedirs(path, exist_ok=True)``; ``durable``: the entry of each directory made is fsynced in its parent."""
    made = _missing_dirs(path)
    os.makedirs(path, exist_ok=True)
    if durable:
        _sync_parents(made)


class LocalWriter(Writer):
    def __init__(self, uri: str, path: str, mode: WriteMode, durable: bool) -> None:
        self.uri, self._path, self._mode, self._durable = uri, path, mode, durable
        directory = os.path.dirname(path) or "."
        with translate_os_errors(uri):
            if mode == "create" and os.path.lexists(path):
                raise AlreadyExistsError(uri)
            self._tmp = os.path.join(directory, f".{os.path.basename(path)}{TMP_MARKER}{uuid.uuid4().hex[:12]}")
            self._new_dirs: list[str] = []  # directories this writer made, deepest first
            try:
                self._f: BinaryIO | None = open(self._tmp, "xb", buffering=0)
            except FileNotFoundError:  # a new directory: made on the first write into it
                self._new_dirs = _missing_dirs(directory)
                os.makedirs(directory, exist_ok=True)
                self._f = open(self._tmp, "xb", buffering=0)
        # a durable file: writeback starts as it is written (callers writing on local_fileno() do their own)
        self._behind = WriteBehind(self._f.fileno()) if durable else None

    def write(self, data: Buffer) -> int:
        if self._f is None:
            raise ValueError(f"write to a closed writer: {self.uri}")
        mv = memoryview(data).cast("B")
        total = len(mv)
        with translate_os_errors(self.uri):
            while mv:
                n = self._f.write(mv)
                mv = mv[n:]
        if self._behind is not None:
            self._behind.wrote(total)
        return total

    def fileno(self) -> int:
        assert self._f is not None
        return self._f.fileno()

    def local_fileno(self) -> int | None:
        return None if self._f is None else self._f.fileno()

    def close(self) -> None:
        if self._f is None:
            return
        f, self._f = self._f, None
        try:
            with translate_os_errors(self.uri):
                if self._durable:
                    os.fsync(f.fileno())
                f.close()
                if self._mode == "create":
                    os.link(self._tmp, self._path)  # atomic create-if-absent
                    os.unlink(self._tmp)
                    if self._durable:
                        fsync_dir(os.path.dirname(self._path) or ".")
                else:
                    # Keep the replaced file open across the rename and the directory fsync: its blocks are
                    # then freed when we close it, after the commit, not inside the transaction the fsync
                    # waits for (on a filesystem mounted with ``discard`` that wait includes discarding them).
                    old = _open_replaced(self._path) if self._durable else None
                    try:
                        os.replace(self._tmp, self._path)
                        if self._durable:
                            fsync_dir(os.path.dirname(self._path) or ".")
                    finally:
                        if old is not None:
                            os.close(old)
                if self._durable:  # each new directory's entry in its parent: durable as the file is
                    _sync_parents(self._new_dirs)
        except BaseException:
            f.close()
            self._discard()
            raise

    def abort(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None
        self._discard()

    def _discard(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._tmp)


class LocalBackend(Backend):
    """Files on a local (or locally mounted) filesystem."""

    name = "local"
    writes_in_place = True
    reads_local = True

    def __init__(self, *, durable: bool = True, **kw) -> None:
        super().__init__(**kw)
        self.durable = bool(durable)

    def read_range(self, uri: str, start: int = 0, end: int | None = None) -> bytes:
        with reading(local_path(uri), uri) as fd:
            if end is None:
                end = os.fstat(fd).st_size
            out, view = fresh_bytes(max(0, end - start))
            return bytes_of(out, view, _preadinto(fd, view, start))

    def readinto(self, uri: str, buf: Buffer, offset: int = 0) -> int:
        with reading(local_path(uri), uri) as fd:
            return _preadinto(fd, memoryview(buf).cast("B"), offset)

    def readv(self, uri: str, views: Sequence[memoryview], offset: int = 0) -> int:
        if type(self).readinto is not LocalBackend.readinto:  # a subclass that reads its own way
            return super().readv(uri, views, offset)
        with reading(local_path(uri), uri) as fd:
            return preadv_into(fd, [memoryview(v).cast("B") for v in views], offset)

    def open_writer(self, uri: str, *, mode: WriteMode = "overwrite", durable: bool = True) -> Writer:
        check_mode(mode)
        return LocalWriter(uri, local_path(uri), mode, durable and self.durable)

    def open_reader(self, uri: str, *, size: int | None = None) -> BinaryIO:
        with translate_os_errors(uri):
            return open(local_path(uri), "rb", opener=nonblocking)

    def stat(self, uri: str) -> ObjectInfo:
        with translate_os_errors(uri):
            st = os.stat(local_path(uri))
        is_dir = _stat.S_ISDIR(st.st_mode)
        return ObjectInfo(uri, 0 if is_dir else st.st_size, st.st_mtime, f"{st.st_mtime_ns}:{st.st_size}", is_dir)

    def list(self, uri: str, *, recursive: bool = False) -> Iterator[ObjectInfo]:
        root = local_path(uri)
        if not os.path.isdir(root):
            if os.path.exists(root):
                raise NotDirectoryError(errno.ENOTDIR, f"not a directory: {uri}", uri)
            raise NotFoundError(uri, "no such directory")
        prefix = uri.rstrip("/") if uri.rstrip("/") else uri
        if recursive:
            for dirpath, dirnames, filenames in os.walk(root):
                dirnames.sort()
                rel = os.path.relpath(dirpath, root)
                for fn in sorted(filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]):
                    if TMP_MARKER in fn:
                        continue
                    child = fn if rel == "." else f"{rel}/{fn}".replace(os.sep, "/")
                    path = os.path.join(dirpath, fn)
                    if os.path.islink(path):
                        warnings.warn(
                            f"{prefix}/{child}: a symlink (to {os.readlink(path)}), not followed by a recursive "
                            "listing or tree copy: skipped",
                            stacklevel=2,
                        )
                        continue
                    yield self._info(f"{prefix}/{child}", path)
        else:
            with os.scandir(root) as it:
                for entry in sorted(it, key=lambda e: e.name):
                    if TMP_MARKER in entry.name:
                        continue
                    yield self._info(f"{prefix}/{entry.name}", entry.path)

    def _info(self, child_uri: str, path: str) -> ObjectInfo:
        st = os.stat(path)
        is_dir = _stat.S_ISDIR(st.st_mode)
        return ObjectInfo(child_uri, 0 if is_dir else st.st_size, st.st_mtime, f"{st.st_mtime_ns}:{st.st_size}", is_dir)

    def delete(self, uri: str) -> None:
        with translate_os_errors(uri):
            os.unlink(local_path(uri))

    def isdir(self, uri: str) -> bool:
        return os.path.isdir(local_path(uri))

    def exists(self, uri: str) -> bool:
        return os.path.exists(local_path(uri))

    def rmtree(self, uri: str) -> None:
        """Delete the tree; what another process deletes meanwhile (ranks sharing a node's tier) is gone too."""
        path = local_path(uri)
        if os.path.isdir(path):
            if sys.version_info >= (3, 12):
                shutil.rmtree(path, onexc=lambda fn, p, e: _raise_unless_gone(e))
            else:
                shutil.rmtree(path, onerror=lambda fn, p, info: _raise_unless_gone(info[1]))
        elif os.path.lexists(path):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    def list_pending_writes(self, uri: str) -> Iterator[PendingWrite]:
        root = local_path(uri)
        prefix = uri.rstrip("/") if uri.rstrip("/") else uri
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames.sort()
            rel = os.path.relpath(dirpath, root).replace(os.sep, "/")
            for fn in sorted(filenames):
                at = fn.find(TMP_MARKER)
                if not fn.startswith(".") or at < 2:
                    continue
                path = os.path.join(dirpath, fn)
                try:
                    since = os.stat(path).st_mtime
                except FileNotFoundError:  # committed or aborted meanwhile
                    continue
                target = fn[1:at] if rel == "." else f"{rel}/{fn[1:at]}"
                yield PendingWrite(f"{prefix}/{target}", since, path)

    def abort_pending_write(self, write: PendingWrite) -> None:
        if TMP_MARKER not in os.path.basename(write.handle):
            raise ValueError(f"not a temporary file of a pending write to {write.uri}: {write.handle!r}")
        with contextlib.suppress(FileNotFoundError), translate_os_errors(write.uri):
            os.unlink(write.handle)

    def copy(self, src: str, dst: str, *, mode: WriteMode = "overwrite") -> None:
        """One file's bytes (one descriptor: a rename over ``src`` is not read); one rewritten in place
        meanwhile (another size or mtime) is an IntegrityError and ``dst`` is not written."""
        with translate_os_errors(src), open(local_path(src), "rb", opener=nonblocking) as fsrc:
            before = version_of(os.fstat(fsrc.fileno()))
            with self.open_writer(dst, mode=mode) as w:
                shutil.copyfileobj(fsrc, w, length=self.part_size)
                if (now := version_of(os.fstat(fsrc.fileno()))) != before:
                    raise replaced(src, before, now)

    @contextlib.contextmanager
    def get_local_path(self, uri: str) -> Iterator[str]:
        path = local_path(uri)
        if not os.path.exists(path):
            raise NotFoundError(uri)
        yield path

    @contextlib.contextmanager
    def local_file(self, uri: str) -> Iterator[str | None]:
        with self.get_local_path(uri) as path:
            yield path

    def file_path(self, uri: str) -> str | None:
        if type(self).local_file is not LocalBackend.local_file or type(self).readinto is not LocalBackend.readinto:
            return None  # a subclass that reads its own way: not around it
        return local_path(uri)

    def pin_version(self, uri: str, version: str | None = None) -> Backend:
        """Reads of ``uri`` from one file: one renamed over it or rewritten meanwhile is an IntegrityError."""
        if type(self).readinto is not LocalBackend.readinto:
            return self  # a subclass that reads its own way: not around it
        return PinnedFile(self, uri, local_path(uri), version)

    def with_options(self, **options: Any) -> Backend:
        opts = {"durable": self.durable, "part_size": self.part_size, "concurrency": self.concurrency}
        unknown = sorted(set(options) - set(opts))
        if unknown:
            raise ValueError(f"{self!r} has no option(s) {unknown}")
        if all(opts[k] == v for k, v in options.items()):
            return self
        derived = LocalBackend(**{**opts, **options})
        derived.name = self.name
        return derived


def _raise_unless_gone(e: BaseException) -> None:
    """For ``shutil.rmtree``: an entry already deleted is fine, any other error raises."""
    if not isinstance(e, FileNotFoundError):
        raise e

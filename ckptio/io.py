"""The easy_io face: ``dump``/``load`` by extension and file operations on any URI.

Signatures follow NVIDIA Cosmos's ``easy_io`` and OpenMMLab's ``mmengine.fileio`` so their callers
move over with an import change: every function accepts ``backend_args`` and ``backend_key``.
Differences are listed in docs/migrating.md.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
from collections.abc import Iterator, Mapping
from typing import IO, Any

from . import registry as _registry
from . import transfer as _transfer
from . import uri as _uri
from .backends import local as _local
from .backends.base import Backend, WriteMode
from .backends.local import LocalBackend, local_path
from .context import default_context
from .errors import AlreadyExistsError, NotFoundError, UnsupportedValueError
from .formats.base import Format, check_keywords

# ---------------------------------------------------------------------------------------------
# backend selection (Cosmos/mmengine compatible arguments)


def set_s3_backend(key: str | None = None, backend_args: Mapping[str, Any] | None = None) -> None:
    """Register S3 options under ``key`` (default ``"default"``), as Cosmos ``easy_io.set_s3_backend``.

    Later calls pass ``backend_key=key``; with no key and no ``backend_args``, ``s3://`` URIs use the
    ``"default"`` entry. Entries live in the default context and are dropped by :func:`ckptio.reset`.
    """
    default_context().named_backends[key or "default"] = dict(backend_args or {"backend": "s3"})


def _resolve(
    uri: str | os.PathLike,
    backend_args: Mapping[str, Any] | None = None,
    backend_key: str | None = None,
    **options: Any,
) -> tuple[Backend, str]:
    return default_context().resolve(uri, backend_args=backend_args, backend_key=backend_key, **options)


def _format_for(uri: str, file_format: str | None) -> Format:
    if file_format is not None:
        entry = _registry.formats.by_name(file_format.lstrip(".")) if not file_format.startswith(".") else None
        if entry is None:
            entry = _registry.formats.find("x." + file_format.lstrip("."))
    else:
        entry = _registry.formats.find(uri)
    return entry.instance()


# ---------------------------------------------------------------------------------------------
# dump / load


def dump(
    obj: Any,
    file: Any = None,
    file_format: str | None = None,
    *,
    backend_args: Mapping[str, Any] | None = None,
    backend_key: str | None = None,
    fast_backend: bool = True,
    mode: WriteMode = "overwrite",
    progress: Any = None,
    **kwargs: Any,
) -> Any:
    """Serialize ``obj`` to a URI (format by extension), an open file, or (``file=None``) return it.

    Writes are atomic: the object appears under ``file`` complete or not at all. ``mode="create"``
    refuses to replace an existing object. ``progress``: ``True`` (a bar on a terminal) or a
    ``callback(bytes_done, bytes_total)`` (total 0 while unknown). Other keyword arguments go to the format.
    """
    if file is None:
        if file_format is None:
            raise ValueError("dump(obj) without a file needs file_format=... (e.g. 'json')")
        fmt = _format_for("", file_format)
        buf = io.BytesIO()
        fmt.dump_file(obj, buf, **kwargs)
        data = buf.getvalue()
        return data.decode("utf-8") if fmt.name in ("json", "yaml", "txt") else data
    if hasattr(file, "write"):
        if file_format is None:
            raise ValueError("dump(obj, file_object) needs file_format=...")
        _format_for("", file_format).dump_file(obj, file, **kwargs)
        return None
    uri = os.fspath(file)
    fmt = _format_for(uri, file_format)
    check_keywords(fmt, "dump", kwargs, dump, uri)
    backend, resolved = _resolve(uri, backend_args, backend_key)
    try:
        if progress is None or progress is False:
            fmt.dump(obj, backend, resolved, mode=mode, **kwargs)
        else:
            with _reporting(progress, backend, uri, 0) as backend:
                fmt.dump(obj, backend, resolved, mode=mode, **kwargs)
    except TypeError as e:
        # a ckptio error keeps its class (and the built-ins it stands for), with the URI in front
        cls = type(e) if isinstance(e, UnsupportedValueError) else TypeError
        raise cls(f"cannot write {uri!r} as {fmt.name}: {e}") from e
    return None


def load(
    file: Any,
    file_format: str | None = None,
    *,
    backend_args: Mapping[str, Any] | None = None,
    backend_key: str | None = None,
    fast_backend: bool = True,
    cache: Any = None,
    progress: Any = None,
    **kwargs: Any,
) -> Any:
    """Deserialize from a URI (format by extension) or an open file. Extra keywords go to the format
    (``map_location``, ``weights_only``, ``mmap``, ``keys`` ...). ``cache=True`` (or a directory or
    mapping) reads through the node-local cache, see :mod:`ckptio.cache`. ``progress`` as
    for :func:`dump` (the total is the object's size). The data file of an incremental checkpoint
    (a recipe, :mod:`ckptio.incremental`) loads through the content store of its step's root."""
    if hasattr(file, "read"):
        if file_format is None:
            raise ValueError("load(file_object) needs file_format=...")
        return _format_for("", file_format).load_file(file, **kwargs)
    uri = os.fspath(file)
    fmt = _format_for(uri, file_format)
    check_keywords(fmt, "load", kwargs, load, uri)
    backend, resolved = _resolve(uri, backend_args, backend_key, cache=cache)
    try:
        return _load(fmt, backend, resolved, uri, progress, kwargs)
    except Exception:
        from .incremental.direct import file_reader

        reader = file_reader(backend, resolved)  # an incremental checkpoint's data file: a recipe
        if reader is None:
            raise
    try:
        return _load(fmt, reader, resolved, uri, progress, kwargs)
    finally:
        reader.close()


def _load(fmt: Format, backend: Backend, resolved: str, uri: str, progress: Any, kwargs: dict[str, Any]) -> Any:
    if progress is None or progress is False:
        return _load_from(fmt, backend, backend, resolved, kwargs)
    with _reporting(progress, backend, uri, backend.stat(resolved).size) as counted:
        return _load_from(fmt, backend, counted, resolved, kwargs)


def _load_from(fmt: Format, backend: Backend, counted: Backend, resolved: str, kwargs: dict[str, Any]) -> Any:
    """``fmt.load`` through ``counted`` (``backend``, or it wrapped to report progress); a node-local
    cache entry is loaded as the local file it is."""
    if backend.node_cache is not None and not fmt.reads_through_cache:  # a plain local file: mmap works
        with backend.local_file(resolved) as path:  # the verified entry, held for the load
            if path is not None:
                local = LocalBackend(part_size=backend.part_size, concurrency=backend.concurrency)
                return fmt.load(local, path, **kwargs)
    return fmt.load(counted, resolved, **kwargs)


@contextlib.contextmanager
def _reporting(progress: Any, backend: Backend, uri: str, total: int) -> Iterator[Backend]:
    """``backend`` wrapped to report bytes to ``progress`` (``None``: unwrapped). Bytes a format
    reads in place (a local file opened by path) are reported as done when the block ends."""
    if progress is None or progress is False:
        yield backend
        return
    from .progress import Tracker, bar
    from .wrappers.counting import CountingBackend

    owned = bar(total, desc=_uri.basename(uri)) if progress is True else None
    tracker = Tracker(total, owned if owned is not None else progress)
    try:
        yield CountingBackend(backend, tracker.add)
        if tracker.done < total:
            tracker.add(total - tracker.done)
    finally:
        if owned is not None:
            owned.close()


# ---------------------------------------------------------------------------------------------
# bytes and text


def put(
    obj: bytes | bytearray | memoryview,
    filepath: Any,
    *,
    backend_args: Mapping[str, Any] | None = None,
    backend_key: str | None = None,
    mode: WriteMode = "overwrite",
    durable: bool = True,
    progress: Any = None,
) -> None:
    """Write bytes atomically (parallel multipart for large objects on object stores)."""
    if not isinstance(obj, (bytes, bytearray, memoryview)):
        raise TypeError(f"put() writes bytes-like objects, got {type(obj).__name__} (use put_text for str)")
    backend, uri = _resolve(filepath, backend_args, backend_key)
    if progress in (None, False):
        backend.write(uri, obj, mode=mode, durable=durable)
        return
    with _reporting(progress, backend, os.fspath(filepath), memoryview(obj).nbytes) as counted:
        with counted.open_writer(uri, mode=mode, durable=durable) as w:
            w.write_borrowed(obj)


def get(
    filepath: Any,
    *,
    backend_args: Mapping[str, Any] | None = None,
    backend_key: str | None = None,
    progress: Any = None,
) -> bytes:
    """Read a whole object (parallel ranged reads for large objects on object stores)."""
    backend, uri = _resolve(filepath, backend_args, backend_key)
    if progress in (None, False):
        return backend.read(uri)
    with _reporting(progress, backend, os.fspath(filepath), backend.stat(uri).size) as counted:
        return counted.read(uri)


def readinto(
    filepath: Any,
    buf: Any,
    offset: int = 0,
    *,
    backend_args: Mapping[str, Any] | None = None,
    backend_key: str | None = None,
) -> int:
    """Fill a caller's buffer from ``offset``; returns the byte count (no intermediate copy)."""
    backend, uri = _resolve(filepath, backend_args, backend_key)
    return backend.readinto(uri, buf, offset)


def put_text(
    obj: str,
    filepath: Any,
    encoding: str = "utf-8",
    *,
    backend_args: Mapping[str, Any] | None = None,
    backend_key: str | None = None,
    mode: WriteMode = "overwrite",
) -> None:
    if not isinstance(obj, str):
        raise TypeError(f"put_text() writes str, got {type(obj).__name__}")
    put(obj.encode(encoding), filepath, backend_args=backend_args, backend_key=backend_key, mode=mode)


def get_text(
    filepath: Any,
    encoding: str = "utf-8",
    *,
    backend_args: Mapping[str, Any] | None = None,
    backend_key: str | None = None,
) -> str:
    return get(filepath, backend_args=backend_args, backend_key=backend_key).decode(encoding)


@contextlib.contextmanager
def open(
    filepath: Any,
    mode: str = "rb",
    *,
    backend_args: Mapping[str, Any] | None = None,  # noqa: A001
    backend_key: str | None = None,
) -> Iterator[IO[bytes]]:
    """A binary file on any backend: ``"rb"`` (seekable) or ``"wb"``/``"xb"`` (atomic on close)."""
    backend, uri = _resolve(filepath, backend_args, backend_key)
    if mode == "rb":
        f = backend.open_reader(uri)
        try:
            yield f
        finally:
            f.close()
    elif mode in ("wb", "xb"):
        with backend.open_writer(uri, mode="create" if mode == "xb" else "overwrite") as w:
            yield w  # type: ignore[misc]
    else:
        raise ValueError(f"mode must be 'rb', 'wb' or 'xb', got {mode!r}")


# ---------------------------------------------------------------------------------------------
# queries and listing


def exists(filepath: Any, *, backend_args: Mapping[str, Any] | None = None, backend_key: str | None = None) -> bool:
    backend, uri = _resolve(filepath, backend_args, backend_key)
    return backend.exists(uri)


def isfile(filepath: Any, *, backend_args: Mapping[str, Any] | None = None, backend_key: str | None = None) -> bool:
    backend, uri = _resolve(filepath, backend_args, backend_key)
    return backend.isfile(uri)


def isdir(filepath: Any, *, backend_args: Mapping[str, Any] | None = None, backend_key: str | None = None) -> bool:
    backend, uri = _resolve(filepath, backend_args, backend_key)
    return backend.isdir(uri)


def stat(filepath: Any, *, backend_args: Mapping[str, Any] | None = None, backend_key: str | None = None):
    """Size, mtime and version token (etag / generation / mtime+size)."""
    backend, uri = _resolve(filepath, backend_args, backend_key)
    return backend.stat(uri)


def ls(
    dir_path: Any,
    *,
    recursive: bool = False,
    backend_args: Mapping[str, Any] | None = None,
    backend_key: str | None = None,
) -> list[str]:
    """Full URIs of the entries under ``dir_path`` (sorted; directories only in one-level listings)."""
    backend, uri = _resolve(dir_path, backend_args, backend_key)
    return sorted(i.uri for i in backend.list(uri, recursive=recursive))


def list_dir_or_file(
    dir_path: Any,
    list_dir: bool = True,
    list_file: bool = True,
    suffix: str | tuple[str, ...] | None = None,
    recursive: bool = False,
    *,
    backend_args: Mapping[str, Any] | None = None,
    backend_key: str | None = None,
) -> Iterator[str]:
    """Paths relative to ``dir_path``, as mmengine/easy_io yield them. ``suffix`` filters files only.

    Arguments are checked at the call (as mmengine does); the listing runs as the result is iterated."""
    if list_dir and suffix is not None:
        raise TypeError("`suffix` should be None when `list_dir` is True")
    if suffix is not None and not isinstance(suffix, (str, tuple)):
        raise TypeError("`suffix` must be a string or tuple of strings")
    backend, uri = _resolve(dir_path, backend_args, backend_key)
    return _list_relative(backend, uri, list_dir, list_file, suffix, recursive)


def _list_relative(
    backend: Backend, uri: str, list_dir: bool, list_file: bool, suffix: str | tuple[str, ...] | None, recursive: bool
) -> Iterator[str]:
    root = uri.rstrip("/")
    dirs_seen: set[str] = set()
    for info in backend.list(uri, recursive=recursive):
        rel = info.uri[len(root) :].lstrip("/")
        if recursive and list_dir:
            parts = rel.split("/")[:-1]
            for i in range(1, len(parts) + 1):
                d = "/".join(parts[:i])
                if d not in dirs_seen:
                    dirs_seen.add(d)
                    yield d
        if info.is_dir:
            if list_dir and rel not in dirs_seen:
                dirs_seen.add(rel)
                yield rel
        elif list_file and (suffix is None or rel.endswith(suffix)):
            yield rel


def join_path(filepath: Any, *filepaths: str) -> str:
    """Join with ``/`` for URIs (``os.path.join`` for bare local paths)."""
    return _uri.join_path(os.fspath(filepath), *filepaths)


# ---------------------------------------------------------------------------------------------
# mutations


def remove(filepath: Any, *, backend_args: Mapping[str, Any] | None = None, backend_key: str | None = None) -> None:
    backend, uri = _resolve(filepath, backend_args, backend_key)
    backend.delete(uri)


def rmtree(dir_path: Any, *, backend_args: Mapping[str, Any] | None = None, backend_key: str | None = None) -> None:
    backend, uri = _resolve(dir_path, backend_args, backend_key)
    backend.rmtree(uri)


def copyfile(
    src: Any,
    dst: Any,
    *,
    backend_args: Mapping[str, Any] | None = None,
    backend_key: str | None = None,
    mode: WriteMode = "overwrite",
) -> Any:
    """Copy one object, across backends if needed. If ``dst`` is an existing directory, copy into it.

    Returns ``dst`` as given (a ``Path`` stays a ``Path``), or the joined ``str`` when copied into a
    directory, as mmengine does. Copying an object onto itself raises ``shutil.SameFileError``."""
    sb, s = _resolve(src, backend_args, backend_key)
    db, d = _resolve(dst, backend_args, backend_key)
    if db.isdir(d):
        d = _uri.join_path(d, _uri.basename(s))
        dst = join_path(os.fspath(dst), _uri.basename(s))
    if sb is db and _same_object(s, d):
        raise shutil.SameFileError(f"{os.fspath(src)!r} and {os.fspath(dst)!r} are the same file; copy to another name")
    _transfer.copy_object(sb, s, db, d, mode=mode)
    return dst


def _same_object(a: str, b: str) -> bool:
    """Whether two resolved URIs on one backend name the same object (local: the same inode)."""
    if a == b:
        return True
    if not _is_local(a):
        return False
    try:
        return os.path.samefile(local_path(a), local_path(b))
    except OSError:  # the destination does not exist yet
        return False


def _is_local(resolved: str) -> bool:
    """Whether a resolved URI is served by the local filesystem backend."""
    return _registry.backends.find(resolved).name == "local"


def copytree(
    src: Any,
    dst: Any,
    *,
    backend_args: Mapping[str, Any] | None = None,
    backend_key: str | None = None,
    mode: WriteMode = "overwrite",
    dirs_exist_ok: bool = False,
) -> Any:
    """Copy every object under ``src`` to the same relative path under ``dst``; returns ``dst`` as given.

    As mmengine (and ``shutil.copytree``), ``dst`` must not exist: ``FileExistsError`` otherwise.
    ``dirs_exist_ok=True`` copies into an existing ``dst``, replacing objects of the same name
    (``mode="create"`` refuses to replace them). Keys that would leave ``dst`` are refused before
    anything is copied (:mod:`ckptio.transfer`, the copy engine ``ckptio cp`` uses too)."""
    sb, s = _resolve(src, backend_args, backend_key)
    db, d = _resolve(dst, backend_args, backend_key)
    if not dirs_exist_ok and db.exists(d):
        raise AlreadyExistsError(
            os.fspath(dst), "copytree destination already exists (pass dirs_exist_ok=True to copy into it)"
        )
    infos = list(sb.list(s, recursive=True))
    if not infos and not sb.isdir(s):
        raise NotFoundError(os.fspath(src), "no such directory")
    if _is_local(d):  # as shutil: the destination directory exists afterwards, even for an empty tree
        _local.makedirs(local_path(d))  # durable, as the files written into it
    _transfer.copy_objects(sb, _transfer.tree_targets(infos, s, db, d, named=src), db, mode=mode)
    return dst


# mmengine's names for a copy from or to a local path: the same calls (a misspelt keyword names them)
copyfile_from_local = copyfile_to_local = copyfile
copytree_from_local = copytree_to_local = copytree


def copy_if_symlink_fails(
    src: Any, dst: Any, *, backend_args: Mapping[str, Any] | None = None, backend_key: str | None = None
) -> bool:
    """Make ``dst`` a symbolic link to ``src`` (True); where that fails, or either side is not on
    the local filesystem, copy the file or tree instead (False). As mmengine, the link holds
    ``src`` exactly as given, so a relative ``src`` is relative to ``dst``'s directory."""
    sb, s = _resolve(src, backend_args, backend_key)
    db, d = _resolve(dst, backend_args, backend_key)
    if _is_local(s) and _is_local(d):
        target = os.fspath(src) if not _uri.scheme_of(os.fspath(src)) else local_path(s)
        try:
            os.symlink(target, local_path(d))
            return True
        except (OSError, NotImplementedError):  # no symlinks here (privilege, filesystem, platform): copy
            pass
    if sb.isfile(s):
        copyfile(src, dst, backend_args=backend_args, backend_key=backend_key)
    else:
        copytree(src, dst, backend_args=backend_args, backend_key=backend_key)
    return False


@contextlib.contextmanager
def get_local_path(
    filepath: Any, *, backend_args: Mapping[str, Any] | None = None, backend_key: str | None = None
) -> Iterator[str]:
    """A local path for the object: the file itself when local, else a temporary copy removed on exit."""
    backend, uri = _resolve(filepath, backend_args, backend_key)
    with backend.get_local_path(uri) as p:
        yield p

"""A DCP checkpoint's ``.metadata``: reading it safely, and the crash-safe commit protocol built on it.

``.metadata`` is read with a restricted unpickler (:func:`loads_metadata`) that builds only the
classes DCP metadata contains; anything else is refused with a :class:`FormatError`, so a crafted
``.metadata`` cannot run code, nor change those classes (the unpickler gets stand-ins that refuse
``BUILD``: :mod:`ckptio.formats.pickle_guard`), nor make the unpickler allocate a memo far beyond
its size (:func:`ckptio.formats.pickle_scan.memo_problem`). Every data object name in it must be a
relative path inside the checkpoint (no empty, ``.`` or ``..`` segment, no leading ``/``, backslash, NUL or ``scheme://``,
not a ``.metadata``; on local disk it must not leave the directory through a symlink), else
reading, verifying or replacing it stops with a :class:`FormatError` naming the entry
(:func:`data_objects`).

Commit protocol (:class:`ckptio.dcp.StorageWriter` runs it; :func:`prepare_overwrite` and
:func:`commit` implement steps 1 and 3):

1. the coordinator, in ``prepare_global_plan`` (before any rank receives its plan, so before any
   data object is touched), picks the attempt id and refuses an existing ``.metadata`` unless
   ``overwrite=True``, in which case it reads it (to know the data objects it refers to) and
   deletes it;
2. every rank streams its data objects under this attempt's names; each is committed (and
   fsynced where local) before ``write_data`` returns; a rank that fails deletes the ones it wrote;
3. the coordinator writes ``.metadata`` with ``mode="create"``. If another save committed first,
   this save deletes its own data objects and raises :class:`AlreadyExistsError`. Either way, a
   save that removed a ``.metadata`` in step 1 then deletes the data objects that one referred to
   (nothing refers to them any more); a concurrent save's data objects are never touched.

A crash at any point leaves either the old complete checkpoint or a directory without
``.metadata``, which :func:`is_complete` reports as incomplete and the reader refuses. Data objects
of a crashed save stay until the directory is deleted: nothing tells them from a save still running.
:func:`discard` uncommits a checkpoint the same way (marker first, then its data objects).
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import warnings
from collections.abc import Iterable
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata

from .. import torch_internals as _ti
from .. import uri as _uri
from ..backends.base import Backend
from ..backends.local import ensure_inside
from ..context import resolve
from ..errors import AccessDeniedError, AlreadyExistsError, CkptioError, FormatError
from ..formats.pickle_guard import guard
from ..formats.pickle_scan import memo_problem
from .layout import METADATA_NAME, note


def is_complete(uri: str | os.PathLike, **backend_options: Any) -> bool:
    """Whether ``uri`` holds a committed DCP checkpoint (its ``.metadata`` exists)."""
    backend, root = resolve(uri, **backend_options)
    return backend.isfile(_uri.join_path(root, METADATA_NAME))


def discard(uri: str | os.PathLike, **backend_options: Any) -> None:
    """Uncommit the DCP checkpoint at ``uri`` (delete its ``.metadata``), then delete the data objects it referred to.

    Nothing else under ``uri`` is touched: data objects of another save of ``uri``, maybe still being
    written, stay. Without a ``.metadata`` this does nothing.
    """
    backend, root = resolve(uri, **backend_options)
    failed = delete_objects(backend, uncommit(backend, root, _uri.join_path(root, METADATA_NAME)))
    if failed:
        raise CkptioError(f"uncommitted {os.fspath(uri)!r} but could not delete its data objects: {'; '.join(failed)}")


def delete_objects(backend: Backend, uris: Iterable[str]) -> list[str]:
    """Delete each object (one already gone is fine); returns "URI (error)" for each that could not be deleted."""
    failed = []
    for u in uris:
        try:
            backend.delete(u)
        except FileNotFoundError:
            pass
        except Exception as e:  # noqa: BLE001 - reported by every caller
            failed.append(f"{u} ({type(e).__name__}: {e})")
    return failed


# What a DCP ``.metadata`` legitimately contains (torch's FileSystemWriter/FsspecWriter and ckptio's
# writer): the metadata dataclasses, torch.Size, dtypes, layouts (pickled as
# ``torch.serialization._get_layout(name)``), the path torch keeps as checkpoint_id, and containers.
# ckptio's per-item ``ckptio`` attribute holds only plain dicts, lists, ints and strings.
_METADATA_CLASSES: dict[str, frozenset[str]] = {
    "torch.distributed.checkpoint.metadata": frozenset(
        {
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorProperties",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            _ti.SYMBOLS["MEM_FORMAT_ENCODING"][1],
        }
    ),
    _ti.SYMBOLS["StorageInfo"][0]: frozenset({_ti.SYMBOLS["StorageInfo"][1]}),
    "torch": frozenset({"Size"}),
    _ti.LAYOUT_GLOBAL[0]: frozenset({_ti.LAYOUT_GLOBAL[1]}),
    "pathlib": frozenset({"Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath"}),
    "collections": frozenset({"OrderedDict"}),
    "builtins": frozenset({"set", "frozenset"}),
}


_GUARDED: dict[tuple[str, str], Any] = {}  # (module, name) -> what find_class returns (pickle_guard.guard)


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file: Any, uri: str) -> None:
        super().__init__(file)
        self._uri = uri

    def find_class(self, module: str, name: str) -> Any:
        done = _GUARDED.get((module, name))
        if done is not None:
            return done
        if name in _METADATA_CLASSES.get(module, ()):
            obj = super().find_class(module, name)
        elif module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            obj = getattr(torch, name)  # dtypes pickle as the global torch.<name>
        else:
            obj = None
        if obj is not None:
            # a stand-in that BUILD cannot change: never the class or function itself
            return _GUARDED.setdefault((module, name), guard(obj, f"{module}.{name}"))
        raise FormatError(
            f"{self._uri}: DCP metadata refers to {module}.{name}, which DCP metadata never "
            f"contains; refusing to unpickle it (the file may be crafted to run code)"
        )

    def persistent_load(self, pid: Any) -> Any:
        raise FormatError(f"{self._uri}: DCP metadata holds a persistent reference; refusing to unpickle it")


def loads_metadata(data: bytes | bytearray | memoryview, uri: str = METADATA_NAME) -> Metadata:
    """Unpickle a DCP ``.metadata`` (``uri`` names it in errors), building only DCP metadata classes.

    Raises :class:`FormatError` for any other class (nothing is executed), for a memo index that
    would make the unpickler allocate far beyond ``data`` and for malformed data.
    """
    why = memo_problem(data)
    if why is not None:
        raise FormatError(f"{uri}: DCP metadata {why}; refusing to unpickle it (the file is corrupt or crafted)")
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data), uri).load()
    except FormatError as e:
        if str(e).startswith(uri):
            raise
        raise FormatError(f"{uri}: {e}") from None  # a guard's refusal (pickle_guard) names no file
    except Exception as e:  # UnpicklingError, EOFError, a bad enum value, ...
        raise FormatError(f"{uri}: not readable DCP metadata ({type(e).__name__}: {e})") from e
    if not isinstance(metadata, Metadata):
        raise FormatError(f"{uri}: not DCP metadata (holds a {type(metadata).__name__})")
    why = _missing_field(metadata)
    if why is not None:
        raise FormatError(f"{uri}: not readable DCP metadata ({why}; the file is corrupt or crafted)")
    return metadata


def _missing_field(root: Any) -> str | None:
    """The first dataclass instance reachable from ``root`` that lacks a field without a default (a crafted
    pickle can build one without its state), named; None if there is none. Iterative: no recursion limit."""
    seen: set[int] = set()
    todo = [root]
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            for f in dataclasses.fields(obj):
                if not hasattr(obj, f.name):
                    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                        return f"a {type(obj).__name__} without its {f.name!r}"
                    continue
                todo.append(getattr(obj, f.name))
        elif isinstance(obj, dict):
            todo.extend(obj.values())
        elif isinstance(obj, (list, tuple)):
            todo.extend(obj)
    return None


def _name_problem(name: Any) -> str | None:
    """Why ``name`` (a data object name from ``.metadata``) is not a plain relative path; None when it is one."""
    if not isinstance(name, str):
        return f"is a {type(name).__name__}, not a relative path"
    if not name:
        return "is empty"
    for char, what in (("\x00", "a NUL byte"), ("\\", "a backslash")):
        if char in name:
            return f"contains {what}"
    if _uri.scheme_of(name):
        return "is a URI, not a relative path"
    if name.startswith("/"):
        return "is an absolute path"
    segments = name.split("/")
    if any(seg in ("", ".", "..") for seg in segments):
        return "has an empty, '.' or '..' path segment"
    if segments[-1].lower().endswith(METADATA_NAME):
        return "names a metadata file, not a data object"
    return None


def data_objects(metadata: Metadata, backend: Backend, root: str, meta_uri: str) -> dict[str, str]:
    """Each data object name ``metadata`` refers to -> its URI inside the checkpoint at ``root``.

    A name that is not a plain relative path, or that leaves ``root`` through a symlink (local
    disk), raises :class:`FormatError` naming ``meta_uri`` and the entry.
    """
    storage = metadata.storage_data if metadata.storage_data is not None else {}
    if not isinstance(storage, dict):
        raise FormatError(f"{meta_uri}: storage_data is a {type(storage).__name__}, not a dict: not DCP metadata")
    out: dict[str, str] = {}
    for index, sinfo in storage.items():
        name: Any = getattr(sinfo, "relative_path", None)  # untrusted: checked by _name_problem
        if isinstance(name, str) and name in out:
            continue
        why = _name_problem(name)
        if why is None:
            try:
                ensure_inside(backend, root, _uri.join_path(root, name))
            except AccessDeniedError:
                why = "leaves the checkpoint through a symlink"
        if why is not None:
            raise FormatError(
                f"{meta_uri}: the storage entry of item {getattr(index, 'fqn', index)!r} names the data "
                f"object {name!r}, which {why}; refusing to use it (only names inside the checkpoint "
                f"are followed: the metadata is corrupt or crafted)"
            )
        out[name] = _uri.join_path(root, name)
    return out


def uncommit(backend: Backend, root: str, meta: str) -> list[str]:
    """Delete the ``.metadata`` at ``meta``; returns the data objects it referred to.

    None when another save removed it first, or when it is unreadable or names objects outside the
    checkpoint (only the marker goes then: its names are not trusted)."""
    try:
        objects = list(data_objects(loads_metadata(backend.read(meta), meta), backend, root, meta).values())
    except FileNotFoundError:
        return []
    except FormatError:
        objects = []
    try:
        backend.delete(meta)
    except FileNotFoundError:  # a concurrent overwrite deleted it first: its data objects are that save's to delete
        return []
    return objects


def prepare_overwrite(backend: Backend, root: str, meta: str, overwrite: bool, uri: str) -> list[str]:
    """Step 1: refuse the committed ``.metadata`` at ``meta`` unless ``overwrite``, else uncommit it.

    Returns the data objects of the checkpoint it replaces, which :func:`commit` deletes once the
    attempt to commit is over.
    """
    if not backend.isfile(meta):
        return []
    if not overwrite:
        raise AlreadyExistsError(  # torch's words ("Checkpoint already exists"), which its tests and users match
            meta, f"Checkpoint already exists at {uri!r} and overwrite=False; pass overwrite=True to replace it"
        )
    return uncommit(backend, root, meta)


def commit(backend: Backend, meta: str, metadata: Metadata, own: set[str], replaced: list[str], uri: str) -> None:
    """Step 3: write ``metadata`` to ``meta`` create-only, then delete the ``replaced`` data objects.

    ``own``: this save's data objects, deleted (with ``replaced``) when another save committed
    first, which raises :class:`AlreadyExistsError`.
    """
    data = pickle.dumps(metadata, protocol=pickle.HIGHEST_PROTOCOL)
    replaced = [u for u in replaced if u not in own]  # nothing refers to them any more
    try:
        backend.write(meta, data, mode="create", durable=True)  # the commit
    except FileExistsError as e:
        err = AlreadyExistsError(
            meta, f"another save committed {uri!r} while this one was writing; this save is discarded"
        )
        failed = delete_objects(backend, [*sorted(own), *replaced])
        if failed:
            note(err, f"ckptio.dcp: could not delete data objects nothing refers to: {'; '.join(failed)}")
        try:
            raise err from e
        finally:  # the error's traceback holds this frame: no reference cycle through it
            del err
    failed = delete_objects(backend, replaced)
    if failed:
        warnings.warn(
            f"ckptio.dcp: saved {uri!r}, but could not delete data objects of the checkpoint it "
            f"replaced: {'; '.join(failed)}",
            stacklevel=3,
        )

"""The ``ckptio`` command: ls, cp, rm, info, verify, cache, config, bench.

Every command takes ``--json`` (one JSON document on stdout), ``--quiet`` (no progress, no
summary lines) and ``-v`` (a traceback on errors). Errors go to stderr as one line and a hint.

Exit status:

====  ==========================================================================
0     success
1     failure: corrupt or truncated data (verify, info), an incomplete checkpoint,
      a transfer error, anything unexpected
2     usage: bad arguments, invalid settings, unknown scheme or format
3     not found: the object, directory or bucket does not exist
4     access denied or missing/rejected credentials
5     a needed optional package is not installed (the message says which)
130   interrupted (Ctrl-C)
====  ==========================================================================

:func:`copy` (used by ``ckptio cp``) is also a library call: recursive, parallel across files,
resumable (files already at the destination with the same size and a newer mtime are skipped;
every write is atomic, so an interrupted copy never leaves a partial file), with a
``progress(bytes_done, bytes_total)`` callback.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import contextlib
import dataclasses
import io
import json
import math
import os
import pickle
import sys
import time
import traceback
import zipfile
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from . import __version__
from . import config as _config
from . import uri as _uri
from .backends.base import Backend, ObjectInfo
from .backends.local import ensure_inside
from .context import default_context, resolve
from .errors import (
    FormatError,
    IncompleteCheckpointError,
    IntegrityError,
    InvalidURIError,
    MissingDependencyError,
    NotFoundError,
    SettingsError,
    UnknownFormatError,
    UnknownSchemeError,
)
from .progress import Bar, CountingWriter, Tracker, human_bytes

EXIT_OK, EXIT_FAILURE, EXIT_USAGE, EXIT_NOT_FOUND, EXIT_DENIED, EXIT_MISSING_DEP, EXIT_INTERRUPTED = (
    0,
    1,
    2,
    3,
    4,
    5,
    130,
)

TORCH_EXTS = (".pt", ".pth", ".ckpt", ".pth.tar", ".bin.pt")
DCP_METADATA = ".metadata"


class UsageError(Exception):
    """Bad command-line use (exit status 2)."""


# ---------------------------------------------------------------------------------------------
# helpers


def _kind(backend: Backend, uri: str) -> str:
    """``"file"`` or ``"dir"``; NotFoundError when neither exists."""
    try:
        return "dir" if backend.stat(uri).is_dir else "file"
    except FileNotFoundError:
        if backend.isdir(uri):
            return "dir"
        raise NotFoundError(uri, "no such object or directory") from None


def _rel(root: str, child: str) -> str:
    rel = child[len(root.rstrip("/")) :].lstrip("/")
    if not rel or rel.startswith("../") or "/../" in f"/{rel}/" or os.path.isabs(rel):
        raise SettingsError(f"refusing to copy {child!r}: its key escapes {root!r}")
    return rel


def _jsonable(obj: Any) -> Any:
    """Plain JSON data from inspection results (dataclasses, dtypes, sizes, tuples...)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [_jsonable(v) for v in obj]
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else repr(obj)
    if isinstance(obj, bytes):
        return f"<{len(obj)} bytes>"
    name = type(obj).__module__ + "." + type(obj).__name__
    if name in ("torch.dtype", "torch.device"):
        return str(obj).removeprefix("torch.")
    if name == "torch.Size":
        return list(obj)
    return repr(obj)


def _dtype_size(dtype: str) -> int:
    import torch

    return torch.empty((), dtype=getattr(torch, dtype.removeprefix("torch."))).element_size()


# ---------------------------------------------------------------------------------------------
# copy (library call behind `ckptio cp`)


@dataclasses.dataclass
class CopyResult:
    copied: list[str]
    skipped: list[str]
    bytes_copied: int
    seconds: float


def _up_to_date(src: ObjectInfo, dst_backend: Backend, dst: str) -> bool:
    try:
        d = dst_backend.stat(dst)
    except FileNotFoundError:
        return False
    if d.is_dir or d.size != src.size:
        return False
    if src.version is not None and src.version == d.version:
        return True
    # object stores report whole seconds: a copy made in the same second as the source's change counts as newer
    return src.mtime is None or d.mtime is None or d.mtime >= math.floor(src.mtime)


def _copy_one(sb: Backend, src: ObjectInfo, db: Backend, dst: str, add: Callable[[int], None], chunk_max: int) -> None:
    if sb is db:
        sb.copy(src.uri, dst)
        add(src.size)
        return
    buf = bytearray(min(max(src.size, 1), chunk_max))
    mv, pos = memoryview(buf), 0
    with db.open_writer(dst) as w:
        out = CountingWriter(w, add)
        while pos < src.size:
            n = sb.readinto(src.uri, mv[: min(len(mv), src.size - pos)], pos)
            if n <= 0:
                raise NotFoundError(src.uri, f"object shrank while copying at byte {pos} of {src.size}")
            out.write(mv[:n])
            pos += n


def copy(
    src: str,
    dst: str,
    *,
    recursive: bool = False,
    jobs: int = 4,
    skip_existing: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> CopyResult:
    """Copy an object, or (``recursive=True``) every object under a prefix, from any backend to any backend.

    A ``dst`` ending in ``/`` or naming an existing directory receives the source's basename.
    ``skip_existing`` (``cp --resume``) continues an interrupted copy: destination objects with the
    source's size and an equal version, or an mtime at least as new, are left alone. It is opt-in
    because a same-size, newer but different destination would be skipped too (checkpoints of one
    model all have the same size). ``jobs`` files move in parallel.
    """
    t0 = time.perf_counter()
    sb, s = resolve(src)
    db, d = resolve(dst)
    pairs: list[tuple[ObjectInfo, str]] = []
    if _kind(sb, s) == "file":
        info = sb.stat(s)
        if dst.endswith("/") or db.isdir(d):
            d = _uri.join_path(d, _uri.basename(s))
        pairs.append((info, d))
    else:
        if not recursive:
            raise UsageError(f"{src} is a directory; pass -r to copy it recursively")
        for info in sb.list(s, recursive=True):
            if not info.is_dir:
                pairs.append((info, _uri.join_path(d, *_rel(s, info.uri).split("/"))))
    todo, skipped = [], []
    for info, target in pairs:
        ensure_inside(db, d, target)
        if skip_existing and _up_to_date(info, db, target):
            skipped.append(target)
        else:
            todo.append((info, target))
    tracker = Tracker(sum(i.size for i, _ in todo), progress)
    jobs = max(1, int(jobs))
    chunk_max = max(sb.part_size, sb.part_size * sb.concurrency // jobs)
    if jobs == 1 or len(todo) <= 1:
        for info, target in todo:
            _copy_one(sb, info, db, target, tracker.add, chunk_max)
    else:
        with cf.ThreadPoolExecutor(min(jobs, len(todo)), thread_name_prefix="ckptio-cp") as pool:
            futs = [pool.submit(_copy_one, sb, i, db, t, tracker.add, chunk_max) for i, t in todo]
            try:
                for f in cf.as_completed(futs):
                    f.result()
            except BaseException:
                for f in futs:
                    f.cancel()
                raise
    return CopyResult([t for _, t in todo], skipped, tracker.done, time.perf_counter() - t0)


# ---------------------------------------------------------------------------------------------
# torch .pt inspection without loading tensor data: unpickle data.pkl with stand-ins


@dataclasses.dataclass
class TensorInfo:
    dtype: str
    shape: list[int]
    nbytes: int
    storage: str
    parameter: bool = False


class _Opaque:
    """Stand-in for any global the inspector does not allow: records, never executes."""

    _name = "?"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __repr__(self) -> str:
        return f"<{self._name}>"


def _storage_dtype(name: str) -> str:
    import torch

    if name == "UntypedStorage":
        return "uint8"
    try:
        from torch.storage import _get_dtype_from_pickle_storage_type

        return str(_get_dtype_from_pickle_storage_type(name)).removeprefix("torch.")
    except (ImportError, KeyError, AttributeError):
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return str(getattr(torch, name).dtype).removeprefix("torch.")


class _StorageType:
    def __init__(self, dtype: str) -> None:
        self.dtype = dtype


def _latin1_encode(text: str, encoding: str = "latin1") -> bytes:
    if encoding not in ("latin1", "latin-1") or not isinstance(text, str):
        raise FormatError(f"pickled _codecs.encode with encoding {encoding!r}: only latin1 (torch's bytes) is read")
    return text.encode("latin1")


class _TorchInspector(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        import collections

        import torch

        if module == "collections" and name == "OrderedDict":
            return collections.OrderedDict
        if module == "builtins" and name in (
            "set",
            "frozenset",
            "complex",
            "slice",
            "bytearray",
            "tuple",
            "list",
            "dict",
        ):
            return getattr(__import__("builtins"), name)
        if module == "_codecs" and name == "encode":
            return _latin1_encode  # how torch pickles bytes; no other codec
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return self._tensor
        if module == "torch._utils" and name == "_rebuild_parameter":
            return lambda data, *a: dataclasses.replace(data, parameter=True) if isinstance(data, TensorInfo) else data
        if module == "torch" and name.endswith("Storage"):
            return _StorageType(_storage_dtype(name))
        if module == "torch" and name == "Size":
            return tuple
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module == "torch" and name == "device":
            return str
        return type(name, (_Opaque,), {"_name": f"{module}.{name}"})

    @staticmethod
    def _tensor(storage: Any, offset: int, size: Sequence[int], stride: Sequence[int], *args: Any) -> Any:
        if not isinstance(storage, dict):
            return _Opaque(storage)
        numel = math.prod(size)
        return TensorInfo(storage["dtype"], list(size), numel * _dtype_size(storage["dtype"]), storage["key"])

    def persistent_load(self, pid: Any) -> Any:
        if isinstance(pid, tuple) and len(pid) >= 5 and pid[0] == "storage":
            st, key, numel = pid[1], str(pid[2]), int(pid[4])
            dtype = st.dtype if isinstance(st, _StorageType) else "uint8"
            return {"dtype": dtype, "key": key, "numel": numel}
        return None


def _flatten(obj: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _flatten(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(obj, (list, tuple)) and any(isinstance(v, (dict, list, tuple, TensorInfo)) for v in obj):
        for i, v in enumerate(obj):
            yield from _flatten(v, f"{prefix}.{i}" if prefix else str(i))
    else:
        yield prefix, obj


def _open_zip(backend: Backend, uri: str) -> zipfile.ZipFile:
    f = backend.open_reader(uri)
    try:
        return zipfile.ZipFile(f)
    except zipfile.BadZipFile:
        f.close()
        raise FormatError(f"{uri}: not a zip-format torch checkpoint (legacy torch.save format or corrupt)") from None


def inspect_torch(backend: Backend, uri: str) -> dict[str, Any]:
    with _open_zip(backend, uri) as z:
        pkl = next((n for n in z.namelist() if n.endswith("/data.pkl") or n == "data.pkl"), None)
        if pkl is None:
            raise FormatError(f"{uri}: zip archive without data.pkl: not a torch checkpoint")
        try:
            tree = _TorchInspector(io.BytesIO(z.read(pkl))).load()
        except (pickle.UnpicklingError, EOFError, ValueError, TypeError, zipfile.BadZipFile) as e:
            raise IntegrityError(f"{uri}: cannot decode {pkl}: {e}") from None
    tensors: list[dict[str, Any]] = []
    storages: dict[str, int] = {}  # storage key -> the most bytes a tensor views of it
    for key, v in _flatten(tree):
        if isinstance(v, TensorInfo):
            tensors.append({"key": key, "dtype": v.dtype, "shape": v.shape, "nbytes": v.nbytes})
            storages[v.storage] = max(storages.get(v.storage, 0), v.nbytes)
    others = {k: _jsonable(v) for k, v in _flatten(tree) if not isinstance(v, TensorInfo)}
    return {"format": "torch", "tensors": tensors, "tensor_bytes": sum(storages.values()), "values": others}


def verify_torch(backend: Backend, uri: str) -> dict[str, Any]:
    with _open_zip(backend, uri) as z:
        bad = z.testzip()  # reads every member and checks its CRC32
        if bad is not None:
            raise IntegrityError(f"{uri}: CRC mismatch in archive member {bad}: the checkpoint is corrupt")
        members = len(z.namelist())
    inspect_torch(backend, uri)
    return {"checked": members, "unchecked": 0, "what": "zip CRC32 of every member"}


# ---------------------------------------------------------------------------------------------
# formats that inspect and verify their own files (safetensors)


def _format(name: str) -> Any:
    from . import registry

    entry = registry.formats.by_name(name)
    if entry is None:
        raise UnknownFormatError(
            f"no format named {name!r} is registered (registered: {', '.join(registry.formats.names())})"
        )
    return entry.instance()


def inspect_safetensors(backend: Backend, uri: str) -> dict[str, Any]:
    insp = _format("safetensors").inspect(backend, uri)
    tensors = [
        {"key": t.key, "dtype": t.torch_dtype or t.dtype, "shape": list(t.shape), "nbytes": t.nbytes}
        for t in insp.tensors
    ]
    out = {
        "format": "safetensors",
        "tensors": tensors,
        "tensor_bytes": sum(t["nbytes"] for t in tensors),
        "values": insp.metadata,
        "size": insp.size,
    }
    if insp.files != [uri]:
        out["shards"] = len(insp.files)
    return out


# ---------------------------------------------------------------------------------------------
# DCP directories


def _dcp_metadata(uri: str) -> Any:
    from . import dcp

    return dcp.StorageReader(uri).read_metadata()


def inspect_dcp(uri: str) -> dict[str, Any]:
    meta = _dcp_metadata(uri)
    tensors, values = [], {}
    for fqn, md in meta.state_dict_metadata.items():
        props = getattr(md, "properties", None)
        if props is not None and hasattr(md, "size"):
            dtype = str(props.dtype).removeprefix("torch.")
            shape = list(md.size)
            tensors.append(
                {
                    "key": fqn,
                    "dtype": dtype,
                    "shape": shape,
                    "nbytes": math.prod(shape) * _dtype_size(dtype),
                    "chunks": len(getattr(md, "chunks", [])),
                }
            )
        else:
            values[fqn] = type(md).__name__
    files: dict[str, int] = {}
    for sinfo in (meta.storage_data or {}).values():
        files[sinfo.relative_path] = max(files.get(sinfo.relative_path, 0), sinfo.offset + sinfo.length)
    return {
        "format": "dcp",
        "tensors": tensors,
        "tensor_bytes": sum(t["nbytes"] for t in tensors),
        "values": values,
        "data_files": files,
        "version": getattr(meta, "version", None),
    }


def verify_dcp(uri: str) -> dict[str, Any]:
    from . import dcp

    if hasattr(dcp, "verify"):
        return _jsonable(dcp.verify(uri)) or {}
    import xxhash

    from .dcp_checks import entry_problem

    backend, root = resolve(uri)
    meta = _dcp_metadata(uri)
    sizes: dict[str, int] = {}
    checked = unchecked = 0
    default_block = getattr(dcp, "CHECKSUM_BLOCK", 8 << 20)
    for idx, sinfo in (meta.storage_data or {}).items():
        obj = _uri.join_path(root, sinfo.relative_path)
        info = getattr(sinfo, "ckptio", None)
        why = entry_problem(sinfo, isinstance(info, dict) and "data" in info, default_block)
        if why is not None:  # checked before anything is sized from it
            raise FormatError(f"{obj}: item {idx.fqn!r} {why}: the checkpoint's .metadata is corrupt or crafted")
        if obj not in sizes:
            sizes[obj] = backend.stat(obj).size
        if sinfo.offset + sinfo.length > sizes[obj]:
            raise IntegrityError(
                f"{obj}: truncated: item {idx.fqn!r} ends at byte {sinfo.offset + sinfo.length}, "
                f"the object has {sizes[obj]}"
            )
        info = info if isinstance(info, dict) else {}
        hashes = info.get("xxh3")
        if not hashes:  # written by torch's own writers: each item is a torch.save zip with CRC32s
            if getattr(sinfo, "transform_descriptors", None):
                unchecked += 1
                continue
            item = backend.read_range(obj, sinfo.offset, sinfo.offset + sinfo.length)
            try:
                bad = zipfile.ZipFile(io.BytesIO(item)).testzip()
            except zipfile.BadZipFile:
                raise IntegrityError(
                    f"{obj}: item {idx.fqn!r} is not a readable archive: the checkpoint is corrupt"
                ) from None
            if bad is not None:
                raise IntegrityError(f"{obj}: CRC mismatch in item {idx.fqn!r} ({bad}): the checkpoint is corrupt")
            checked += 1
            continue
        block = info.get("block", default_block)
        start, n = (sinfo.offset + info["data"], info["nbytes"]) if "data" in info else (sinfo.offset, sinfo.length)
        buf = bytearray(min(max(block, 1), max(n, 1)))
        for i, want in enumerate(hashes):
            a = i * block
            k = min(block, n - a)
            mv = memoryview(buf)[: max(k, 0)]
            if k > 0 and backend.readinto(obj, mv, start + a) != k:
                raise IntegrityError(f"{obj}: short read in item {idx.fqn!r} at byte {start + a}")
            if xxhash.xxh3_64_intdigest(mv) != want:
                raise IntegrityError(
                    f"checksum mismatch in {obj}, item {idx.fqn!r}, bytes [{a}, {a + k}) of its "
                    f"data: the checkpoint is corrupt"
                )
        checked += 1
    return {
        "checked": checked,
        "unchecked": unchecked,
        "what": "xxh3-64 per block (ckptio items), zip CRC32 (items written by torch)",
    }


# ---------------------------------------------------------------------------------------------
# dispatch by what the URI holds


def _detect(backend: Backend, uri: str) -> tuple[str, str]:
    """(kind, uri) with kind in dcp, fastpickle, torch, safetensors, other."""
    if _uri.basename(uri) == DCP_METADATA:
        return "dcp", _uri.parent(uri)
    if _kind(backend, uri) == "dir":
        if backend.isfile(_uri.join_path(uri, DCP_METADATA)):
            return "dcp", uri
        if any(i.uri.endswith(".distcp") for i in backend.list(uri)):
            raise IncompleteCheckpointError(
                f"checkpoint {uri!r} is incomplete: it has no {DCP_METADATA} (the save "
                f"was interrupted or is still running)"
            )
        raise FormatError(f"{uri} is a directory but not a DCP checkpoint (no {DCP_METADATA})")
    name = _uri.basename(uri).lower()
    if name.endswith(".fpk"):
        return "fastpickle", uri
    if name.endswith(TORCH_EXTS):
        return "torch", uri
    with contextlib.suppress(UnknownFormatError):
        from . import registry

        if registry.formats.find(uri).name == "safetensors":  # a file or a shard index
            return "safetensors", uri
    return "other", uri


def _fastpickle() -> Any:
    try:
        from . import fastpickle
    except ImportError as e:
        raise MissingDependencyError(f"the fastpickle format is not available in this ckptio ({e})") from None
    return fastpickle


def inspect_fastpickle(uri: str) -> dict[str, Any]:
    insp = _fastpickle().inspect(uri)
    tensors, storages = [], {}
    for t in getattr(insp, "tensors", []):
        try:
            n = math.prod(t.shape) * _dtype_size(str(t.dtype))
        except (AttributeError, TypeError):
            n = t.nbytes
        tensors.append({"key": t.path, "dtype": str(t.dtype), "shape": list(t.shape), "nbytes": n})
        storages[t.storage] = t.nbytes
    tensor_type = type(insp.tensors[0]) if getattr(insp, "tensors", None) else ()
    values = {
        k: _jsonable(v) for k, v in _flatten(_jsonable_tree(insp.tree, tensor_type)) if not isinstance(v, TensorInfo)
    }
    return {
        "format": "fastpickle",
        "tensors": tensors,
        "tensor_bytes": sum(storages.values()),
        "values": values,
        "version": getattr(insp, "version", None),
        "has_pickle": getattr(insp, "has_pickle", None),
    }


def _jsonable_tree(obj: Any, tensor_type: Any) -> Any:
    """fastpickle's tree with its tensor placeholders turned into this module's TensorInfo (for _flatten)."""
    if tensor_type and isinstance(obj, tensor_type):
        return TensorInfo(str(obj.dtype), list(obj.shape), obj.nbytes, str(obj.storage))
    if isinstance(obj, dict):
        return {k: _jsonable_tree(v, tensor_type) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable_tree(v, tensor_type) for v in obj]
    return obj


def info(uri: str) -> dict[str, Any]:
    """What ``ckptio info`` prints: format, tensor table (key, dtype, shape, nbytes), other values."""
    backend, resolved = resolve(uri)
    kind, target = _detect(backend, resolved)
    if kind == "dcp":
        out = inspect_dcp(target)
    elif kind == "fastpickle":
        out = inspect_fastpickle(uri)
    elif kind == "torch":
        out = inspect_torch(backend, resolved)
    elif kind == "safetensors":
        out = inspect_safetensors(backend, resolved)
    else:
        st = backend.stat(resolved)
        fmt = None
        with contextlib.suppress(UnknownFormatError):
            from . import registry

            fmt = registry.formats.find(resolved).name
        out = {"format": fmt, "tensors": [], "values": {}, "version": st.version, "size": st.size}
    out["uri"] = uri
    if kind == "dcp":
        out["size"] = sum(out.get("data_files", {}).values())
    elif "size" not in out:
        out["size"] = backend.stat(resolved).size
    return out


def verify(uri: str) -> dict[str, Any]:
    """Check every checksum the format stores; raises IntegrityError (exit 1) on corruption."""
    backend, resolved = resolve(uri)
    kind, target = _detect(backend, resolved)
    if kind == "dcp":
        out = verify_dcp(target)
    elif kind == "fastpickle":
        fp = _fastpickle()
        if hasattr(fp, "verify"):
            res = fp.verify(uri)
            out = _jsonable(res) if isinstance(res, dict) else {"result": _jsonable(res)}
        else:
            fp.load(uri, verify=True)
            out = {"what": "xxh3 of every tensor payload and of the metadata (full load)"}
    elif kind == "torch":
        out = verify_torch(backend, resolved)
    elif kind == "safetensors":
        out = _format("safetensors").verify(backend, resolved)
    else:
        raise FormatError(
            f"{uri}: no checksums to verify for this format (supported: .fpk, DCP directories, "
            f"{', '.join(TORCH_EXTS)}, .safetensors)"
        )
    return {"uri": uri, "format": kind, "ok": True, **out}


# ---------------------------------------------------------------------------------------------
# output


class Out:
    def __init__(self, args: argparse.Namespace) -> None:
        self.json = bool(getattr(args, "json", False))
        self.quiet = bool(getattr(args, "quiet", False))
        self.verbose = bool(getattr(args, "verbose", False))

    def emit(self, data: Any, text: Callable[[], str] | str | None = None) -> None:
        if self.json:
            print(json.dumps(_jsonable(data), indent=2))
        elif text is not None:
            s = text() if callable(text) else text
            if s:
                print(s)

    def note(self, msg: str) -> None:
        if not self.quiet and not self.json:
            print(msg, file=sys.stderr)

    def bar(self, total: int, desc: str) -> Bar:
        return Bar(total, desc, enabled=False if self.quiet else None)


def _tensor_table(tensors: list[dict[str, Any]], limit: int | None = None) -> str:
    if not tensors:
        return "  (no tensors)"
    shown = tensors if limit is None else tensors[:limit]
    w = min(60, max(len(str(t.get("key", ""))) for t in shown))
    lines = [f"  {'key':<{w}}  {'dtype':<10} {'shape':<20} {'size':>10}"]
    for t in shown:
        shape = "x".join(str(s) for s in t.get("shape") or []) or "()"
        lines.append(
            f"  {str(t.get('key', '')):<{w}}  {str(t.get('dtype', '')):<10} {shape:<20} "
            f"{human_bytes(int(t.get('nbytes', 0) or 0)):>10}"
        )
    if limit is not None and len(tensors) > limit:
        lines.append(f"  ... {len(tensors) - limit} more (use --all or --json)")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# commands


def _as_given(given: str, resolved: str, child: str) -> str:
    """``child`` (a resolved URI under ``resolved``) spelled the way the user wrote ``given`` (alias, mapping)."""
    if given == resolved:
        return child
    if child.rstrip("/") == resolved.rstrip("/"):
        return given
    return _uri.join_path(given, child[len(resolved.rstrip("/")) :].lstrip("/"))


def cmd_ls(args: argparse.Namespace, out: Out) -> int:
    backend, uri = resolve(args.uri)
    if _kind(backend, uri) == "file":
        entries = [backend.stat(uri)]
    else:
        entries = sorted(backend.list(uri, recursive=args.recursive), key=lambda i: i.uri)
    rows: list[dict[str, Any]] = [
        {
            "uri": _as_given(args.uri, uri, i.uri),
            "size": i.size,
            "mtime": i.mtime,
            "version": i.version,
            "is_dir": i.is_dir,
        }
        for i in entries
    ]

    def text() -> str:
        if not args.long:
            return "\n".join(r["uri"] + ("/" if r["is_dir"] else "") for r in rows)
        lines = []
        for r in rows:
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r["mtime"])) if r["mtime"] else "-"
            lines.append(f"{'DIR' if r['is_dir'] else human_bytes(r['size']):>10}  {when:<19}  {r['uri']}")
        total = sum(r["size"] for r in rows)
        lines.append(f"{len(rows)} entries, {human_bytes(total)}")
        return "\n".join(lines)

    out.emit(rows, text)
    return EXIT_OK


def cmd_cp(args: argparse.Namespace, out: Out) -> int:
    with out.bar(0, "cp") as bar:
        res = copy(
            args.src, args.dst, recursive=args.recursive, jobs=args.jobs, skip_existing=args.resume, progress=bar
        )
    rate = res.bytes_copied / res.seconds / 1e9 if res.seconds > 0 else 0.0
    data = {
        "copied": len(res.copied),
        "skipped": len(res.skipped),
        "bytes": res.bytes_copied,
        "seconds": round(res.seconds, 4),
        "gb_per_s": round(rate, 4),
        "files": res.copied,
        "skipped_files": res.skipped,
    }
    out.emit(
        data,
        None
        if out.quiet
        else (
            f"copied {len(res.copied)} file(s), {human_bytes(res.bytes_copied)} in {res.seconds:.2f}s "
            f"({rate:.3f} GB/s); skipped {len(res.skipped)} already up to date"
        ),
    )
    return EXIT_OK


def _storage_root(uri: str) -> str | None:
    """What a resolved ``uri`` is the whole of (``"bucket"``, ``"filesystem"``), or None when it is below that."""
    scheme, rest = _uri.split(uri)
    if scheme in ("", "file"):
        return "filesystem" if os.path.realpath(os.path.expanduser(rest) or ".") == os.path.realpath(os.sep) else None
    return "bucket" if "/" not in rest.strip("/") else None


def _confirmed(question: str) -> bool:
    """Ask on a terminal; anything but yes (or no terminal) is no."""
    if not sys.stdin.isatty():
        return False
    print(f"{question} [y/N] ", end="", file=sys.stderr, flush=True)
    return sys.stdin.readline().strip().lower() in ("y", "yes")


def cmd_rm(args: argparse.Namespace, out: Out) -> int:
    backend, uri = resolve(args.uri)
    if _kind(backend, uri) == "dir":
        if not args.recursive:
            raise UsageError(f"{args.uri} is a directory; pass -r to remove it and everything under it")
        whole = _storage_root(uri)
        if whole and not args.force:
            named = args.uri if args.uri == uri else f"{args.uri} ({uri})"
            if not _confirmed(f"ckptio rm: {named} is a whole {whole}; remove everything in it?"):
                raise UsageError(
                    f"refusing to remove everything in {named}: it is a whole {whole}; pass --force to remove it all"
                )
        victims = [i.uri for i in backend.list(uri, recursive=True) if not i.is_dir]
        backend.rmtree(uri)
        if _uri.scheme_of(uri) in ("", "file"):  # local directories stay behind empty; object stores have none
            import shutil

            shutil.rmtree(uri.removeprefix("file://"), ignore_errors=True)
    else:
        backend.delete(uri)
        victims = [uri]
    out.emit({"removed": victims}, None if out.quiet else f"removed {len(victims)} object(s)")
    return EXIT_OK


def cmd_info(args: argparse.Namespace, out: Out) -> int:
    data = info(args.uri)

    def text() -> str:
        lines = [f"{data['uri']}: {data.get('format') or 'unknown format'}, {human_bytes(data.get('size') or 0)}"]
        tensors = data.get("tensors") or []
        if tensors or data.get("format") in ("torch", "dcp", "fastpickle", "safetensors"):
            lines.append(f"{len(tensors)} tensors, {human_bytes(data.get('tensor_bytes') or 0)}")
            lines.append(_tensor_table(tensors, None if args.all else 50))
        values = data.get("values") or {}
        if values:
            lines.append("other values:")
            for k, v in list(values.items())[: None if args.all else 30]:
                lines.append(f"  {k} = {v if isinstance(v, str) else json.dumps(v)}"[:160])
        if data.get("data_files"):
            lines.append("data files: " + ", ".join(f"{k} ({human_bytes(v)})" for k, v in data["data_files"].items()))
        extra = {
            k: v
            for k, v in data.items()
            if k not in ("uri", "format", "size", "tensors", "tensor_bytes", "values", "data_files")
        }
        for k, v in extra.items():
            lines.append(f"{k}: {v if isinstance(v, str) else json.dumps(v)}"[:200])
        return "\n".join(lines)

    out.emit(data, text)
    return EXIT_OK


def cmd_verify(args: argparse.Namespace, out: Out) -> int:
    data = verify(args.uri)
    out.emit(data, None if out.quiet else f"{args.uri}: ok ({data['format']}; {data.get('what', 'checked')})")
    return EXIT_OK


def cmd_cache(args: argparse.Namespace, out: Out) -> int:
    from . import cache

    table = default_context().settings.cache  # the settings file's [cache] table
    cache_dir = args.cache_dir or os.path.expanduser(table.get("dir") or cache.default_cache_dir())
    exists = os.path.isdir(cache_dir)
    before = cache.usage(cache_dir)  # reads only: works on a read-only or missing directory
    if args.action == "stats":
        data = {"cache_dir": cache_dir, "exists": exists, **before}
        partial = f" ({human_bytes(before['partial_bytes'])} of it partial fills)" if before["partial_bytes"] else ""
        out.emit(
            data,
            f"cache {cache_dir}: {data['entries']} entries, {human_bytes(before['bytes'])}{partial}"
            + ("" if exists else " (does not exist yet)"),
        )
        return EXIT_OK
    if exists:
        cache.CacheStore(cache_dir).clear()
    after = cache.usage(cache_dir)["bytes"]
    data = {"cache_dir": cache_dir, "freed_bytes": before["bytes"] - after, "bytes_left": after}
    out.emit(
        data,
        None
        if out.quiet
        else f"cache {cache_dir}: freed {human_bytes(before['bytes'] - after)}"
        + (f", {human_bytes(after)} left in use by running readers" if after else ""),
    )
    return EXIT_OK


def cmd_config(args: argparse.Namespace, out: Out) -> int:
    s = default_context().settings.redacted()
    would = _config.default_file(os.environ)
    data = {**s, "settings_file": would}

    def text() -> str:
        lines = [
            f"settings file: {would or '(none found: defaults and environment only)'}",
            f"sources (lowest first): {', '.join(s['sources']) or '(defaults)'}",
        ]
        for name, opts in s["backends"].items():
            lines.append(f"[backends.{name}]")
            lines.extend(f"{k} = {json.dumps(_jsonable(v))}" for k, v in opts.items())
        for name, a in s["aliases"].items():
            lines.append(
                f"[aliases.{name}]  target = {json.dumps(a['target'])}"
                + (f"  options = {json.dumps(_jsonable(a['options']))}" if a["options"] else "")
            )
        if s["path_mapping"]:
            lines.append("[path_mapping]")
            lines.extend(f"{json.dumps(k)} = {json.dumps(v)}" for k, v in s["path_mapping"].items())
        return "\n".join(lines)

    out.emit(data, text)
    return EXIT_OK


def cmd_bench(args: argparse.Namespace, out: Out) -> int:
    argv = list(args.bench_args)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if out.json and "--json" not in argv:
        argv.append("--json")
    if out.quiet and "--quiet" not in argv:
        argv.append("--quiet")
    from .bench import throughput  # imported on use only: `import ckptio` stays cheap

    return int(throughput.main(argv) or 0)


# ---------------------------------------------------------------------------------------------
# parser and error handling


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="print one JSON document")
    common.add_argument(
        "-q", "--quiet", action="store_true", default=argparse.SUPPRESS, help="no progress bar or summary lines"
    )
    common.add_argument(
        "-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help="show a traceback on errors"
    )
    p = argparse.ArgumentParser(
        prog="ckptio",
        parents=[common],
        description="Checkpoint I/O on any storage.",
        epilog="exit status: 0 ok, 1 failure or corruption, 2 usage or settings, 3 not found, "
        "4 access denied, 5 missing optional package, 130 interrupted",
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    a = sub.add_parser("ls", parents=[common], help="list a directory/prefix or show one object")
    a.add_argument("uri")
    a.add_argument("-r", "--recursive", action="store_true")
    a.add_argument("-l", "--long", action="store_true", help="sizes and modification times")
    a.set_defaults(func=cmd_ls)

    a = sub.add_parser("cp", parents=[common], help="copy between any backends (resumable, parallel)")
    a.add_argument("src")
    a.add_argument("dst")
    a.add_argument("-r", "--recursive", action="store_true")
    a.add_argument("-j", "--jobs", type=int, default=4, help="files copied in parallel (default 4)")
    a.add_argument(
        "--resume",
        action="store_true",
        help="continue an interrupted copy: skip destination files with the same size and an equal "
        "version or a newer mtime (a same-size, newer destination is assumed complete)",
    )
    a.set_defaults(func=cmd_cp)

    a = sub.add_parser("rm", parents=[common], help="remove an object (-r: a directory/prefix)")
    a.add_argument("uri")
    a.add_argument("-r", "--recursive", action="store_true")
    a.add_argument(
        "-f",
        "--force",
        action="store_true",
        help="with -r on a whole bucket (s3://B, gs://B, memory://B) or /: do not ask, remove it all",
    )
    a.set_defaults(func=cmd_rm)

    a = sub.add_parser("info", parents=[common], help="keys, dtypes, shapes, sizes of .fpk, .pt, DCP, .safetensors")
    a.add_argument("uri")
    a.add_argument("--all", action="store_true", help="do not truncate long tables")
    a.set_defaults(func=cmd_info)

    a = sub.add_parser("verify", parents=[common], help="check stored checksums (exit 1 on corruption)")
    a.add_argument("uri")
    a.set_defaults(func=cmd_verify)

    a = sub.add_parser("cache", parents=[common], help="node-local cache: stats | clear")
    a.add_argument("action", choices=["stats", "clear"])
    a.add_argument("--cache-dir", help="cache directory (default: from settings)")
    a.set_defaults(func=cmd_cache)

    a = sub.add_parser("config", parents=[common], help="effective settings (secrets redacted) and their files")
    a.set_defaults(func=cmd_config)

    a = sub.add_parser(
        "bench", help="throughput benchmark (see `ckptio bench --help`)", add_help=False, prefix_chars="+"
    )  # everything after `bench` goes to the benchmark
    a.add_argument("bench_args", nargs=argparse.REMAINDER)
    a.set_defaults(func=cmd_bench)
    return p


_HINTS: list[tuple[type, int, str]] = [
    (KeyboardInterrupt, EXIT_INTERRUPTED, "interrupted; `ckptio cp` can be rerun to resume"),
    (UsageError, EXIT_USAGE, "see `ckptio COMMAND --help`"),
    (IncompleteCheckpointError, EXIT_FAILURE, "the save did not finish; use an earlier checkpoint"),
    (IntegrityError, EXIT_FAILURE, "the data is corrupt or truncated; restore it from another copy"),
    (UnknownFormatError, EXIT_USAGE, "pass a file with a known extension (.fpk, .pt, .safetensors) or a DCP directory"),
    (FormatError, EXIT_FAILURE, "check that the URI points at a checkpoint in a supported format"),
    (SettingsError, EXIT_USAGE, "fix the settings named above; `ckptio config` shows which file is used"),
    (UnknownSchemeError, EXIT_USAGE, "define the scheme as an alias in ckptio.toml or install its fsspec package"),
    (InvalidURIError, EXIT_USAGE, "URIs look like s3://bucket/key, gs://bucket/key, /local/path"),
    (MissingDependencyError, EXIT_MISSING_DEP, "install what the message names, e.g. pip install 'ckptio[all]'"),
    (FileNotFoundError, EXIT_NOT_FOUND, "check the URI; `ckptio ls PARENT` shows what exists"),
    (PermissionError, EXIT_DENIED, "check credentials and permissions; `ckptio config` shows the settings in use"),
    (IsADirectoryError, EXIT_USAGE, "pass -r for directories"),
    (NotADirectoryError, EXIT_USAGE, "the path is a file, not a directory"),
]


def _classify(e: BaseException) -> tuple[int, str]:
    for cls, code, hint in _HINTS:
        if isinstance(e, cls):
            return code, hint
    return EXIT_FAILURE, "rerun with -v for the traceback"


def main(argv: Sequence[str] | None = None) -> int:
    os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    parser = build_parser()
    args = parser.parse_args(argv)
    out = Out(args)
    try:
        code = args.func(args, out)
    except (Exception, KeyboardInterrupt) as e:  # noqa: BLE001 - every error becomes one line and an exit status
        code, hint = _classify(e)
        msg = " ".join(str(e).split()) or type(e).__name__
        if out.verbose:
            traceback.print_exc()
        print(f"ckptio {args.command}: error: {msg}", file=sys.stderr)
        print(f"  hint: {hint}", file=sys.stderr)
        if out.json:
            print(json.dumps({"error": msg, "type": type(e).__name__, "exit_code": code}))
    finally:
        sys.stdout.flush()
    return code


def _entry() -> None:  # pragma: no cover
    sys.exit(main())


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

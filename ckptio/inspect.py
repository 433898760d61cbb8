"""``ckptio.info`` / ``ckptio.verify``: describe or check a checkpoint at any URI without loading it.

Which code answers is decided by what the URI holds: a DCP directory (or its ``.metadata``) goes to
:func:`ckptio.dcp.inspect` / :func:`ckptio.dcp.verify`; a file goes to its format's ``inspect`` /
``verify`` (:class:`ckptio.formats.base.Format`), found by extension in the registry. Both return
plain JSON data (what ``ckptio info --json`` / ``ckptio verify --json`` print).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from . import registry as _registry
from . import uri as _uri
from .backends.base import Backend
from .context import resolve
from .errors import FormatError, IncompleteCheckpointError, UnknownFormatError
from .formats.base import Format
from .transfer import path_kind


def _detect(backend: Backend, uri: str) -> tuple[str, Format | None, str]:
    """``("dcp", None, directory)`` for a DCP checkpoint, else ``("file", format or None, uri)``."""
    from .dcp import DATA_SUFFIX, METADATA_NAME

    if _uri.basename(uri) == METADATA_NAME:
        return "dcp", None, _uri.parent(uri)
    if path_kind(backend, uri) == "dir":
        if backend.isfile(_uri.join_path(uri, METADATA_NAME)):
            return "dcp", None, uri
        if any(i.uri.endswith(DATA_SUFFIX) for i in backend.list(uri)):
            raise IncompleteCheckpointError(
                f"checkpoint {uri!r} is incomplete: it has no {METADATA_NAME} (the save "
                f"was interrupted or is still running)"
            )
        raise FormatError(f"{uri} is a directory but not a DCP checkpoint (no {METADATA_NAME})")
    try:
        return "file", _registry.formats.find(uri).instance(), uri
    except UnknownFormatError:
        return "file", None, uri


@contextlib.contextmanager
def _incremental(backend: Backend, kind: str, target: str) -> Iterator[tuple[Backend, dict[str, Any]]]:
    """The backend to read ``target`` through and the DCP reader options: for an incremental
    checkpoint's data (recipes), through the content store of its root (:mod:`ckptio.incremental.direct`)."""
    from .incremental.direct import dcp_reader, file_reader

    reader = dcp_reader(backend, target) if kind == "dcp" else file_reader(backend, target)
    if reader is None:
        yield backend, {}
        return
    try:
        yield reader, {"backend": reader}
    finally:
        reader.close()


def info(uri: str) -> dict[str, Any]:
    """What ``ckptio info`` prints: ``uri``, ``format``, ``size``, the tensor table (``tensors``: key,
    dtype, shape, nbytes; ``tensor_bytes``) and the other values, without reading tensor data.
    A file no format can inspect gets its format's name (or None), size and version."""
    backend, resolved = resolve(uri)
    kind, fmt, target = _detect(backend, resolved)
    with _incremental(backend, kind, target) as (backend, opts):
        return _info(uri, backend, kind, fmt, target, opts)


def _info(uri: str, backend: Backend, kind: str, fmt: Format | None, target: str, opts: dict) -> dict[str, Any]:
    if kind == "dcp":
        from . import dcp

        out = dcp.inspect(target, **opts)
    elif fmt is not None and fmt.can("inspect"):
        out = fmt.inspect(backend, target)
    else:
        st = backend.stat(target)
        out = {"format": fmt and fmt.name, "tensors": [], "values": {}, "version": st.version, "size": st.size}
    out["uri"] = uri
    if kind == "dcp":
        out["size"] = sum(out.get("data_files", {}).values())
    elif "size" not in out:
        out["size"] = backend.stat(target).size
    return out


def verify(uri: str) -> dict[str, Any]:
    """Check every checksum the format stores (``ckptio verify``): ``uri``, ``format``, ``ok``,
    ``checked``, ``unchecked``, ``what``. IntegrityError on corruption, FormatError when the
    format stores nothing to check."""
    backend, resolved = resolve(uri)
    kind, fmt, target = _detect(backend, resolved)
    with _incremental(backend, kind, target) as (backend, opts):
        return _verify(uri, backend, kind, fmt, target, opts)


def _verify(uri: str, backend: Backend, kind: str, fmt: Format | None, target: str, opts: dict) -> dict[str, Any]:
    if kind == "dcp":
        from . import dcp

        return {"uri": uri, "format": "dcp", "ok": True, **dcp.verify(target, **opts)}  # as dcp.inspect
    if fmt is None or not fmt.can("verify"):
        raise FormatError(
            f"{uri}: no checksums to verify for this format (verify reads DCP directories and the files "
            f"of formats that implement it: .fpk, .pt, .safetensors...)"
        )
    return {"uri": uri, "format": fmt.name, "ok": True, **fmt.verify(backend, target)}

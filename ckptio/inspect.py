"""``ckptio.info`` / ``ckptio.verify``: describe or check a checkpoint at any URI without loading it.

Which code answers is decided by what the URI holds: a DCP directory (or its ``.metadata``) goes to
:func:`ckptio.dcp.inspect` / :func:`ckptio.dcp.verify`; a file goes to its format's ``inspect`` /
``verify`` (:class:`ckptio.formats.base.Format`), found by extension in the registry; a Checkpointer
step directory to its data file or DCP directory, as its commit marker names them; a Checkpointer
root (``info`` only) to :mod:`ckptio.checkpointer.catalog`. Both return
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
from .dcp_names import DATA_SUFFIX, METADATA_NAME
from .errors import FormatError, IncompleteCheckpointError, NotFoundError, UnknownFormatError
from .formats.base import Format
from .transfer import path_kind


def _detect(backend: Backend, uri: str) -> tuple[str, Format | None, str, dict[str, Any]]:
    """``("dcp", None, directory, marker)`` for a DCP checkpoint, ``("root", None, uri, {})`` for a
    Checkpointer root, else ``("file", format or None, file, marker)``; ``marker``: the commit marker
    of a Checkpointer step directory (checked before anything it names is read), else empty."""
    if _uri.basename(uri) == METADATA_NAME:
        return "dcp", None, _uri.parent(uri), {}
    if path_kind(backend, uri) != "dir":
        try:
            return "file", _registry.formats.find(uri).instance(), uri, {}
        except UnknownFormatError:
            return "file", None, uri, {}
    # not at module level: `import ckptio` does not pay for the Checkpointer's modules
    from .checkpointer.catalog import is_root
    from .checkpointer.manifest import _FILE_FORMAT, MARKER_NAME, Layout, _check_manifest, read_manifest

    marker, m = _uri.join_path(uri, MARKER_NAME), {}
    if backend.isfile(marker):  # a Checkpointer step: its marker names the format and the data file
        m = read_manifest(backend, marker, marker)
        _, fmt, name = _check_manifest(m, marker)
        if name is not None:
            found = _registry.formats.by_name(_FILE_FORMAT[fmt])
            return "file", found.instance() if found else None, _uri.join_path(uri, name), m
    if backend.isfile(_uri.join_path(uri, METADATA_NAME)):
        return "dcp", None, uri, m
    if m or any(i.uri.endswith(DATA_SUFFIX) for i in backend.list(uri)):
        raise IncompleteCheckpointError(
            f"checkpoint {uri!r} is incomplete: it has no {METADATA_NAME} (the save "
            f"was interrupted or is still running)"
        )
    if is_root(Layout(uri)):
        return "root", None, uri, {}
    raise FormatError(
        f"{uri} is a directory but not a checkpoint: no {METADATA_NAME} (DCP), no {MARKER_NAME} "
        f"(a Checkpointer step), no step directories (a Checkpointer root)"
    )


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


def info(uri: str, *, step: int | None = None, local_tier: str | None = None) -> dict[str, Any]:
    """What ``ckptio info`` prints: ``uri``, ``format``, ``size``, the tensor table (``tensors``: key,
    dtype, shape, nbytes; ``tensor_bytes``) and the other values, without reading tensor data.
    A file no format can inspect gets its format's name (or None), size and version. A Checkpointer
    step directory: its data, with ``step`` and ``metrics`` from its marker. A Checkpointer root: its
    steps (:func:`ckptio.checkpointer.catalog.catalog`; ``local_tier``: a node's local tier), or with
    ``step``, that step's data."""
    from .checkpointer.catalog import catalog
    from .checkpointer.manifest import Layout

    if step is not None:
        layout = Layout(uri.rstrip("/") or uri)
        if step not in layout.step_dirs():
            raise NotFoundError(layout.uri(step), f"no step {step} under this Checkpointer root")
        uri = layout.uri(step)
    backend, resolved = resolve(uri)
    kind, fmt, target, marker = _detect(backend, resolved)
    if kind == "root":
        return catalog(uri, local_tier)
    with _incremental(backend, kind, target) as (backend, opts):
        out = _info(uri, backend, kind, fmt, target, opts)
    if marker:
        out.update(step=marker.get("step"), metrics=marker.get("metrics") or {})
        if kind == "file":
            out["data_file"] = _uri.basename(target)
    return out


def _info(uri: str, backend: Backend, kind: str, fmt: Format | None, target: str, opts: dict) -> dict[str, Any]:
    if kind == "dcp":
        from . import dcp  # reading .metadata unpickles torch's classes: imports torch

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
    format stores nothing to check. A Checkpointer step directory: its data."""
    backend, resolved = resolve(uri)
    kind, fmt, target, _ = _detect(backend, resolved)
    if kind == "root":
        raise FormatError(
            f"{uri} is a Checkpointer root: verify one step (`ckptio info {uri}` lists them, "
            f"`ckptio verify {_uri.join_path(uri, 'STEPDIR')}` checks one)"
        )
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

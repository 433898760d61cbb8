"""The data of each checkpoint format: how a step's data objects are discarded, written and read.

``dcp``: a :mod:`ckptio.dcp` checkpoint, written by every rank (its ``.metadata`` committed last) and
discarded with :func:`ckptio.dcp.discard` (its ``.metadata`` and the data objects that names), never the
whole directory: DCP names data objects per save, so another save of the step may be writing there.
``pt``/``fpk``: one file (``state.pt``/``state.fpk``), written by rank 0 with :func:`ckptio.dump` and
read with the ckptio format of the checkpoint's format, whatever the file's name.

Reading runs no code from the files unless the caller opts in (``allow_pickle``): ``pt`` files load with
``weights_only``, ``fpk`` files unpickle nothing, ``dcp`` non-tensor items load only if they are plain
data (:mod:`ckptio.dcp.checks`). A DCP read fills the state dicts of :mod:`.statedict` in place (a fresh
optimizer's state initialized first, DTensor shards under FSDP2) and new tensors for entries they lack.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from .. import uri as _uri
from ..context import resolve
from ..errors import FormatError
from ..incremental.direct import step_reader
from .manifest import _DATA_FILE, _FILE_FORMAT, Layout
from .state import _fill_empty, tree_has
from .statedict import Parts


def discard(fmt: str, layout: Layout, step: int) -> None:
    """Remove the data of ``step``'s uncommitted directory before it is written again."""
    if fmt == "dcp":
        from .. import dcp

        # not the whole directory: another save of this step may be writing its own data objects there
        dcp.discard(layout.uri(step))
    else:
        layout.rmtree(layout.dir(step))  # debris of a crashed save, or the uncommitted old data


def write_dcp(sd: dict[str, Any], uri: str, process_group: Any, options: Mapping[str, Any]) -> list[str]:
    """Every rank: write ``sd`` as a DCP checkpoint at ``uri``; returns the marker's file list (none).
    ``options`` may hold ``backend``, the wrapper to write the data objects through."""
    from .. import dcp

    dcp.save(sd, uri, process_group=process_group, **options)
    return []


def write_file(fmt: str, uri: str, sd: dict[str, Any], options: Mapping[str, Any]) -> list[str]:
    """Rank 0: write ``sd`` as the ``pt``/``fpk`` data file in directory ``uri``; returns its name."""
    from ..io import dump

    name = _DATA_FILE[fmt]
    dump(sd, _uri.join_path(uri, name), **options)
    return [name]


def keep_present(wanted: list[str], check: Callable[[Mapping[str, Any]], None]) -> Callable[[Mapping[str, Any]], None]:
    """For a ``.fpk`` read of the parts ``wanted`` (``keys=``) that is not strict: ``check``, then keep in
    ``wanted`` only the parts the file's tree has (the others are then reported missing)."""

    def run(tree: Mapping[str, Any]) -> None:
        check(tree)
        wanted[:] = [k for k in wanted if k in tree]

    return run


def read_file(
    fmt: str,
    d: str,
    name: str,
    options: dict[str, Any],
    weights_only: bool,
    cache: Any,
    allow_pickle: bool,
    incremental: bool = False,
    into: Any = None,
    check: Callable[[Mapping[str, Any]], None] | None = None,
) -> tuple[Mapping[str, Any], list[str]]:
    """The parts of the ``pt``/``fpk`` checkpoint file ``d``/``name`` and their names (``incremental``:
    read through the content store of ``d``'s root, :mod:`.content`; ``into``: the tensors to read
    matching stored tensors into, for formats that can, :func:`ckptio.restore.load_into`; ``check``:
    called with the file's parts before anything is read into ``into``, may raise)."""
    from ..io import load as _load
    from ..registry import formats

    fmt_obj = formats.by_name(_FILE_FORMAT[fmt]).instance()  # type: ignore[union-attr]
    kw = dict(options)
    if into is not None and fmt_obj.loads_into:
        kw["into"] = into
    if check is not None and fmt_obj.loads_into:  # .fpk: checked before a byte is read (into=)
        kw["check"] = _parts_checked(check, d)
        check = None
    if allow_pickle:
        kw["allow_pickle"] = True
    if cache is not None:
        kw["cache"] = cache
    if fmt == "pt":
        kw.setdefault("weights_only", weights_only and not kw.get("allow_pickle", False))
        kw.setdefault("map_location", "cpu")
    data_uri = _uri.join_path(d, name)
    entries = kw.pop("keys", None) if fmt == "pt" else None  # only these parts' bytes (.fpk: its own keys=)
    if incremental:
        backend, resolved = step_reader(d, kw.pop("cache", None))
        try:
            source = _load_pt_entries(backend, _uri.join_path(resolved, name), entries, kw) if entries else None
            if source is None:
                source = fmt_obj.load(backend, _uri.join_path(resolved, name), **kw)
        finally:
            backend.close()
    elif entries is not None:
        reads, resolved = resolve(data_uri, cache=kw.pop("cache", None))
        source = _load_pt_entries(reads, resolved, entries, kw)
    else:
        source = _load(data_uri, file_format=_FILE_FORMAT[fmt], **kw)
    if not isinstance(source, Mapping):
        raise FormatError(f"{data_uri}: holds a {type(source).__name__}, not a checkpoint's mapping of parts")
    if check is not None:
        check(source)
    return source, list(source)


def _load_pt_entries(backend: Any, uri: str, keys: list[str], kw: dict[str, Any]) -> Any:
    from ..errors import note
    from ..formats.torch_entries import load_entries

    try:
        return load_entries(backend, uri, keys, **kw)
    except Exception as e:  # torch's own errors do not say which file
        if uri not in str(e):
            note(e, f"ckptio: loading {uri}")
        raise


def read_pt_parts(
    files: Mapping[str, str],
    names: list[str],
    options: dict[str, Any],
    weights_only: bool,
    cache: Any,
    allow_pickle: bool,
    check: Callable[[Mapping[str, Any]], None] | None = None,
) -> tuple[dict[str, Any], list[str]]:
    """The parts ``names`` of a checkpoint of one ``.pt`` file per part (a Cosmos step: ``files``, part ->
    file URI), reading only those parts' files; ``check`` as for :func:`read_file`, before anything is
    restored."""
    source = {}
    for k in names:
        if k in files:
            f = files[k]
            source[k], _ = read_file("pt", _uri.parent(f), _uri.basename(f), options, weights_only, cache, allow_pickle)
    if check is not None:
        check(source)
    return source, list(files)


def _parts_checked(check: Callable[[Mapping[str, Any]], None], d: str) -> Callable[[Any], None]:
    def run(tree: Any) -> None:
        if not isinstance(tree, Mapping):
            raise FormatError(f"{d}: holds a {type(tree).__name__}, not a checkpoint's mapping of parts")
        check(tree)

    return run


def read_dcp(
    d: str,
    parts: Parts,
    names: list[str],
    options: dict[str, Any],
    process_group: Any,
    cache: Any = None,
    allow_pickle: bool = False,
    incremental: bool = False,
    check: Callable[[Mapping[str, Any]], None] | None = None,
) -> tuple[dict[str, Any], list[str]]:
    """Read the parts ``names`` of ``parts`` from a DCP checkpoint: into the state's own tensors where they
    match (the templates of :meth:`Parts.templates`: a fresh optimizer's state initialized, DTensor shards
    under FSDP2), into new tensors for entries the templates lack. ``incremental``: its data objects are
    read through the content store of ``d``'s root (:mod:`.content`); ``check``: called with the
    checkpoint's parts (tensors as meta tensors) before anything is read into the state."""
    if not incremental:
        return _read_dcp(d, parts, names, options, process_group, cache, allow_pickle, check)
    backend, _ = step_reader(d, cache)
    try:
        return _read_dcp(d, parts, names, {**options, "backend": backend}, process_group, cache, allow_pickle, check)
    finally:
        backend.close()


def _read_dcp(
    d: str,
    parts: Parts,
    names: list[str],
    options: dict[str, Any],
    process_group: Any,
    cache: Any,
    allow_pickle: bool,
    check: Callable[[Mapping[str, Any]], None] | None,
) -> tuple[dict[str, Any], list[str]]:
    from .. import torch_internals as _ti

    flatten_state_dict, set_element = _ti.flatten_state_dict, _ti.set_element
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from .. import dcp

    opts = dict(options)
    if cache is not None:
        opts["cache"] = cache
    if allow_pickle:
        opts["allow_pickle"] = True
    reader = dcp.StorageReader(d, **opts)
    md = reader.keep_metadata()  # torch's load below asks again: answered without a second read
    paths = {fqn: p for fqn, p in (md.planner_data or {}).items() if p}
    ckpt_parts = sorted({str(p[0]) for p in paths.values()})
    values = _values(d, md, paths, names if parts.optimizers(names) else (), process_group, reader)
    stored = _described(md, paths, values)
    if check is not None:
        check(stored)
    template = parts.templates(names, stored)
    flat, mappings = flatten_state_dict(template)
    tree: dict[str, Any] = {}
    for fqn, value in flat.items():  # a copy of the structure holding only what the checkpoint has
        meta = md.state_dict_metadata.get(fqn)
        if meta is None or (
            isinstance(meta, TensorStorageMetadata)
            and (not isinstance(value, torch.Tensor) or value.shape != meta.size)
        ):
            continue  # absent, or read into a new tensor below (a shape mismatch is reported by the restore)
        set_element(tree, mappings[fqn], value)
    new = {}
    for fqn, path in paths.items():
        if path[0] in template and not (fqn in flat and tree_has(tree, path)):
            new[fqn] = path
    reader.set_up_storage_reader(md, True)
    reader.check_tensors(f for f in new if isinstance(md.state_dict_metadata[f], TensorStorageMetadata))
    for fqn, path in new.items():
        meta = md.state_dict_metadata[fqn]
        value = (
            torch.empty(meta.size, dtype=meta.properties.dtype, device="cpu")
            if isinstance(meta, TensorStorageMetadata)
            else None
        )
        set_element(tree, path, value)
    for k in tree:
        _fill_empty(template[k], tree[k])  # DCP stores no empty containers (e.g. an unstepped optimizer's state)
    if tree:
        dcp.load(tree, d, planner=DefaultLoadPlanner(), process_group=process_group, storage_reader=reader)
    return tree, ckpt_parts


def _values(
    d: str, md: Any, paths: Mapping[str, Sequence[Any]], names: Iterable[str], process_group: Any, reader: Any
) -> dict[str, Any]:
    """The parameter lists of the optimizer groups in the parts ``names`` (``...param_groups.<i>.params``: what a
    check of the checkpoint against the state compares), read before any tensor; no other value is read twice."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from .. import dcp
    from .. import torch_internals as _ti

    wanted = set(names)
    flat: dict[str, Any] = {}  # by fqn: a nested request would ask for the list items before one as well
    for fqn, path in paths.items():
        if path[0] in wanted and not isinstance(md.state_dict_metadata.get(fqn), TensorStorageMetadata):
            if any(path[i] == "param_groups" and path[i + 2] == "params" for i in range(len(path) - 2)):
                flat[fqn] = None
    if flat:
        dcp.load(flat, d, planner=DefaultLoadPlanner(), process_group=process_group, storage_reader=reader)
    tree: dict[str, Any] = {}
    for fqn, value in flat.items():
        _ti.set_element(tree, paths[fqn], value)
    return tree


def _described(md: Any, paths: Mapping[str, Sequence[Any]], values: dict[str, Any]) -> dict[str, Any]:
    """A DCP checkpoint's entries (``planner_data`` paths) as nested dicts and lists: tensors as meta tensors
    of their shape and dtype, other values as read into ``values`` (:func:`_values`, which this fills), else None."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from .. import torch_internals as _ti

    for fqn, path in paths.items():
        meta = md.state_dict_metadata.get(fqn)
        if isinstance(meta, TensorStorageMetadata):
            _ti.set_element(values, path, torch.empty(meta.size, dtype=meta.properties.dtype, device="meta"))
        elif not tree_has(values, path):
            _ti.set_element(values, path, None)
    return values

"""The JSON-able reports of a ``.fpk`` file that ``ckptio info`` and ``ckptio verify`` print: the
tensor table (key, dtype, shape, nbytes), every other value by dotted key, version and pickle flag.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from typing import Any

import torch

from .layout import Inspection, TensorInfo

VERIFIED = "xxh3 of every tensor payload and of the metadata (full load)"


class _Tensor:
    """Where a tensor stands in the tree, once the tree is plain dicts and lists."""


_TENSOR = _Tensor()


def inspect_report(insp: Inspection) -> dict[str, Any]:
    """``{"format", "tensors", "tensor_bytes", "values", "version", "has_pickle"}`` of an inspection."""
    tensors, storages = [], {}
    for t in insp.tensors:
        tensors.append({"key": t.path, "dtype": str(t.dtype), "shape": list(t.shape), "nbytes": _nbytes(t)})
        storages[t.storage] = t.nbytes
    tree = _plain(insp.tree, bool(insp.tensors))
    values = {k: jsonable(v) for k, v in _flatten(tree) if v is not _TENSOR}
    return {
        "format": "fastpickle",
        "tensors": tensors,
        "tensor_bytes": sum(storages.values()),
        "values": values,
        "version": insp.version,
        "has_pickle": insp.has_pickle,
    }


def _nbytes(t: TensorInfo) -> int:
    """The bytes the tensor's elements take (its storage's bytes for numpy arrays and odd dtype names)."""
    try:
        return math.prod(t.shape) * getattr(torch, str(t.dtype).removeprefix("torch.")).itemsize
    except (AttributeError, TypeError):
        return t.nbytes


def _plain(obj: Any, tensors: bool) -> Any:
    """The tree with dicts as dicts, tuples as lists and each tensor as the marker ``_TENSOR``."""
    if tensors and isinstance(obj, TensorInfo):
        return _TENSOR
    if isinstance(obj, dict):
        return {k: _plain(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v, tensors) for v in obj]
    return obj


def _flatten(obj: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted key, leaf): dicts, and lists holding containers or tensors, are walked into."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _flatten(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(obj, (list, tuple)) and any(isinstance(v, (dict, list, tuple, _Tensor)) for v in obj):
        for i, v in enumerate(obj):
            yield from _flatten(v, f"{prefix}.{i}" if prefix else str(i))
    else:
        yield prefix, obj


def jsonable(obj: Any) -> Any:
    """Plain JSON data from a decoded value (dataclasses, dtypes, sizes, tuples, sets, bytes...)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [jsonable(v) for v in obj]
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

"""The JSON-able reports of a ``.fpk`` file that ``ckptio info`` and ``ckptio verify`` print: the
tensor table (key, dtype, shape, nbytes), every other value by dotted key, version and pickle flag.
"""

from __future__ import annotations

import math
from typing import Any

from ..base import flatten, jsonable
from .layout import ELEMENTS, Inspection, TensorInfo

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
    values = {k: jsonable(v) for k, v in flatten(tree, _Tensor) if v is not _TENSOR}
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
    el = ELEMENTS.get(str(t.dtype).removeprefix("torch.")) if t.kind != "numpy" else None
    return t.nbytes if el is None else math.prod(t.shape) * el[0]


def _plain(obj: Any, tensors: bool) -> Any:
    """The tree with dicts as dicts, tuples as lists and each tensor as the marker ``_TENSOR``."""
    if tensors and isinstance(obj, TensorInfo):
        return _TENSOR
    if isinstance(obj, dict):
        return {k: _plain(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v, tensors) for v in obj]
    return obj

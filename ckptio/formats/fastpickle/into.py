"""Loading into existing tensors (``into=``, :func:`ckptio.load_into`): which stored tensors can be read
straight into the memory of a tensor the caller already has.

A stored tensor qualifies when the target at the same path of the tree is a plain CPU tensor (or
parameter) with the same dtype and shape, contiguous, not empty, and the stored tensor is the whole of
its storage (a torch tensor, offset 0, contiguous strides, the payload is exactly its bytes, no other
stored tensor shares the payload, saved from CPU or loaded with a CPU ``map_location``). Each target's
memory is used once (tied weights and other aliases: only the first). Everything else loads into fresh
buffers as usual and the caller copies it in (:func:`ckptio.restore.apply`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any

import torch

from .layout import DTYPES, Meta
from .select import Ref


def plan_into(meta: Meta, skeleton: Any, into: Any, map_location: Any) -> dict[int, torch.Tensor]:
    """Tensor index -> the target tensor to read it into, for every stored tensor that qualifies."""
    cpu = map_location is None or (isinstance(map_location, (str, torch.device)) and str(map_location) == "cpu")
    if not cpu:
        return {}
    pairs: list[tuple[int, torch.Tensor]] = []
    _walk(skeleton, into, pairs, 0)
    shared = Counter(t.storage for t in meta.tensors)
    out: dict[int, torch.Tensor] = {}
    spans: list[tuple[int, int]] = []
    for idx, target in pairs:
        info = meta.tensors[idx]
        nbytes = target.numel() * target.element_size()
        if (
            info.kind != "torch"
            or idx in out
            or shared[info.storage] != 1
            or (map_location is None and meta.storages[info.storage][3] != "cpu")
            or DTYPES.get(info.dtype) != target.dtype
            or tuple(info.shape) != tuple(target.shape)
            or info.storage_offset != 0
            or tuple(info.stride) != _contiguous(info.shape)
            or meta.storages[info.storage][1] != nbytes
            or not _fillable(target)
        ):
            continue
        start = target.data_ptr()
        if any(start < e and s < start + nbytes for s, e in spans):
            continue  # memory another target already takes (tied weights, views)
        spans.append((start, start + nbytes))
        out[idx] = target
    return out


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """The bytes of the contiguous tensor ``t`` as a flat uint8 tensor sharing its memory."""
    return t.detach().reshape(-1).view(torch.uint8)


def _contiguous(shape: Any) -> tuple[int, ...]:
    strides, n = [], 1
    for size in reversed(tuple(shape)):
        strides.append(n)
        n *= max(size, 1)
    return tuple(reversed(strides))


def _fillable(t: torch.Tensor) -> bool:
    return (
        type(t) in (torch.Tensor, torch.nn.Parameter)
        and t.device.type == "cpu"
        and t.layout == torch.strided
        and t.numel() > 0
        and t.is_contiguous()
        and not (t.is_conj() or t.is_neg() or t.is_quantized or t.is_inference())
    )


def _walk(skel: Any, target: Any, out: list[tuple[int, torch.Tensor]], depth: int) -> None:
    if depth > 256:
        return
    if isinstance(skel, Ref):
        if isinstance(target, torch.Tensor):
            out.append((skel.index, target))
        return
    if isinstance(skel, Mapping) and isinstance(target, Mapping):
        for k, v in skel.items():
            if k in target:
                _walk(v, target[k], out, depth + 1)
    elif isinstance(skel, (list, tuple)) and isinstance(target, (list, tuple)):
        for s, t in zip(skel, target, strict=False):
            _walk(s, t, out, depth + 1)

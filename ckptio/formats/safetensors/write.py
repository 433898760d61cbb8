"""Writing safetensors byte for byte as ``safetensors.torch.save_file`` does: :func:`prepare`
checks the tensors and metadata and builds the padded header (TypeError before anything is
written); :func:`write_tensors` sends the header, then each tensor's bytes straight from its memory
(small ones gathered into vectored writes, device tensors through fastpickle's staging buffer).
"""

from __future__ import annotations

import ctypes
import itertools
import json
import struct
import sys
from collections.abc import Mapping
from typing import Any

import torch

from ...errors import UnsupportedTensorError, UnsupportedValueError

# fastpickle's writer sink: one implementation of gathered writes for both formats
from ..fastpickle.layout import MAX_IOV
from ..fastpickle.write import GATHER, WRITE_CHUNK, Sink, write_device
from .layout import CODE_OF, RANK


def prepare(obj: Any, metadata: Mapping[str, str] | None) -> tuple[bytes, list[torch.Tensor]]:
    """The padded header (with its length) and the tensors in file order.

    Refuses, before any write, what ``safetensors.torch.save_file`` refuses, with a subclass of its
    error type (:class:`~ckptio.errors.UnsupportedValueError`: TypeError and ValueError): anything but
    a dict of str to dense tensors, non-contiguous tensors, and (:class:`UnsupportedTensorError`,
    a RuntimeError) tensors sharing memory, which a load would give back as separate copies.
    """
    if not isinstance(obj, Mapping):
        raise UnsupportedValueError(
            f"Expected a dict of [str, torch.Tensor] but received {type(obj)} (safetensors stores a flat dict)"
        )
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", ())
    for key, t in obj.items():  # the package's order of checks: types, then sparse, memory, contiguity
        if type(key) is not str:
            raise UnsupportedValueError(f"key {key!r}: safetensors keys must be str, got {type(key).__name__}")
        if key == "__metadata__":
            raise UnsupportedValueError("key '__metadata__' is reserved by safetensors; pass metadata=... instead")
        if not isinstance(t, torch.Tensor):
            hint = " (flatten nested dicts first, e.g. {'a.b': tensor})" if isinstance(t, Mapping) else ""
            raise UnsupportedValueError(f"Key `{key}` is invalid, expected torch.Tensor but received {type(t)}{hint}")
    sparse = [key for key, t in obj.items() if t.layout != torch.strided]
    if sparse:
        raise UnsupportedValueError(
            f"You are trying to save a sparse tensors: `{sparse}`, which safetensors does not store: make them "
            f"dense first with .to_dense() (the file may be much larger)"
        )
    items = []
    for key, t in obj.items():
        if t.is_quantized or t.is_nested or isinstance(t, dtensor):
            raise UnsupportedValueError(
                f"key {key!r}: safetensors stores dense tensors, got a {'quantized ' if t.is_quantized else ''}"
                f"{type(t).__name__} (convert it first, e.g. .dequantize() / .full_tensor())"
            )
        if t.is_meta:
            raise UnsupportedTensorError(f"Cannot copy out of meta tensor {key!r}: it has no data to save")
        code = CODE_OF.get(t.dtype)
        if code is None:
            raise UnsupportedValueError(f"key {key!r}: dtype {t.dtype} has no safetensors equivalent")
        try:
            key.encode("utf-8")
        except UnicodeEncodeError:
            raise UnsupportedValueError(f"key {key!r} is not valid Unicode text") from None
        items.append((key, code, t))
    _refuse_shared(items)
    for i, (key, code, t) in enumerate(items):
        if not t.is_contiguous():
            raise UnsupportedValueError(
                f"You are trying to save a non contiguous tensor: `{key}`, which safetensors does not store (a "
                f"strided view): save the full tensor and slice it after loading, or pass .contiguous()"
            )
        items[i] = (key, code, t.detach().resolve_conj().resolve_neg())
    if metadata is not None:
        if not isinstance(metadata, Mapping):
            raise TypeError(f"metadata must be a dict of str to str, got {type(metadata).__name__}")
        for k, v in metadata.items():
            if type(k) is not str or type(v) is not str:
                raise TypeError(
                    f"metadata[{k!r}]: safetensors metadata maps str to str, got {type(k).__name__}: {type(v).__name__}"
                )
    items.sort(key=lambda it: (-RANK[it[1]], it[0]))
    header: dict[str, Any] = {} if metadata is None else {"__metadata__": dict(metadata)}
    pos = 0
    for key, code, t in items:
        shape = list(t.shape)
        if code == "F4":
            shape = [*shape[:-1], shape[-1] * 2] if shape else [2]
        header[key] = {"dtype": code, "shape": shape, "data_offsets": [pos, pos + t.nbytes]}
        pos += t.nbytes
    try:
        raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as e:
        raise TypeError(f"metadata is not valid Unicode text ({e})") from None
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw, [t for _, _, t in items]


def _refuse_shared(items: list[tuple[str, str, torch.Tensor]]) -> None:
    """Tensors whose bytes overlap in one storage (tied weights, views): one file entry each would
    de-alias them on load. Disjoint parts of one storage are fine, as for the package."""
    spans = []
    for key, _, t in items:
        if t.numel() and t.untyped_storage().nbytes():
            start = t.data_ptr()
            end = start + (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))) * t.element_size()
            spans.append((t.device, start, end, key))
    spans.sort(key=lambda s: (str(s[0]), s[1], s[2]))
    for (dev_a, _, end_a, key_a), (dev_b, start_b, _, key_b) in itertools.pairwise(spans):
        if dev_a == dev_b and start_b < end_a:
            raise UnsupportedTensorError(
                f"Some tensors share memory: {key_a!r} and {key_b!r}; safetensors cannot represent that (a load "
                f"would give them back as separate copies): save one of them, or .clone() the other"
            )


def write_tensors(header: bytes, tensors: list[torch.Tensor], out: Sink) -> None:
    """Header, then each tensor's bytes straight from its memory; small ones gathered into vectored writes."""
    batch, batched = [memoryview(header)], len(header)
    for t in tensors:
        n = t.nbytes
        if n == 0:
            continue
        if batch and (n >= GATHER or t.device.type != "cpu"):
            out.writev(batch, batched)
            batch, batched = [], 0
        if t.device.type != "cpu":  # through fastpickle's reused (pinned) staging buffer
            write_device(
                torch.empty(0, dtype=torch.uint8, device=t.device).set_(
                    t.untyped_storage(), t.storage_offset() * t.element_size(), (n,), (1,)
                ),
                out.write,
            )
            continue
        mv = memoryview((ctypes.c_ubyte * n).from_address(t.data_ptr())).cast("B")
        if n >= GATHER:
            step = WRITE_CHUNK if out.fd is not None else n
            for i in range(0, n, step):
                out.write(mv[i : i + step])
            continue
        batch.append(mv)
        batched += n
        if batched >= GATHER or len(batch) >= MAX_IOV:
            out.writev(batch, batched)
            batch, batched = [], 0
    if batch:
        out.writev(batch, batched)

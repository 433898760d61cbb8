"""Encoding an object tree for ``.fpk``: the msgpack tree with tensor references, the tensor table and
the storages to write (see :mod:`.layout`). Nothing is written here; unsupported values fail before
any byte is.
"""

from __future__ import annotations

import collections
import pickle
import struct
from collections.abc import Sequence
from typing import Any

import msgpack
import numpy as np
import torch

from .layout import (
    DTYPES,
    EXT_BIGINT,
    EXT_COMPLEX,
    EXT_DEVICE,
    EXT_DTYPE,
    EXT_FROZENSET,
    EXT_GDICT,
    EXT_NPDTYPE,
    EXT_NPSCALAR,
    EXT_ODICT,
    EXT_PICKLE,
    EXT_SET,
    EXT_SIZE,
    EXT_TENSOR,
    EXT_TUPLE,
    INT64_MIN,
    KIND_NUMPY,
    KIND_QUANT,
    KIND_TORCH,
    MAX_DEPTH,
    NP_KINDS,
    QUANT_INT,
    TF_PARAMETER,
    TF_REQUIRES_GRAD,
    UINT64_MAX,
    pack,
    path_str,
)


def _short_path(path: Sequence[Any]) -> str:
    """A key path for messages, its middle elided when it is very long."""
    if len(path) <= 12:
        return path_str(path)
    return f"{path_str(path[:6])}...({len(path) - 10} more)...{path_str(path[-4:])}"


def _tensor_ref(idx: int) -> msgpack.ExtType:
    """A tree node pointing at entry ``idx`` of the tensor table: the index as 4 little-endian bytes."""
    return msgpack.ExtType(EXT_TENSOR, idx.to_bytes(4, "little"))


class Storage:
    __slots__ = ("data", "nbytes", "location", "offset", "checksum")

    def __init__(self, data: Any, nbytes: int, location: str) -> None:
        self.data = data  # a torch UntypedStorage (any device) or a contiguous numpy uint8 array
        self.nbytes, self.location = nbytes, location
        self.offset = self.checksum = 0


_DTYPE_NAMES = {d: n for n, d in DTYPES.items()}
_LOCATIONS: dict[torch.device, str] = {}


def _location(dev: torch.device) -> str:
    loc = _LOCATIONS.get(dev)
    if loc is None:
        loc = _LOCATIONS[dev] = str(dev)
    return loc


class Encoder:
    def __init__(self, allow_pickle: bool) -> None:
        self.allow_pickle = allow_pickle
        self.used_pickle = False
        self.storages: list[Storage] = []
        self._storage_ids: dict[tuple, int] = {}
        self.tensors: list[list] = []
        self._tensor_ids: dict[int, int] = {}
        self._keep: list[Any] = []  # objects whose id() is a key above, kept alive
        self._active: set[int] = set()

    def encode(self, obj: Any) -> bytes:
        return pack(self._enc(obj, []))

    def _ext(self, code: int, value: Any) -> msgpack.ExtType:
        return msgpack.ExtType(code, pack(value))

    def _enc(self, x: Any, path: list) -> Any:
        t = type(x)
        if x is None or t is bool or t is str or t is bytes or t is float:
            return x
        if t is int:
            if INT64_MIN <= x <= UINT64_MAX:
                return x
            return msgpack.ExtType(EXT_BIGINT, x.to_bytes((x.bit_length() + 8) // 8, "little", signed=True))
        if t is torch.Tensor or t is torch.nn.Parameter:
            return self._tensor(x, path)
        if t is dict or t is list or t is tuple or t is set or t is frozenset or t is collections.OrderedDict:
            return self._container(x, t, path)
        if t is complex:
            return msgpack.ExtType(EXT_COMPLEX, struct.pack("<dd", x.real, x.imag))
        if t is torch.Size:
            return msgpack.ExtType(EXT_SIZE, pack(list(x)))
        if t is torch.dtype:
            return msgpack.ExtType(EXT_DTYPE, str(x).removeprefix("torch.").encode())
        if t is torch.device:
            return msgpack.ExtType(EXT_DEVICE, str(x).encode())
        if t is np.ndarray:
            return self._ndarray(x, path)
        if isinstance(x, np.generic) and x.dtype.kind in NP_KINDS:
            return self._ext(EXT_NPSCALAR, [x.dtype.str, x.tobytes()])
        if t is np.dtype or isinstance(x, np.dtype):
            if x.kind in NP_KINDS and x.fields is None:
                return msgpack.ExtType(EXT_NPDTYPE, x.str.encode())
        return self._fallback(x, path, f"values of type {t.__module__}.{t.__qualname__}")

    def _container(self, x: Any, t: type, path: list) -> Any:
        if len(path) >= MAX_DEPTH:
            raise ValueError(
                f"fastpickle cannot save containers nested more than {MAX_DEPTH} deep (at "
                f"{_short_path(path)!r}); flatten that part of the state"
            )
        if id(x) in self._active:
            raise ValueError(f"fastpickle cannot save a reference cycle (at {path_str(path)!r})")
        self._active.add(id(x))
        try:
            if t is list:
                return [self._enc(v, path + [i]) for i, v in enumerate(x)]
            if t is tuple:
                return self._ext(EXT_TUPLE, [self._enc(v, path + [i]) for i, v in enumerate(x)])
            if t is set or t is frozenset:
                items = [self._enc(v, path + [i]) for i, v in enumerate(x)]
                return self._ext(EXT_SET if t is set else EXT_FROZENSET, items)
            if t is dict and all(
                (type(k) is str or type(k) is bytes or (type(k) is int and INT64_MIN <= k <= UINT64_MAX)) for k in x
            ):
                return {k: self._enc(v, path + [k]) for k, v in x.items()}
            flat: list[Any] = []
            for k, v in x.items():
                flat.append(self._enc(k, path + [f"<key {k!r}>"]))
                flat.append(self._enc(v, path + [k]))
            return self._ext(EXT_ODICT if t is collections.OrderedDict else EXT_GDICT, flat)
        finally:
            self._active.discard(id(x))

    def _fallback(self, x: Any, path: list, what: str) -> Any:
        if not self.allow_pickle:
            raise TypeError(
                f"fastpickle cannot save {what} (at {path_str(path)!r}); convert it to supported types "
                f"(dict, list, tuple, set, str, bytes, int, float, bool, None, complex, torch.Tensor, numpy arrays) "
                f"or pass allow_pickle=True (loading then needs allow_pickle=True too)"
            )
        self.used_pickle = True
        try:
            return msgpack.ExtType(EXT_PICKLE, pickle.dumps(x, protocol=pickle.HIGHEST_PROTOCOL))
        except Exception as e:
            raise TypeError(f"cannot pickle {what} (at {path_str(path)!r}): {e}") from e

    def _add_storage(self, key: tuple | None, data: Any, nbytes: int, location: str) -> int:
        """The index of the storage ``key`` names (a storage shared by views or tied weights is stored
        once), added if new; ``key`` None: always a new one."""
        idx = self._storage_ids.get(key, -1) if key is not None else -1
        if idx < 0:
            idx = len(self.storages)
            self.storages.append(Storage(data, nbytes, location))
            if key is not None:
                self._storage_ids[key] = idx
        return idx

    def _tensor(self, x: torch.Tensor, path: list) -> Any:
        idx = self._tensor_ids.get(id(x))
        if idx is not None:
            return _tensor_ref(idx)
        dev = x.device
        if x.layout is not torch.strided or x.is_nested or x.is_meta:
            what = "nested" if x.is_nested else str(x.layout) if x.layout != torch.strided else "meta"
            return self._fallback(x, path, f"{what} tensors")
        flags = (TF_REQUIRES_GRAD if x.requires_grad else 0) | (TF_PARAMETER if type(x) is torch.nn.Parameter else 0)
        t = x  # storage, shape and stride need no detach(); only a conj/neg view is materialized
        if t.is_conj() or t.is_neg():
            t = t.detach().resolve_conj().resolve_neg()
        extra: Any = None
        if t.is_quantized:
            t = t.detach()
            qs = t.qscheme()
            if t.dtype not in QUANT_INT or qs not in (torch.per_tensor_affine, torch.per_channel_affine):
                return self._fallback(x, path, f"quantized tensors with dtype {t.dtype} and scheme {qs}")
            if qs == torch.per_tensor_affine:
                extra = ["per_tensor_affine", float(t.q_scale()), int(t.q_zero_point())]
            else:
                extra = [
                    "per_channel_affine",
                    t.q_per_channel_scales().tolist(),
                    t.q_per_channel_zero_points().tolist(),
                    int(t.q_per_channel_axis()),
                ]
            dtype_name = _DTYPE_NAMES[t.dtype]
            t = t.int_repr()
            self._keep.append(t)
            kind = KIND_QUANT
        else:
            dtype_name = _DTYPE_NAMES[t.dtype]
            kind = KIND_TORCH
        st = t.untyped_storage()
        nbytes = st.nbytes()
        loc = _location(dev)
        sidx = self._add_storage((loc, st.data_ptr(), nbytes) if nbytes else None, st, nbytes, loc)
        entry = [
            kind,
            sidx,
            dtype_name,
            list(t.shape),
            list(t.stride()),
            t.storage_offset(),
            flags,
            path_str(path),
            extra,
        ]
        return self._add_entry(x, entry)

    def _ndarray(self, a: np.ndarray, path: list) -> Any:
        idx = self._tensor_ids.get(id(a))
        if idx is not None:
            return _tensor_ref(idx)
        if a.dtype.kind not in NP_KINDS or a.dtype.fields is not None or a.dtype.subdtype is not None:
            return self._fallback(a, path, f"numpy arrays of dtype {a.dtype}")
        c = np.ascontiguousarray(a)
        u8 = c.reshape(-1).view(np.uint8)
        sidx = self._add_storage(None, u8, c.nbytes, "cpu")
        entry = [KIND_NUMPY, sidx, a.dtype.str, list(a.shape), [], 0, 0, path_str(path), None]
        return self._add_entry(a, entry)

    def _add_entry(self, obj: Any, entry: list) -> msgpack.ExtType:
        self.tensors.append(entry)
        self._tensor_ids[id(obj)] = len(self.tensors) - 1
        self._keep.append(obj)
        return _tensor_ref(len(self.tensors) - 1)


def encode(obj: Any, allow_pickle: bool) -> tuple[Encoder, bytes]:
    """Encode the tree (fails on unsupported types before anything is written)."""
    enc = Encoder(allow_pickle)
    return enc, enc.encode(obj)

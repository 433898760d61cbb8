"""The hand-written ``torch.save`` zip framing around one tensor's bytes.

Each tensor item is written as an uncompressed zip that ``torch.load`` reads (zip CRC fields are
zero, as with ``torch.serialization.set_crc32_options(False)``), with the tensor bytes at a known,
64-byte aligned offset (:attr:`ZipFraming.data_offset`), so the writer streams the tensor straight
from its memory between a header and a trailer, and a load reads only the tensor bytes it needs.
Zip64 records are written when a size or offset needs them. The archive's ``serialization_id``
(torch reads it only to log it) is named by the caller's ``key`` when given, so an unchanged item is
framed by the same bytes at every save (an incremental save then reuses them), else random.
"""

from __future__ import annotations

import collections
import functools
import io
import pickle
import struct
import uuid
from typing import Any

import torch
import xxhash

from .. import torch_internals as _ti

__all__ = ["ZipFraming", "framing"]


class _StorageRef:
    pass


class _Rebuild:
    def __init__(self, ref: _StorageRef, shape: tuple[int, ...], stride: tuple[int, ...]) -> None:
        self.args: tuple[Any, ...] = (ref, 0, shape, stride, False, collections.OrderedDict())

    def __reduce__(self):  # the same reduction torch.Tensor uses
        return (_ti.rebuild_tensor_v2, self.args)


def _storage_type(dtype: torch.dtype):
    return getattr(torch, _ti.dtype_to_storage_type_map()[dtype])


@functools.lru_cache(maxsize=4096)  # the same bytes for every tensor of this dtype and shape (a model has few)
def _pickle_tensor(dtype: torch.dtype, shape: tuple[int, ...], numel: int) -> bytes:
    ref = _StorageRef()
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= max(s, 1)
    stride.reverse()

    class _P(pickle.Pickler):
        def persistent_id(self, obj):
            if obj is ref:
                return ("storage", _storage_type(dtype), "0", "cpu", numel)
            return None

    buf = io.BytesIO()
    _P(buf, protocol=2).dump(_Rebuild(ref, tuple(shape), tuple(stride)))
    return buf.getvalue()


_ALIGN = 64
_U32 = 0xFFFFFFFF


def _serialization_id(key: str | None, dtype: torch.dtype, shape: tuple[int, ...]) -> bytes:
    """40 ASCII characters: a hash of ``key``, dtype and shape, or random when ``key`` is None."""
    if key is None:
        return uuid.uuid4().hex.encode().ljust(40, b"0")
    return xxhash.xxh3_128_hexdigest(f"{key}\0{dtype}\0{list(shape)}".encode()).encode().ljust(40, b"0")


class ZipFraming:
    """Header and trailer bytes of a stored (uncompressed) zip around one tensor's bytes."""

    def __init__(self, dtype: torch.dtype, shape: tuple[int, ...], nbytes: int, key: str | None = None) -> None:
        numel = 1
        for s in shape:
            numel *= s
        records: list[tuple[str, bytes | int]] = [
            ("archive/data.pkl", _pickle_tensor(dtype, tuple(shape), numel)),
            ("archive/.format_version", b"1"),
            ("archive/.storage_alignment", str(_ALIGN).encode()),
            ("archive/byteorder", b"little"),
            ("archive/data/0", nbytes),  # the tensor itself, streamed by the caller
            ("archive/version", b"3\n"),
            ("archive/.data/serialization_id", _serialization_id(key, dtype, shape)),
        ]
        head, tail = bytearray(), bytearray()
        central = bytearray()
        pos = 0
        zip64 = False
        self.data_offset = -1
        for name, payload in records:
            size = payload if isinstance(payload, int) else len(payload)
            out = head if self.data_offset < 0 else tail
            local, big = self._local_header(name.encode(), size, pos)
            zip64 |= big or pos >= _U32
            out += local
            if isinstance(payload, int):
                self.data_offset = pos + len(local)
            else:
                out += payload
            central += self._central_header(name.encode(), size, pos)
            pos += len(local) + size
        cd_offset, cd_size = pos, len(central)
        tail += central
        n = len(records)
        if zip64 or cd_offset >= _U32:
            z64 = cd_offset + cd_size
            tail += struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 45, 45, 0, 0, n, n, cd_size, cd_offset)
            tail += struct.pack("<IIQI", 0x07064B50, 0, z64, 1)
            tail += struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, n, n, min(cd_size, _U32), _U32, 0)
        else:
            tail += struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, n, n, cd_size, cd_offset, 0)
        self.head, self.tail = bytes(head), bytes(tail)
        self.total = len(self.head) + nbytes + len(self.tail)

    @staticmethod
    def _local_header(name: bytes, size: int, pos: int) -> tuple[bytes, bool]:
        big = size >= _U32
        extra = struct.pack("<HHQQ", 1, 16, size, size) if big else b""
        fixed = 30 + len(name) + len(extra)
        pad = (-(pos + fixed + 4)) % _ALIGN  # "FB" padding field, like torch, aligns the data
        extra += struct.pack("<HH", 0x4246, pad) + b"Z" * pad
        s32 = _U32 if big else size
        hdr = struct.pack(
            "<IHHHHHIIIHH", 0x04034B50, 45 if big else 20, 0, 0, 0, 0x21, 0, s32, s32, len(name), len(extra)
        )
        return hdr + name + extra, big

    @staticmethod
    def _central_header(name: bytes, size: int, pos: int) -> bytes:
        vals: list[int] = []
        s32 = size
        if size >= _U32:
            s32 = _U32
            vals += [size, size]
        off32 = pos
        if pos >= _U32:
            off32 = _U32
            vals.append(pos)
        extra = struct.pack("<HH" + "Q" * len(vals), 1, 8 * len(vals), *vals) if vals else b""
        hdr = struct.pack(
            "<IHHHHHHIIIHHHHHII",
            0x02014B50,
            45,
            45 if vals else 20,
            0,
            0,
            0,
            0x21,
            0,
            s32,
            s32,
            len(name),
            len(extra),
            0,
            0,
            0,
            0,
            off32,
        )
        return hdr + name + extra


def framing(dtype: torch.dtype, shape: tuple[int, ...], nbytes: int, key: str | None) -> ZipFraming:
    """The framing of an item: built once per process for a named one (its bytes are the same at every
    save, so a training loop's saves reuse them), afresh for an unnamed one (a random id)."""
    return ZipFraming(dtype, shape, nbytes) if key is None else _named_framing(dtype, shape, nbytes, key)


@functools.lru_cache(maxsize=4096)  # ~1 KiB each
def _named_framing(dtype: torch.dtype, shape: tuple[int, ...], nbytes: int, key: str) -> ZipFraming:
    return ZipFraming(dtype, shape, nbytes, key)

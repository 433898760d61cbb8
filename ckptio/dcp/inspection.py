"""Inspecting and verifying a committed DCP checkpoint as a whole: what ``ckptio info`` and ``ckptio verify`` show.

:func:`inspect` lists the tensors and other values ``.metadata`` describes and the bytes of each data
object; :func:`verify` checks what a load reads: xxh3-64 per block of the data of items ckptio
wrote, and the ``torch.save`` frame around a tensor item's data (torch's ``FileSystemReader`` unpickles
it; it must be the frame ckptio writes for that dtype, shape and size, its random id aside), the
zip CRC32s for items torch's own writers wrote (items with torch's stream transforms are counted as
unchecked). Both read ``.metadata`` as :class:`~ckptio.dcp.StorageReader` does (restricted
unpickler, data object names checked) and check each storage entry before sizing anything from it.
"""

from __future__ import annotations

import io
import math
import os
import zipfile
from typing import Any

import torch
import xxhash
from torch.distributed.checkpoint.metadata import Metadata

from .. import uri as _uri
from ..backends.base import Backend
from ..errors import FormatError, IntegrityError
from ..formats.base import dtype_size
from .checks import entry_problem
from .layout import CHECKSUM_BLOCK, INFO_ATTR
from .reader import StorageReader
from .zipframe import ZipFraming

__all__ = ["inspect", "verify"]


def _read(uri: str | os.PathLike, backend_options: dict[str, Any]) -> tuple[Metadata, Backend, str]:
    """The checkpoint's metadata (checked as the reader checks it), its backend and root."""
    reader = StorageReader(uri, **backend_options)
    return reader.read_metadata(), reader.data_backend, reader.root


def inspect(uri: str | os.PathLike, **backend_options: Any) -> dict[str, Any]:
    """What the DCP checkpoint at ``uri`` holds, as plain JSON data.

    ``{"format": "dcp", "tensors": [{"key", "dtype", "shape", "nbytes", "chunks"}...],
    "tensor_bytes", "values": {key: metadata type name}, "data_files": {name: bytes used},
    "version"}``. Raises :class:`IncompleteCheckpointError` without ``.metadata``.
    """
    meta, _, _ = _read(uri, backend_options)
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
                    "nbytes": math.prod(shape) * dtype_size(dtype),
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


def verify(uri: str | os.PathLike, **backend_options: Any) -> dict[str, Any]:
    """Check every checksum the DCP checkpoint at ``uri`` stores; :class:`IntegrityError` on corruption.

    Returns ``{"checked": items checked, "unchecked": items with nothing to check, "what": ...}``.
    """
    meta, backend, root = _read(uri, backend_options)
    sizes: dict[str, int] = {}
    checked = unchecked = 0
    for idx, sinfo in (meta.storage_data or {}).items():
        obj = _uri.join_path(root, sinfo.relative_path)
        info = getattr(sinfo, INFO_ATTR, None)
        why = entry_problem(sinfo, isinstance(info, dict) and "data" in info, CHECKSUM_BLOCK)
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
        if not info.get("xxh3"):  # written by torch's own writers: each item is a torch.save zip with CRC32s
            if getattr(sinfo, "transform_descriptors", None):
                unchecked += 1
                continue
            _check_zip(backend, obj, idx.fqn, sinfo.offset, sinfo.length)
        else:
            _check_blocks(backend, obj, idx.fqn, sinfo, info)
            if "data" in info:
                _check_frame(backend, obj, idx.fqn, sinfo, info)
        checked += 1
    return {
        "checked": checked,
        "unchecked": unchecked,
        "what": "xxh3-64 per block and torch.save frames (ckptio items), zip CRC32 (items written by torch)",
    }


def _check_zip(backend: Backend, obj: str, fqn: str, offset: int, length: int) -> None:
    """The zip CRC32s of the item at ``[offset, offset + length)`` of ``obj``."""
    item = backend.read_range(obj, offset, offset + length)
    try:
        bad = zipfile.ZipFile(io.BytesIO(item)).testzip()
    except zipfile.BadZipFile:
        raise IntegrityError(f"{obj}: item {fqn!r} is not a readable archive: the checkpoint is corrupt") from None
    if bad is not None:
        raise IntegrityError(f"{obj}: CRC mismatch in item {fqn!r} ({bad}): the checkpoint is corrupt")


def _check_frame(backend: Backend, obj: str, fqn: str, sinfo: Any, info: dict[str, Any]) -> None:
    """The ``torch.save`` frame around a ckptio tensor item's data: the bytes :class:`ZipFraming` writes
    for its dtype, shape and size, but for the 40-byte serialization id (random or named by the key)."""
    try:
        want = ZipFraming(getattr(torch, info["dtype"]), tuple(info["shape"]), info["nbytes"])
    except (AttributeError, TypeError, ValueError) as e:
        raise FormatError(f"{obj}: item {fqn!r} has an unusable dtype or shape ({e})") from None
    start, end = sinfo.offset, sinfo.offset + sinfo.length
    head = backend.read_range(obj, start, start + len(want.head))
    tail = bytearray(backend.read_range(obj, end - len(want.tail), end))
    sid = want.tail.find(b"archive/.data/serialization_id")
    sid = want.tail.find(b"PK", sid) if sid >= 0 else -1  # the id's bytes: right after its local header
    at = sid - 40 if sid >= 40 else -1
    if at >= 0 and len(tail) == len(want.tail):
        tail[at : at + 40] = want.tail[at : at + 40]
    if info["data"] != len(want.head) or sinfo.length != want.total or head != want.head or bytes(tail) != want.tail:
        raise IntegrityError(
            f"{obj}: item {fqn!r}: its torch.save frame (the zip records and pickle around the tensor's "
            f"bytes, read by torch's FileSystemReader) is damaged: the checkpoint is corrupt"
        )


def _check_blocks(backend: Backend, obj: str, fqn: str, sinfo: Any, info: dict[str, Any]) -> None:
    """The xxh3-64 of each checksum block of a ckptio item's data, read one block at a time."""
    hashes = info["xxh3"]
    block = info.get("block", CHECKSUM_BLOCK)
    start, n = (sinfo.offset + info["data"], info["nbytes"]) if "data" in info else (sinfo.offset, sinfo.length)
    buf = bytearray(min(max(block, 1), max(n, 1)))
    for i, want in enumerate(hashes):
        a = i * block
        k = min(block, n - a)
        mv = memoryview(buf)[: max(k, 0)]
        if k > 0 and backend.readinto(obj, mv, start + a) != k:
            raise IntegrityError(f"{obj}: short read in item {fqn!r} at byte {start + a}")
        if xxhash.xxh3_64_intdigest(mv) != want:
            raise IntegrityError(
                f"checksum mismatch in {obj}, item {fqn!r}, bytes [{a}, {a + k}) of its data: the checkpoint is corrupt"
            )

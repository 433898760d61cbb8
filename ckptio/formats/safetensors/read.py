"""Reading safetensors: the header of a file (:func:`read_header`: one read of its first 256 KiB
for all but the largest headers), a shard index (:func:`read_index`, shard names validated), and the
tensors of a file (:func:`load_source`: mapped, read whole into one allocation, or only the ranges
of the keys asked for) or of a sharded checkpoint (:func:`load_index`).
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from ... import uri as _uri
from ...backends.base import Backend
from ...errors import FormatError, IntegrityError
from .. import sniff

# fastpickle's sources and ranged/mapped payload readers: one implementation of parallel reads into
# tensor memory and private mappings for both formats
from ..fastpickle.decode import tensor_factory
from ..fastpickle.layout import Meta, TensorInfo
from ..fastpickle.payloads import map_payloads, read_payloads
from ..fastpickle.read import source_for, with_source
from ..fastpickle.source import Source, fill
from .layout import HEAD_PREFETCH, MAX_HEADER, MAX_INDEX, TORCH_NAME, TensorEntry, parse_header, parse_json

if TYPE_CHECKING:
    import torch

# torch is imported where tensors are made: reading and checking headers (``ckptio info``/``verify``) needs none


def read_header(src: Source) -> tuple[dict[str, str], list[TensorEntry], bytes]:
    """Metadata, tensors and the first bytes of the file (one read for all but the largest headers)."""
    name, size = src.name, src.size
    first = src.read(0, min(size, HEAD_PREFETCH)) if size else b""
    sniff.expect(name, "safetensors", first)  # another format's file, named .safetensors
    if size < 8:
        raise IntegrityError(f"{name}: {size} bytes is too short for a safetensors file (truncated?)")
    (n,) = struct.unpack_from("<Q", first)
    if n > MAX_HEADER:
        raise FormatError(f"{name}: header length {n} exceeds the {MAX_HEADER}-byte limit (not a safetensors file?)")
    if 8 + n > size:
        raise IntegrityError(
            f"{name}: header length {n} runs past the end of the file ({size} bytes): truncated "
            f"or not a safetensors file"
        )
    raw = first[8 : 8 + n]
    if len(raw) < n:
        raw += src.read(len(first), 8 + n - len(first))
    return (*parse_header(raw, name, size), first)


def _shard_uri(index: str, root: str, key: str, shard: Any) -> str:
    parts = shard.split("/") if type(shard) is str else []
    if (
        not parts
        or not shard.endswith(".safetensors")
        or shard.startswith("~")
        or any(c in shard for c in ":\\\x00")
        or any(p in ("", ".", "..") for p in parts)
    ):
        raise FormatError(
            f"{index}: tensor {key!r} is mapped to the shard {str(shard)[:200]!r}; a shard must be a "
            f"relative path below the index's directory ending in .safetensors (no '..', absolute path "
            f"or URI)"
        )
    return _uri.join_path(root, *parts)


def read_index(backend: Backend, uri: str) -> tuple[dict[str, Any], dict[str, str]]:
    """The index's metadata and ``{key: shard URI}``, validated."""
    size = backend.stat(uri).size
    if size > MAX_INDEX:
        raise FormatError(f"{uri}: {size} bytes is too large for a shard index (limit {MAX_INDEX})")
    doc = parse_json(backend.read_range(uri, 0, size), uri, "shard index")
    weight_map = doc.get("weight_map") if type(doc) is dict else None
    metadata = doc.get("metadata") if type(doc) is dict else None
    if type(weight_map) is not dict or (metadata is not None and type(metadata) is not dict):
        raise FormatError(
            f'{uri}: not a safetensors shard index (needs a "weight_map" object, and "metadata" '
            f"if present must be an object)"
        )
    root = _uri.parent(uri)
    shards: dict[str, str] = {}
    out = {}
    for key, shard in weight_map.items():
        if type(shard) is not str or shard not in shards:
            shards[shard] = _shard_uri(uri, root, key, shard)
        out[key] = shards[shard]
    return metadata or {}, out


def _torch_layout(e: TensorEntry) -> tuple[str, tuple[int, ...]]:
    import torch

    name = TORCH_NAME.get(e.dtype)
    if name is None or not hasattr(torch, name):
        raise FormatError(
            f"{e.file}: tensor {e.key!r} has dtype {e.dtype}, which this torch ({torch.__version__}) cannot hold"
        )
    shape = e.shape
    if e.dtype == "F4":  # torch packs two 4-bit values in one float4_e2m1fn_x2 element
        if not shape or shape[-1] % 2:
            raise FormatError(
                f"{e.file}: tensor {e.key!r}: an F4 tensor needs an even last dimension, got {list(shape)}"
            )
        shape = (*shape[:-1], shape[-1] // 2)
    return name, shape


def _strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    out, acc = [], 1
    for d in reversed(shape):
        out.append(acc)
        acc *= max(d, 1)
    return tuple(reversed(out))


def _read_data(src: Source, entries: list[TensorEntry], head: bytes) -> dict[int, torch.Tensor]:
    """A whole file not read through a local descriptor (remote, memory://, an open file object): the data
    after the header in one allocation, read straight into it (a remote backend's parallel ranged reads:
    as few requests as ``part_size`` allows, no staging copy); each tensor gets its own storage over its
    bytes, as with a mapping (the memory goes when the last tensor does)."""
    import torch

    start = min((e.offset for e in entries), default=src.size)
    buf = torch.empty(src.size - start, dtype=torch.uint8, device="cpu")
    mv = memoryview(buf.numpy())  # type: ignore[arg-type]  # numpy's stubs: ndarray.__buffer__ on 3.12+ only
    have = max(0, min(len(head) - start, len(mv)))
    mv[:have] = head[start : start + have]  # what the header's read brought along
    got = have + (fill(src.readinto, mv[have:], start + have) if have < len(mv) else 0)
    if got != len(mv):
        raise IntegrityError(f"{src.name}: truncated while reading: bytes [{start}, {src.size}) returned only {got}")
    arr = buf.numpy()
    return {
        i: torch.frombuffer(arr, dtype=torch.uint8, count=e.nbytes, offset=e.offset - start)
        for i, e in enumerate(entries)
        if e.nbytes
    }


def load_source(
    src: Source,
    *,
    keys: Iterable[str] | None = None,
    map_location: Any = None,
    mmap: bool | None = None,
    index: str | None = None,
    whole: bool = False,
) -> dict[str, torch.Tensor]:
    """``{key: tensor}`` from one file; ``index``: the keys come from that shard index; ``whole``: they
    are (about) all of the file's."""
    import torch

    mapped = src.fd is not None if mmap is None else mmap
    _, entries, head = read_header(src)
    if keys is not None:
        by_key = {e.key: e for e in entries}
        picked = []
        for k in _unique_keys(keys):  # a key twice would be two reads of one range
            if k not in by_key:
                if index is not None:
                    raise FormatError(f"{index} maps {k!r} to {src.name}, which has no such tensor")
                raise KeyError(f"no tensor {k!r} in {src.name}")
            picked.append(by_key[k])
        entries = picked
    infos, storages = [], []
    for i, e in enumerate(entries):
        name, shape = _torch_layout(e)
        storages.append((e.offset, e.nbytes, 0, "cpu"))
        infos.append(
            TensorInfo(
                i, e.key, "torch", name, shape, _strides(shape), 0, False, False, i, e.offset, e.nbytes, 0, "cpu"
            )
        )
    meta = Meta(src.name, src.size, 0, storages, infos, {}, b"")
    # empty tensors are not read: at the offset of the next tensor, they would break the coalescing of ranges
    idxs = [i for i, e in enumerate(entries) if e.nbytes]
    if mapped:
        payloads = map_payloads(src, meta, idxs, False)
    elif (keys is None or whole) and src.fd is None:  # not a local file: read whole into one allocation
        payloads = _read_data(src, entries, head)
    else:  # fastpickle's coalesced parallel reads of the ranges needed (preadv into the tensors when local)
        payloads = read_payloads(src, meta, idxs, False)
    for i in idxs:  # views of a mapping or of one buffer must be aligned to their element size
        if payloads[i].data_ptr() % getattr(torch, infos[i].dtype).itemsize:
            payloads[i] = payloads[i].clone()
    payloads.update({i: torch.empty(0, dtype=torch.uint8, device="cpu") for i, e in enumerate(entries) if not e.nbytes})
    make = tensor_factory(meta, payloads, map_location)
    return {e.key: make(i) for i, e in enumerate(entries)}


def _unique_keys(keys: Iterable[str]) -> list[str]:
    if isinstance(keys, str):
        raise TypeError(f"keys must be a list of tensor names, got the string {keys!r}")
    return list(dict.fromkeys(keys))


def load_index(backend: Backend, uri: str, keys: Iterable[str] | None, **kw: Any) -> dict[str, torch.Tensor]:
    _, weight_map = read_index(backend, uri)
    wanted = list(weight_map) if keys is None else _unique_keys(keys)
    by_shard: dict[str, list[str]] = {}
    for k in wanted:
        if k not in weight_map:
            raise KeyError(f"no tensor {k!r} in the shard index {uri}")
        by_shard.setdefault(weight_map[k], []).append(k)
    out: dict[str, torch.Tensor] = {}
    for shard, ks in by_shard.items():
        out.update(
            with_source(
                source_for(backend, shard),
                functools.partial(load_source, keys=ks, index=uri, whole=keys is None, **kw),
            )
        )
    return out if keys is None else {k: out[k] for k in wanted}

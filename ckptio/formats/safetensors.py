"""safetensors (``.safetensors``) and sharded safetensors (``.safetensors.index.json``), without the package.

Layout (https://github.com/huggingface/safetensors)::

    u64 N      little-endian length of the header
    N bytes    JSON object, UTF-8, starts with ``{``, padded with spaces:
               {"__metadata__": {str: str}, KEY: {"dtype": "F32", "shape": [2, 3], "data_offsets": [BEGIN, END]}, ...}
    tensors    raw little-endian bytes; each tensor's [BEGIN, END) is relative to the end of the header

Writing matches ``safetensors.torch.save_file`` byte for byte: tensors ordered by dtype (the
package's enum order, largest first) then key, compact JSON, the header padded to a multiple of 8.
One difference: metadata keys keep the caller's order (the package writes them in hash order, so
its own output varies between runs when there are several).

Reading treats the file as untrusted. Before anything is allocated the header length is checked
against the file and a 100 MB limit, then the header must be a JSON object without duplicate keys,
every dtype known, every shape a list of non-negative integers whose size in bytes is exactly
``END - BEGIN``, and the tensors must cover the data exactly: no gap, no overlap, nothing after the
last one (the package's own rules). Every violation is a :class:`~ckptio.errors.FormatError`
(:class:`~ckptio.errors.IntegrityError` for truncation) naming the file and the key.

Loads reuse fastpickle's sources and the backend's parallel ranged reads. A local file (or node-cache
entry) is mapped privately and each tensor is a copy-on-write view of the mapping (what
``safetensors.torch.load_file`` does; ``mmap=False`` reads into fresh memory with ``preadv``
instead). Any other storage: the header first (one read of the first 256 KiB), then, for a full
load, the rest of the file into one allocation with the backend's ``readinto`` (``part_size``
ranges, ``concurrency`` at a time, no staging copy), each tensor a storage of its own over its
bytes, as with a mapping; with ``keys`` only the byte ranges of those tensors, through fastpickle's
coalesced parallel reads. A tensor stored at an offset that is not a multiple of its element size
is copied into aligned memory.

A sharded checkpoint is loaded by naming its index (``ckptio.load(".../model.safetensors.index.json")``):
the shards it names in ``weight_map`` are read from the index's directory, each only for the keys
the index assigns to it, and returned as one dict. A shard name must be a relative path below that
directory ending in ``.safetensors`` (no ``..``, no absolute path, no URI).
"""

from __future__ import annotations

import ctypes
import functools
import json
import math
import struct
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import IO, Any

import torch

from .. import uri as _uri
from ..backends.base import Backend, WriteMode
from ..errors import FormatError, IntegrityError
from .base import Format

# fastpickle's sources, ranged/mapped payload readers and writer sink: one implementation of parallel
# reads into tensor memory, private mappings and gathered writes for both formats
from .fastpickle.decode import tensor_factory
from .fastpickle.layout import MAX_IOV, Meta, TensorInfo
from .fastpickle.read import Source, map_payloads, open_source, read_payloads, source_for, with_source
from .fastpickle.write import GATHER, WRITE_CHUNK, Sink, sink_for, write_device, writer_for

__all__ = ["SafetensorsFormat", "Inspection", "TensorEntry", "MAX_HEADER", "INDEX_SUFFIX"]

MAX_HEADER = 100_000_000  # the package's limit
MAX_INDEX = 64 << 20  # a shard index is a few MB even for the largest models
MAX_NDIM = 64
HEAD_PREFETCH = 256 << 10  # the first read: the length and, almost always, the whole header
INDEX_SUFFIX = ".safetensors.index.json"

# safetensors dtype -> (bits per element, torch dtype name or None). In the order of the package's
# Dtype enum: save_file writes tensors by descending position in it, then by key.
_DTYPE_TABLE = (
    ("BOOL", 8, "bool"),
    ("F4", 4, "float4_e2m1fn_x2"),
    ("F6_E2M3", 6, None),
    ("F6_E3M2", 6, None),
    ("U8", 8, "uint8"),
    ("I8", 8, "int8"),
    ("F8_E5M2", 8, "float8_e5m2"),
    ("F8_E4M3", 8, "float8_e4m3fn"),
    ("F8_E8M0", 8, "float8_e8m0fnu"),
    ("F8_E4M3FNUZ", 8, "float8_e4m3fnuz"),
    ("F8_E5M2FNUZ", 8, "float8_e5m2fnuz"),
    ("I16", 16, "int16"),
    ("U16", 16, "uint16"),
    ("F16", 16, "float16"),
    ("BF16", 16, "bfloat16"),
    ("I32", 32, "int32"),
    ("U32", 32, "uint32"),
    ("F32", 32, "float32"),
    ("C64", 64, "complex64"),
    ("F64", 64, "float64"),
    ("I64", 64, "int64"),
    ("U64", 64, "uint64"),
)
_BITS = {code: bits for code, bits, _ in _DTYPE_TABLE}
_RANK = {code: i for i, (code, _, _) in enumerate(_DTYPE_TABLE)}
_TORCH_NAME = {code: name for code, _, name in _DTYPE_TABLE if name is not None and hasattr(torch, name)}
_CODE_OF = {getattr(torch, name): code for code, name in _TORCH_NAME.items()}


@dataclass(frozen=True)
class TensorEntry:
    """One tensor as the header describes it (``shape`` as stored: F4 counts 4-bit elements)."""

    key: str
    dtype: str  # safetensors code, e.g. "F32"
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file
    nbytes: int
    file: str

    @property
    def torch_dtype(self) -> str | None:
        """The torch dtype's name (``"float32"``), None where torch has no equivalent."""
        return _TORCH_NAME.get(self.dtype)


@dataclass
class Inspection:
    """What ``ckptio info`` shows: the tensors of a file or of every shard of an index."""

    uri: str
    size: int  # bytes of the file (of the index and all its shards)
    metadata: dict[str, Any]  # the file's __metadata__, or the index's "metadata"
    tensors: list[TensorEntry] = field(default_factory=list)
    files: list[str] = field(default_factory=list)


# ------------------------------------------------------------------------------------------
# reading: header and index
# ------------------------------------------------------------------------------------------
class _DuplicateKey(Exception):
    pass


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise _DuplicateKey(k)
        out[k] = v
    return out


def _parse_json(raw: bytes, name: str, what: str) -> Any:
    try:
        return json.loads(raw.decode("utf-8"), object_pairs_hook=_unique_pairs)
    except _DuplicateKey as e:
        raise FormatError(f"{name}: the {what} has the key {e.args[0]!r} twice") from None
    except UnicodeDecodeError:
        raise FormatError(f"{name}: the {what} is not UTF-8 text") from None
    except (ValueError, RecursionError) as e:  # JSONDecodeError, too many digits, too deep
        raise FormatError(f"{name}: the {what} is not valid JSON ({type(e).__name__}: {e})") from None


def _is_uint(x: Any) -> bool:
    return type(x) is int and 0 <= x < 1 << 63


def parse_header(raw: bytes, name: str, file_size: int) -> tuple[dict[str, str], list[TensorEntry]]:
    """Validate a header (the bytes after the length) against a file of ``file_size`` bytes.

    Returns the metadata and the tensors in file order. Raises FormatError naming ``name`` and the key.
    """
    if not raw.startswith(b"{"):
        raise FormatError(f"{name}: not a safetensors file (the header does not start with '{{')")
    doc = _parse_json(raw, name, "safetensors header")
    if type(doc) is not dict:
        raise FormatError(f"{name}: the safetensors header is not a JSON object")
    metadata = doc.pop("__metadata__", None) or {}
    if type(metadata) is not dict or not all(type(v) is str for v in metadata.values()):
        raise FormatError(f"{name}: __metadata__ must map strings to strings")
    data_start = 8 + len(raw)
    entries: list[TensorEntry] = []
    for key, info in doc.items():

        def bad(what: str, key: str = key) -> FormatError:
            return FormatError(f"{name}: tensor {key!r}: {what}")

        if type(info) is not dict:
            raise bad("its entry is not a JSON object")
        dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if type(dtype) is not str or dtype not in _BITS:
            raise bad(f"unknown dtype {str(dtype)[:40]!r}")
        if type(shape) is not list or len(shape) > MAX_NDIM or not all(_is_uint(d) for d in shape):
            raise bad("shape must be a list of at most 64 non-negative integers")
        if math.prod(max(d, 1) for d in shape) >= 1 << 63:  # an empty tensor too: torch's strides and numel overflow
            raise bad(f"shape {shape} is too large (more than 2**63 elements, not counting empty dimensions)")
        if (
            type(offsets) is not list
            or len(offsets) != 2
            or not all(_is_uint(o) for o in offsets)
            or offsets[0] > offsets[1]
        ):
            raise bad("data_offsets must be [begin, end] with 0 <= begin <= end")
        bits = math.prod(shape) * _BITS[dtype]
        if bits % 8 or bits // 8 != offsets[1] - offsets[0]:
            raise bad(
                f"data_offsets {offsets} hold {offsets[1] - offsets[0]} bytes, but shape {shape} of {dtype} "
                f"needs {bits / 8:g}"
            )
        entries.append(TensorEntry(key, dtype, tuple(shape), data_start + offsets[0], offsets[1] - offsets[0], name))
    entries.sort(key=lambda e: (e.offset, e.nbytes))
    pos = data_start
    for e in entries:
        if e.offset != pos:
            what = "overlaps the tensor before it" if e.offset < pos else "leaves a gap after the tensor before it"
            raise FormatError(
                f"{name}: tensor {e.key!r}: data_offsets {[e.offset - data_start, e.offset - data_start + e.nbytes]} "
                f"{what} (tensors must cover the data exactly)"
            )
        pos += e.nbytes
    if pos > file_size:
        raise IntegrityError(f"{name}: truncated: the tensors end at byte {pos}, the file has {file_size}")
    if pos < file_size:
        raise FormatError(f"{name}: {file_size - pos} bytes after the last tensor (not a valid safetensors file)")
    return metadata, entries


def _read_header(src: Source) -> tuple[dict[str, str], list[TensorEntry], bytes]:
    """Metadata, tensors and the first bytes of the file (one read for all but the largest headers)."""
    name, size = src.name, src.size
    if size < 8:
        raise IntegrityError(f"{name}: {size} bytes is too short for a safetensors file (truncated?)")
    first = src.read(0, min(size, HEAD_PREFETCH))
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


def _read_index(backend: Backend, uri: str) -> tuple[dict[str, Any], dict[str, str]]:
    """The index's metadata and ``{key: shard URI}``, validated."""
    size = backend.stat(uri).size
    if size > MAX_INDEX:
        raise FormatError(f"{uri}: {size} bytes is too large for a shard index (limit {MAX_INDEX})")
    doc = _parse_json(backend.read_range(uri, 0, size), uri, "shard index")
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


# ------------------------------------------------------------------------------------------
# reading: tensors
# ------------------------------------------------------------------------------------------
def _torch_layout(e: TensorEntry) -> tuple[str, tuple[int, ...]]:
    name = _TORCH_NAME.get(e.dtype)
    if name is None:
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
    """A whole remote file: the data after the header in one allocation, read with the backend's parallel
    ranged reads straight into it (as few requests as ``part_size`` allows, no staging copy); each tensor
    gets its own storage over its bytes, as with a mapping (the memory goes when the last tensor does)."""
    start = min((e.offset for e in entries), default=src.size)
    buf = torch.empty(src.size - start, dtype=torch.uint8)
    mv = memoryview(buf.numpy())  # type: ignore[arg-type]  # numpy's stubs: ndarray.__buffer__ on 3.12+ only
    have = max(0, min(len(head) - start, len(mv)))
    mv[:have] = head[start : start + have]  # what the header's read brought along
    got = have + (src.backend.readinto(src.name, mv[have:], start + have) if have < len(mv) else 0)  # type: ignore[attr-defined]
    if got != len(mv):
        raise IntegrityError(f"{src.name}: truncated while reading: bytes [{start}, {src.size}) returned only {got}")
    arr = buf.numpy()
    return {
        i: torch.frombuffer(arr, dtype=torch.uint8, count=e.nbytes, offset=e.offset - start)
        for i, e in enumerate(entries)
        if e.nbytes
    }


def _load_source(
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
    mapped = src.fd is not None if mmap is None else mmap
    _, entries, head = _read_header(src)
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
    elif (keys is None or whole) and hasattr(src, "backend"):
        payloads = _read_data(src, entries, head)
    else:  # fastpickle's coalesced parallel reads of the ranges needed (preadv into the tensors when local)
        payloads = read_payloads(src, meta, idxs, False)
    for i in idxs:  # views of a mapping or of one buffer must be aligned to their element size
        if payloads[i].data_ptr() % getattr(torch, infos[i].dtype).itemsize:
            payloads[i] = payloads[i].clone()
    payloads.update({i: torch.empty(0, dtype=torch.uint8) for i, e in enumerate(entries) if not e.nbytes})
    make = tensor_factory(meta, payloads, map_location)
    return {e.key: make(i) for i, e in enumerate(entries)}


def _unique_keys(keys: Iterable[str]) -> list[str]:
    if isinstance(keys, str):
        raise TypeError(f"keys must be a list of tensor names, got the string {keys!r}")
    return list(dict.fromkeys(keys))


def _load_index(backend: Backend, uri: str, keys: Iterable[str] | None, **kw: Any) -> dict[str, torch.Tensor]:
    _, weight_map = _read_index(backend, uri)
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
                functools.partial(_load_source, keys=ks, index=uri, whole=keys is None, **kw),
            )
        )
    return out if keys is None else {k: out[k] for k in wanted}


# ------------------------------------------------------------------------------------------
# writing
# ------------------------------------------------------------------------------------------
def _prepare(obj: Any, metadata: Mapping[str, str] | None) -> tuple[bytes, list[torch.Tensor]]:
    """The padded header (with its length) and the tensors in file order. TypeError before any write."""
    if not isinstance(obj, Mapping):
        raise TypeError(f"safetensors stores a flat dict[str, Tensor], got {type(obj).__name__}")
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", ())
    items = []
    for key, t in obj.items():
        if type(key) is not str:
            raise TypeError(f"key {key!r}: safetensors keys must be str, got {type(key).__name__}")
        if key == "__metadata__":
            raise TypeError("key '__metadata__' is reserved by safetensors; pass metadata=... instead")
        if not isinstance(t, torch.Tensor):
            hint = " (flatten nested dicts first, e.g. {'a.b': tensor})" if isinstance(t, Mapping) else ""
            raise TypeError(f"key {key!r}: safetensors stores tensors only, got {type(t).__name__}{hint}")
        if t.layout != torch.strided or t.is_quantized or t.is_meta or t.is_nested or isinstance(t, dtensor):
            raise TypeError(
                f"key {key!r}: safetensors stores dense tensors with data, got a {t.layout} "
                f"{'quantized ' if t.is_quantized else ''}{'meta ' if t.is_meta else ''}"
                f"{type(t).__name__} (convert it first, e.g. .to_dense() / .full_tensor())"
            )
        code = _CODE_OF.get(t.dtype)
        if code is None:
            raise TypeError(f"key {key!r}: dtype {t.dtype} has no safetensors equivalent")
        try:
            key.encode("utf-8")
        except UnicodeEncodeError:
            raise TypeError(f"key {key!r} is not valid Unicode text") from None
        t = t.detach().resolve_conj().resolve_neg()
        items.append((key, code, t if t.is_contiguous() else t.contiguous()))
    if metadata is not None:
        if not isinstance(metadata, Mapping):
            raise TypeError(f"metadata must be a dict of str to str, got {type(metadata).__name__}")
        for k, v in metadata.items():
            if type(k) is not str or type(v) is not str:
                raise TypeError(
                    f"metadata[{k!r}]: safetensors metadata maps str to str, got {type(k).__name__}: {type(v).__name__}"
                )
    items.sort(key=lambda it: (-_RANK[it[1]], it[0]))
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


def _write(header: bytes, tensors: list[torch.Tensor], out: Sink) -> None:
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


# ------------------------------------------------------------------------------------------
# the registered format
# ------------------------------------------------------------------------------------------
class SafetensorsFormat(Format):
    """``dump(tensors, uri, metadata=None)``; ``load(uri, keys=None, map_location=None, mmap=None)``.

    ``mmap=None`` maps local files and reads anything else; ``keys`` loads only those tensors
    (KeyError for a key the file lacks). An index URI loads the sharded checkpoint it describes.
    ``allow_pickle`` is accepted as every format takes it; safetensors holds nothing to unpickle.
    """

    name = "safetensors"
    extensions = (".safetensors", INDEX_SUFFIX)
    reads_through_cache = True  # shards are found next to the index, not next to a cache entry

    def dump(  # type: ignore[override]  # its own keywords only: an unknown one is a TypeError, not ignored
        self,
        obj: Any,
        backend: Backend,
        uri: str,
        *,
        mode: WriteMode = "overwrite",
        durable: bool = True,
        metadata: Mapping[str, str] | None = None,
    ) -> None:
        if uri.lower().endswith(INDEX_SUFFIX):
            raise ValueError(
                f"{uri}: writing sharded safetensors is not supported; dump each shard to a .safetensors file"
            )
        header, tensors = _prepare(obj, metadata)  # fails before anything is created
        with backend.open_writer(uri, mode=mode, durable=durable) as w:
            _write(header, tensors, sink_for(w, durable and getattr(backend, "durable", True)))

    def load(  # type: ignore[override]  # its own keywords only, as dump
        self,
        backend: Backend,
        uri: str,
        *,
        keys: Iterable[str] | None = None,
        map_location: Any = None,
        mmap: bool | None = None,
        allow_pickle: bool = False,
    ) -> dict[str, torch.Tensor]:
        if uri.lower().endswith(INDEX_SUFFIX):
            return _load_index(backend, uri, keys, map_location=map_location, mmap=mmap)
        return with_source(
            source_for(backend, uri), lambda src: _load_source(src, keys=keys, map_location=map_location, mmap=mmap)
        )

    def dump_file(self, obj: Any, f: IO, *, metadata: Mapping[str, str] | None = None, **kw: Any) -> None:
        header, tensors = _prepare(obj, metadata)
        _write(header, tensors, Sink(writer_for(f.write)))

    def load_file(  # type: ignore[override]  # its own keywords only, as dump
        self,
        f: IO,
        *,
        keys: Iterable[str] | None = None,
        map_location: Any = None,
        mmap: bool | None = None,
        allow_pickle: bool = False,
    ) -> dict[str, torch.Tensor]:
        return with_source(
            open_source(f, {}), lambda src: _load_source(src, keys=keys, map_location=map_location, mmap=mmap)
        )

    def headers(self, backend: Backend, uri: str) -> Inspection:
        """The header(s), validated; no tensor bytes are read."""
        if not uri.lower().endswith(INDEX_SUFFIX):

            def one(src: Source) -> Inspection:
                metadata, entries, _ = _read_header(src)
                return Inspection(uri, src.size, metadata, entries, [uri])

            return with_source(source_for(backend, uri), one)
        metadata, weight_map = _read_index(backend, uri)
        out = Inspection(uri, backend.stat(uri).size, metadata)
        for shard in dict.fromkeys(weight_map.values()):
            part = self.headers(backend, shard)
            listed = [e for e in part.tensors if weight_map.get(e.key) == shard]
            missing = {k for k, s in weight_map.items() if s == shard} - {e.key for e in listed}
            if missing:
                raise FormatError(f"{uri} maps {sorted(missing)[0]!r} to {shard}, which has no such tensor")
            out.tensors += listed
            out.files.append(shard)
            out.size += part.size
        return out

    def inspect(self, backend: Backend, uri: str) -> dict[str, Any]:
        insp = self.headers(backend, uri)
        tensors = [
            {"key": t.key, "dtype": t.torch_dtype or t.dtype, "shape": list(t.shape), "nbytes": t.nbytes}
            for t in insp.tensors
        ]
        out: dict[str, Any] = {
            "format": "safetensors",
            "tensors": tensors,
            "tensor_bytes": sum(t["nbytes"] for t in tensors),
            "values": insp.metadata,
            "size": insp.size,
        }
        if insp.files != [uri]:
            out["shards"] = len(insp.files)
        return out

    def verify(self, backend: Backend, uri: str) -> dict[str, Any]:
        """Everything safetensors can check: the header(s), offsets, sizes and the shard index."""
        insp = self.headers(backend, uri)
        return {
            "checked": len(insp.files),
            "unchecked": 0,
            "tensors": len(insp.tensors),
            "what": "headers, offsets and sizes of every file (safetensors stores no checksums)",
        }

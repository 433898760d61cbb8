"""fastpickle: a safe, zero-copy, tensor-aware checkpoint format (``.fpk``).

Any training state (nested dicts, lists, tuples, sets, scalars, tensors, numpy arrays, optimizer and
scheduler state dicts) is stored at disk speed, and loading never executes code unless the file was
written with, and is read with, ``allow_pickle=True``.

On-disk layout (all integers little-endian)::

    header   64 B   magic b"\\x89FPKL\\r\\n\\x1a", u16 version, u16 flags, u32 alignment, zeros
    payloads        one per tensor storage / numpy array, raw bytes, each at a 64-byte aligned offset,
                    zero padding between them
    metadata        msgpack map: {"checksum": "xxh3_64", "storages": [[offset, nbytes, xxh3_64, location]],
                    "tensors": [[kind, storage, dtype, shape, stride, storage_offset, flags, path, extra]],
                    "tree": msgpack bytes of the object tree, tensors as references into "tensors"}
    footer   64 B   u64 metadata offset, u64 metadata length, u64 xxh3_64(header + metadata),
                    u64 file size, u16 version, u16 flags, 12 zero bytes, u64 xxh3_64(footer[:48]),
                    magic b"FPKL-END"

The footer is written last, so a file can be streamed to any backend (checksums are computed while
the payloads are written). A reader takes the footer, checks it against the file size (truncation
and trailing bytes), reads and verifies the metadata, validates every offset, size, dtype and shape
against the file before allocating anything, then reads only the payloads it needs.

Containers (dict, list, tuple, set, frozenset, OrderedDict) nest at most MAX_DEPTH deep: the writer
refuses deeper trees, naming the key path, and the reader refuses them too. The tree is decoded
without native recursion (each tuple, set or dict with non-string keys is msgpack inside msgpack).

I/O paths. Save: payloads go out straight from tensor memory, small ones gathered into vectored
writes, checksums on another thread; no staging copy of CPU tensors. Local load: parallel preads
into fresh buffers (populated with one madvise first), each payload verified right after its read,
or a private mapping with ``mmap=True``. Remote full load: the first and last ``part_size`` bytes
are read ahead (header, metadata and end payloads in two requests) and the middle in part-sized
ranged reads, so each byte is fetched once; the header is checked as soon as it lands.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import errno
import functools
import gc
import io
import math
import mmap as _mmap
import os
import pickle
import stat as _stat
import struct
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import IO, Any

import msgpack
import numpy as np
import torch
import xxhash

from .backends.base import Backend, WriteMode
from .backends.local import LocalBackend, local_path, translate_os_errors
from .errors import FormatError, IntegrityError
from .formats.base import Format

__all__ = ["save", "load", "inspect", "FastpickleFormat", "Inspection", "TensorInfo", "PickledObject"]

MAGIC = b"\x89FPKL\r\n\x1a"
FOOTER_MAGIC = b"FPKL-END"
VERSION = 1
ALIGN = 64
HEADER = struct.Struct("<8sHHI48x")
FOOTER = struct.Struct("<QQQQHH12xQ8s")
assert HEADER.size == 64 and FOOTER.size == 64
FLAG_PICKLE = 1

# tensor table kinds and flags
KIND_TORCH, KIND_NUMPY, KIND_QUANT = 0, 1, 2
TF_REQUIRES_GRAD, TF_PARAMETER = 1, 2

# msgpack extension codes of the tree
(
    EXT_TUPLE,
    EXT_ODICT,
    EXT_GDICT,
    EXT_SET,
    EXT_FROZENSET,
    EXT_BIGINT,
    EXT_COMPLEX,
    EXT_TENSOR,
    EXT_DTYPE,
    EXT_DEVICE,
    EXT_SIZE,
    EXT_NPSCALAR,
    EXT_NPDTYPE,
    EXT_PICKLE,
) = range(1, 15)

CHUNK = 64 << 20  # largest single write/read/hash step
# Payloads below GATHER are gathered into vectored writes of about this size (and hashed in batches); larger
# ones are written in WRITE_CHUNK pieces. The kernel sizes page-cache folios by the write's length, and large
# folios need high-order free memory, which a VM that hands free memory back to its host (free page
# reporting) has to fault in again: 10,000 100 KiB tensors gathered into 2 MiB writes took 0.28-1.2 s
# (median 0.6 s in the benchmark), into 256 KiB writes a steady 0.32-0.33 s.
GATHER = 256 << 10
WRITE_CHUNK = 16 << 20
HASH_BATCH = 8 << 20
WRITE_BEHIND = 32 << 20  # durable local saves start writeback after every this many bytes
COALESCE_GAP = 64 << 10  # read across gaps up to this between needed payloads
COALESCE_MAX = 8 << 20  # largest coalesced run of small payloads
MAX_IOV = 512
PREFAULT_MIN = 1 << 20  # local reads into fresh buffers at least this large populate them first
TAIL_PREFETCH = 256 << 10  # remote loads read this much of the end at once: footer and metadata in one request
MAX_NDIM = 64
# Containers (dict, list, tuple, set, frozenset, OrderedDict) nested deeper than this are refused at save
# (ValueError naming the key path) and at load (FormatError). Real training state nests a few levels; the
# bound keeps the encoder and every recursive consumer of a loaded tree far from Python's recursion limit.
MAX_DEPTH = 128

_DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d for d in (getattr(torch, n) for n in dir(torch)) if isinstance(d, torch.dtype)
}
_QUANT_INT = {torch.qint8: torch.int8, torch.quint8: torch.uint8, torch.qint32: torch.int32}
_QUANT_ALL = {d for n, d in _DTYPES.items() if n.startswith(("qint", "quint"))}  # never a plain tensor's dtype
_NP_KINDS = "biufcmMSU"
_INT64_MIN, _INT64_MAX, _UINT64_MAX = -(1 << 63), (1 << 63) - 1, (1 << 64) - 1
_ZEROS = bytes(ALIGN)
_EMPTY_HASH = xxhash.xxh3_64_intdigest(b"")
_pack = functools.partial(msgpack.packb, use_bin_type=True, strict_types=True)


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _path_str(path: Sequence[Any]) -> str:
    return ".".join(map(str, path)) if path else "<root>"


def _short_path(path: Sequence[Any]) -> str:
    """A key path for messages, its middle elided when it is very long."""
    if len(path) <= 12:
        return _path_str(path)
    return f"{_path_str(path[:6])}...({len(path) - 10} more)...{_path_str(path[-4:])}"


# ------------------------------------------------------------------------------------------
# public values returned by inspect() and used as placeholders
# ------------------------------------------------------------------------------------------
@dataclass(slots=True, eq=False)  # cheap to build by the ten thousand; hashable by identity, as tensors are
class TensorInfo:
    """What the file says about one tensor or array, without its bytes."""

    index: int
    path: str  # where it first appears in the tree
    kind: str  # "torch", "numpy" or "quantized"
    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int  # in elements
    requires_grad: bool
    parameter: bool
    storage: int
    offset: int  # byte offset of the storage payload in the file
    nbytes: int  # bytes of the storage payload
    checksum: int
    location: str


@dataclass(frozen=True)
class PickledObject:
    """A value stored with the pickle fallback, as ``inspect`` shows it (never unpickled)."""

    nbytes: int


@dataclass
class Inspection:
    version: int
    file_size: int
    has_pickle: bool
    tree: Any  # the object tree, tensors replaced by TensorInfo
    tensors: list[TensorInfo] = field(default_factory=list)


# ------------------------------------------------------------------------------------------
# encoding
# ------------------------------------------------------------------------------------------
def _tensor_ref(idx: int) -> msgpack.ExtType:
    """A tree node pointing at entry ``idx`` of the tensor table: the index as 4 little-endian bytes."""
    return msgpack.ExtType(EXT_TENSOR, idx.to_bytes(4, "little"))


class _Storage:
    __slots__ = ("data", "nbytes", "location", "offset", "checksum")

    def __init__(self, data: Any, nbytes: int, location: str) -> None:
        self.data = data  # a torch UntypedStorage (any device) or a contiguous numpy uint8 array
        self.nbytes, self.location = nbytes, location
        self.offset = self.checksum = 0


_DTYPE_NAMES = {d: n for n, d in _DTYPES.items()}
_LOCATIONS: dict[torch.device, str] = {}


def _location(dev: torch.device) -> str:
    loc = _LOCATIONS.get(dev)
    if loc is None:
        loc = _LOCATIONS[dev] = str(dev)
    return loc


class _Encoder:
    def __init__(self, allow_pickle: bool) -> None:
        self.allow_pickle = allow_pickle
        self.used_pickle = False
        self.storages: list[_Storage] = []
        self._storage_ids: dict[tuple, int] = {}
        self.tensors: list[list] = []
        self._tensor_ids: dict[int, int] = {}
        self._keep: list[Any] = []  # objects whose id() is a key above, kept alive
        self._active: set[int] = set()

    def encode(self, obj: Any) -> bytes:
        return _pack(self._enc(obj, []))

    def _ext(self, code: int, value: Any) -> msgpack.ExtType:
        return msgpack.ExtType(code, _pack(value))

    def _enc(self, x: Any, path: list) -> Any:
        t = type(x)
        if x is None or t is bool or t is str or t is bytes or t is float:
            return x
        if t is int:
            if _INT64_MIN <= x <= _UINT64_MAX:
                return x
            return msgpack.ExtType(EXT_BIGINT, x.to_bytes((x.bit_length() + 8) // 8, "little", signed=True))
        if t is torch.Tensor or t is torch.nn.Parameter:
            return self._tensor(x, path)
        if t is dict or t is list or t is tuple or t is set or t is frozenset or t is collections.OrderedDict:
            return self._container(x, t, path)
        if t is complex:
            return msgpack.ExtType(EXT_COMPLEX, struct.pack("<dd", x.real, x.imag))
        if t is torch.Size:
            return msgpack.ExtType(EXT_SIZE, _pack(list(x)))
        if t is torch.dtype:
            return msgpack.ExtType(EXT_DTYPE, str(x).removeprefix("torch.").encode())
        if t is torch.device:
            return msgpack.ExtType(EXT_DEVICE, str(x).encode())
        if t is np.ndarray:
            return self._ndarray(x, path)
        if isinstance(x, np.generic) and x.dtype.kind in _NP_KINDS:
            return self._ext(EXT_NPSCALAR, [x.dtype.str, x.tobytes()])
        if t is np.dtype or isinstance(x, np.dtype):
            if x.kind in _NP_KINDS and x.fields is None:
                return msgpack.ExtType(EXT_NPDTYPE, x.str.encode())
        return self._fallback(x, path, f"values of type {t.__module__}.{t.__qualname__}")

    def _container(self, x: Any, t: type, path: list) -> Any:
        if len(path) >= MAX_DEPTH:
            raise ValueError(
                f"fastpickle cannot save containers nested more than {MAX_DEPTH} deep (at "
                f"{_short_path(path)!r}); flatten that part of the state"
            )
        if id(x) in self._active:
            raise ValueError(f"fastpickle cannot save a reference cycle (at {_path_str(path)!r})")
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
                (type(k) is str or type(k) is bytes or (type(k) is int and _INT64_MIN <= k <= _UINT64_MAX)) for k in x
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
                f"fastpickle cannot save {what} (at {_path_str(path)!r}); convert it to supported types "
                f"(dict, list, tuple, set, str, bytes, int, float, bool, None, complex, torch.Tensor, numpy arrays) "
                f"or pass allow_pickle=True (loading then needs allow_pickle=True too)"
            )
        self.used_pickle = True
        try:
            return msgpack.ExtType(EXT_PICKLE, pickle.dumps(x, protocol=pickle.HIGHEST_PROTOCOL))
        except Exception as e:
            raise TypeError(f"cannot pickle {what} (at {_path_str(path)!r}): {e}") from e

    def _add_storage(self, key: tuple | None, data: Any, nbytes: int, location: str) -> int:
        if key is not None and key in self._storage_ids:
            return self._storage_ids[key]
        self.storages.append(_Storage(data, nbytes, location))
        idx = len(self.storages) - 1
        if key is not None:
            self._storage_ids[key] = idx
        return idx

    def _tensor(self, x: torch.Tensor, path: list) -> Any:
        idx = self._tensor_ids.get(id(x))
        if idx is not None:
            return _tensor_ref(idx)
        dev = x.device
        if x.layout is not torch.strided or x.is_nested or dev.type == "meta":
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
            if t.dtype not in _QUANT_INT or qs not in (torch.per_tensor_affine, torch.per_channel_affine):
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
        key = (loc, st.data_ptr(), nbytes) if nbytes else None
        sidx = self._add_storage(key, st, nbytes, loc)
        entry = [
            kind,
            sidx,
            dtype_name,
            list(t.shape),
            list(t.stride()),
            t.storage_offset(),
            flags,
            _path_str(path),
            extra,
        ]
        return self._add_entry(x, entry)

    def _ndarray(self, a: np.ndarray, path: list) -> Any:
        idx = self._tensor_ids.get(id(a))
        if idx is not None:
            return _tensor_ref(idx)
        if a.dtype.kind not in _NP_KINDS or a.dtype.fields is not None or a.dtype.subdtype is not None:
            return self._fallback(a, path, f"numpy arrays of dtype {a.dtype}")
        c = np.ascontiguousarray(a)
        u8 = c.reshape(-1).view(np.uint8)
        sidx = self._add_storage(None, u8, c.nbytes, "cpu")
        entry = [KIND_NUMPY, sidx, a.dtype.str, list(a.shape), [], 0, 0, _path_str(path), None]
        return self._add_entry(a, entry)

    def _add_entry(self, obj: Any, entry: list) -> msgpack.ExtType:
        self.tensors.append(entry)
        self._tensor_ids[id(obj)] = len(self.tensors) - 1
        self._keep.append(obj)
        return _tensor_ref(len(self.tensors) - 1)


# ------------------------------------------------------------------------------------------
# writing
# ------------------------------------------------------------------------------------------
_staging_lock = threading.Lock()
_staging: torch.Tensor | None = None


def _get_staging() -> torch.Tensor:
    """One reused host buffer (pinned when CUDA is present) for copying device tensors out."""
    global _staging
    if _staging is None:
        _staging = torch.empty(CHUNK // 2, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
    return _staging


def _cpu_view(data: Any) -> memoryview:
    """The bytes of a CPU storage or numpy array, without a copy (the caller keeps ``data`` alive)."""
    if isinstance(data, np.ndarray):
        return memoryview(data).cast("B")  # type: ignore[arg-type]  # numpy's stubs: ndarray.__buffer__ on 3.12+ only
    return memoryview((ctypes.c_ubyte * data.nbytes()).from_address(data.data_ptr())).cast("B")


class _Sink:
    """Where a file's bytes go: ``write`` for large buffers, ``writev`` for a batch of small ones.

    A local file is written with ``os.writev`` on its descriptor (thousands of small payloads cost a
    few dozen system calls instead of one each); any other writer gets the pieces one by one (an
    object-store writer copies them into its part buffers anyway). ``write_behind`` (a local file
    that will be fsynced): every WRITE_BEHIND bytes, writeback of what was just written is started
    with ``sync_file_range``, so the disk works while later payloads are copied and the final fsync
    has little left to do.
    """

    def __init__(
        self, write: Callable[[Any], Any], fd: int | None = None, name: str = "", write_behind: bool = False
    ) -> None:
        self._write, self.fd, self.name = write, fd, name
        self._behind = write_behind and _sync_file_range() is not None
        self._pos = self._synced = 0

    def write(self, data: Any) -> None:
        self._write(data)
        self._advance(len(data))

    def writev(self, mvs: list[memoryview], total: int) -> None:
        """Write ``mvs`` (``total`` bytes in all). Called once per GATHER bytes, so errors are translated
        only when there is one (a context manager per call costs more than the call)."""
        if self.fd is None:
            for m in mvs:
                self._write(m)
            return
        try:
            n = os.writev(self.fd, mvs)
            left = total
            while n < left:  # short write (a signal, a full disk): finish or raise
                if n <= 0:
                    raise OSError(errno.EIO, f"{self.name}: a write took no bytes")
                left -= n
                while n >= len(mvs[0]):
                    n -= len(mvs[0])
                    mvs = mvs[1:]
                mvs = [mvs[0][n:], *mvs[1:]]
                n = os.writev(self.fd, mvs)
        except OSError as e:
            with translate_os_errors(self.name):
                raise e
        self._advance(total)

    def _advance(self, n: int) -> None:
        self._pos += n
        if self._behind and self._pos - self._synced >= WRITE_BEHIND:
            # SYNC_FILE_RANGE_WRITE: start writeback, do not wait (fsync at close still makes it durable)
            _sync_file_range()(self.fd, self._synced, self._pos - self._synced, 2)
            self._synced = self._pos


_sfr: Any = None


def _sync_file_range() -> Any:
    global _sfr
    if _sfr is None:
        try:
            fn = ctypes.CDLL(None, use_errno=True).sync_file_range
            fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
            _sfr = fn
        except (OSError, AttributeError):  # not Linux
            _sfr = False
    return _sfr or None


def _sink_for(w: Any, durable: bool) -> _Sink:
    from .backends.local import LocalWriter

    if type(w) is LocalWriter:
        return _Sink(w.write, w.fileno(), w.uri, write_behind=durable)
    return _Sink(w.write, None, w.uri)


def _hash_into(items: list[tuple[_Storage, memoryview]]) -> None:
    for s, mv in items:
        s.checksum = xxhash.xxh3_64_intdigest(mv)


def _write_stream(enc: _Encoder, tree: bytes, out: _Sink) -> int:
    """Write the whole file to ``out``; returns its size.

    Payloads go out straight from tensor memory; small ones are gathered into vectored writes of up
    to GATHER bytes. Checksums are computed on another core, off the write path (large payloads one
    by one, small ones in batches), and only the metadata written at the end waits for them.
    """
    flags = FLAG_PICKLE if enc.used_pickle else 0
    header = HEADER.pack(MAGIC, VERSION, flags, ALIGN)
    pos = HEADER.size
    for s in enc.storages:
        s.offset = _align(pos)
        pos = s.offset + s.nbytes
    pos = HEADER.size
    zeros = memoryview(_ZEROS)
    gather: list[memoryview] = [memoryview(header)]
    gathered = len(header)
    to_hash: list[tuple[_Storage, memoryview]] = []
    hashing = 0
    futures: list[Any] = []
    with ThreadPoolExecutor(1, thread_name_prefix="fpk-hash") as hasher:

        def flush() -> None:
            nonlocal gathered
            if gather:
                out.writev(gather, gathered)
                gather.clear()
                gathered = 0

        for s in enc.storages:
            if s.offset > pos:
                gather.append(zeros[: s.offset - pos])
                gathered += s.offset - pos
            pos = s.offset + s.nbytes
            if s.nbytes == 0:
                s.checksum = _EMPTY_HASH
            elif s.location != "cpu":
                flush()
                s.checksum = _write_device(
                    torch.empty(0, dtype=torch.uint8, device=s.data.device).set_(s.data), out.write
                )
            elif s.nbytes >= GATHER:
                flush()
                mv = _cpu_view(s.data)
                futures.append(hasher.submit(_hash_into, [(s, mv)]))
                step = WRITE_CHUNK if out.fd is not None else s.nbytes  # a remote writer gets it whole (may send it
                for i in range(0, s.nbytes, step):  # straight from tensor memory)
                    out.write(mv[i : i + step])
            else:
                mv = _cpu_view(s.data)
                to_hash.append((s, mv))
                hashing += s.nbytes
                if hashing >= HASH_BATCH:
                    futures.append(hasher.submit(_hash_into, to_hash))
                    to_hash, hashing = [], 0
                gather.append(mv)
                gathered += s.nbytes
                if gathered >= GATHER or len(gather) >= MAX_IOV:
                    flush()
        flush()
        _hash_into(to_hash)
        for fut in futures:
            fut.result()
    meta = _pack(
        {
            "checksum": "xxh3_64",
            "storages": [[s.offset, s.nbytes, s.checksum, s.location] for s in enc.storages],
            "tensors": enc.tensors,
            "tree": tree,
        }
    )
    meta_offset = pos
    size = meta_offset + len(meta) + FOOTER.size
    h = xxhash.xxh3_64()
    h.update(header)
    h.update(meta)
    body = struct.pack("<QQQQHH12x", meta_offset, len(meta), h.intdigest(), size, VERSION, flags)
    footer = FOOTER.pack(
        meta_offset, len(meta), h.intdigest(), size, VERSION, flags, xxhash.xxh3_64_intdigest(body), FOOTER_MAGIC
    )
    out.writev([memoryview(meta), memoryview(footer)], len(meta) + len(footer))
    return size


def _write_device(u8: torch.Tensor, write: Callable[[Any], Any]) -> int:
    """Copy a device storage out through the reused (pinned) staging buffer, hashing as it goes."""
    h = xxhash.xxh3_64()
    with _staging_lock:
        staging = _get_staging()
        smv = memoryview(staging.numpy())  # type: ignore[arg-type]  # numpy's stubs: ndarray.__buffer__ on 3.12+ only
        n = u8.numel()
        for i in range(0, n, len(smv)):
            m = min(len(smv), n - i)
            staging[:m].copy_(u8[i : i + m])  # synchronous: the buffer is reused at once
            h.update(smv[:m])
            write(smv[:m])
    return h.intdigest()


def _writer_for(write: Callable[[Any], Any]) -> Callable[[Any], None]:
    def write_all(data: Any) -> None:
        mv = memoryview(data).cast("B")
        while len(mv):
            n = write(mv)
            if n is None:  # file objects that do not report a count wrote everything
                return
            mv = mv[n:]

    return write_all


def save(
    obj: Any,
    uri_or_file: Any,
    *,
    allow_pickle: bool = False,
    durable: bool = True,
    mode: WriteMode = "overwrite",
    **backend_options: Any,
) -> None:
    """Save ``obj`` to a URI (any backend, committed atomically) or a writable binary file.

    Unsupported value types raise ``TypeError`` naming their key path, unless ``allow_pickle=True``
    pickles them (the file is then marked and needs ``allow_pickle=True`` to load). ``durable=False``
    skips fsync on local files.
    """
    if isinstance(uri_or_file, (str, os.PathLike)):
        from .context import resolve

        backend, uri = resolve(uri_or_file, **backend_options)
        FastpickleFormat().dump(obj, backend, uri, mode=mode, durable=durable, allow_pickle=allow_pickle)
    else:
        with _gc_paused():
            enc, tree = _encode(obj, allow_pickle)
            _write_stream(enc, tree, _Sink(_writer_for(uri_or_file.write)))


def _encode(obj: Any, allow_pickle: bool) -> tuple[_Encoder, bytes]:
    """Encode the tree (fails on unsupported types before anything is written)."""
    enc = _Encoder(allow_pickle)
    return enc, enc.encode(obj)


# ------------------------------------------------------------------------------------------
# reading: sources
# ------------------------------------------------------------------------------------------
class _Source:
    name: str
    size: int
    concurrency = 1
    prefetch = 0  # bytes read speculatively from the end with the footer (saves a request when remote)
    fd: int | None = None

    def readinto(self, mv: memoryview, offset: int) -> int:
        raise NotImplementedError

    def readv(self, mvs: list[memoryview], offset: int) -> int:
        """Fill consecutive buffers from consecutive bytes at ``offset``; returns the bytes read."""
        total = sum(len(m) for m in mvs)
        buf = bytearray(total)
        n = self.readinto(memoryview(buf), offset)
        pos = 0
        for m in mvs:
            m[:] = buf[pos : pos + len(m)]
            pos += len(m)
        return n

    def read(self, offset: int, n: int) -> bytes:
        buf = bytearray(n)
        got = self.readinto(memoryview(buf), offset)
        if got != n:
            raise IntegrityError(f"{self.name}: truncated: wanted bytes [{offset}, {offset + n}), got {got}")
        return bytes(buf)

    def close(self) -> None:
        pass


def _fill(readinto: Callable[[memoryview, int], int], mv: memoryview, offset: int) -> int:
    total = 0
    while total < len(mv):
        n = readinto(mv[total:], offset + total)
        if not n:
            break
        total += n
    return total


class _FdSource(_Source):
    concurrency = 2

    def __init__(self, fd: int, name: str, owned: bool) -> None:
        self.fd, self.name, self._owned = fd, name, owned
        self.size = os.fstat(fd).st_size

    def _fd(self) -> int:
        if self.fd is None:
            raise ValueError(f"{self.name}: read after the source was closed")
        return self.fd

    def readinto(self, mv: memoryview, offset: int) -> int:
        fd = self._fd()
        return _fill(lambda m, o: os.preadv(fd, [m[: 1 << 30]], o), mv, offset)

    def readv(self, mvs: list[memoryview], offset: int) -> int:
        fd = self._fd()
        total, mvs = 0, [m for m in mvs if len(m)]
        while mvs:
            n = os.preadv(fd, mvs, offset + total)
            if n <= 0:
                break
            total += n
            while mvs and n >= len(mvs[0]):
                n -= len(mvs[0])
                mvs.pop(0)
            if mvs and n:
                mvs[0] = mvs[0][n:]
        return total

    def close(self) -> None:
        if self._owned and self.fd is not None:
            os.close(self.fd)
            self.fd = None


class _BackendSource(_Source):
    prefetch = TAIL_PREFETCH

    def __init__(self, backend: Backend, uri: str) -> None:
        self.backend, self.name = backend, uri
        self.size = backend.stat(uri).size
        self.concurrency = backend.concurrency
        self.part_size = backend.part_size
        self._ahead: list[tuple[int, memoryview, Any]] = []  # ranges read ahead: (offset, buffer, future)
        self._pool: ThreadPoolExecutor | None = None

    def read_ahead(self) -> None:
        """For a full load: start fetching the first and the last ``part_size`` bytes, two requests.

        The header, footer and metadata come with them, and so do the payloads at both ends, so a
        full load costs about as many ranged requests as reading the object in ``part_size`` parts.
        Reads of the middle do not wait for them.
        """
        head = min(self.size, self.part_size)
        tail = min(self.size - head, max(self.part_size, self.prefetch))
        ranges = ([(self.size - tail, tail)] if tail else []) + [(0, head)]  # the tail first: it holds the metadata
        self._pool = ThreadPoolExecutor(len(ranges), thread_name_prefix="fpk-ahead")
        for off, n in ranges:
            buf = memoryview(bytearray(n))
            self._ahead.append((off, buf, self._pool.submit(self._fetch, buf, off)))

    def _fetch(self, mv: memoryview, offset: int) -> int:
        return _fill(lambda m, o: self.backend.readinto(self.name, m, o), mv, offset)

    def readinto(self, mv: memoryview, offset: int) -> int:
        lo, hi = offset, offset + len(mv)
        for off, data, fut in self._ahead:  # copy what is read ahead at either end of the request
            end = off + len(data)
            start_in, end_in = off <= lo < end, lo < off < hi <= end
            if (start_in or end_in) and fut.result() != len(data):
                raise IntegrityError(f"{self.name}: truncated: bytes [{off}, {end}) returned only {fut.result()}")
            if start_in:
                k = min(hi, end) - lo
                mv[lo - offset : lo - offset + k] = data[lo - off : lo - off + k]
                lo += k
            if lo < hi and end_in:
                mv[off - offset : hi - offset] = data[: hi - off]
                hi = off
        if lo < hi:
            got = self._fetch(mv[lo - offset : hi - offset], lo)
            if got < hi - lo:
                return lo - offset + got
        return len(mv)

    def close(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        self._ahead = []


class _FileSource(_Source):
    def __init__(self, f: io.RawIOBase | io.BufferedIOBase) -> None:
        self.f, self.name = f, getattr(f, "name", "<file object>")
        self.size = f.seek(0, io.SEEK_END)
        self._lock = threading.Lock()

    def readinto(self, mv: memoryview, offset: int) -> int:
        with self._lock:
            self.f.seek(offset)
            return _fill(lambda m, o: self.f.readinto(m) or 0, mv, offset)


def _open_source(uri_or_file: Any, backend_options: dict) -> _Source:
    if isinstance(uri_or_file, (str, os.PathLike)):
        from .context import resolve

        backend, uri = resolve(uri_or_file, **backend_options)
        return _source_for(backend, uri)
    f = uri_or_file
    try:
        fd = f.fileno()
        if _stat.S_ISREG(os.fstat(fd).st_mode):
            return _FdSource(fd, getattr(f, "name", f"<fd {fd}>"), owned=False)
    except (AttributeError, OSError, io.UnsupportedOperation):
        pass
    return _FileSource(f)


def _source_for(backend: Backend, uri: str) -> _Source:
    if isinstance(backend, LocalBackend):
        with translate_os_errors(uri):
            fd = os.open(local_path(uri), os.O_RDONLY)
        return _FdSource(fd, uri, owned=True)
    as_local = getattr(backend, "as_local", None)  # a node-local cache: read (or map) its entry as a plain file
    if as_local is not None:
        with as_local(uri) as (_local, path), translate_os_errors(uri):
            fd = os.open(path, os.O_RDONLY)  # the open file outlives the entry's pin (eviction only unlinks)
        return _FdSource(fd, uri, owned=True)
    return _BackendSource(backend, uri)


# ------------------------------------------------------------------------------------------
# reading: metadata and validation
# ------------------------------------------------------------------------------------------
@dataclass
class _Meta:
    source: str
    size: int
    flags: int
    storages: list[tuple[int, int, int, str]]
    tensors: list[TensorInfo]
    qparams: dict[int, list]  # quantization parameters by tensor index
    tree: bytes
    check: Callable[[], None] | None = None  # a metadata check still to run (remote full loads)
    all_cpu: bool = True  # every storage was saved from CPU memory


def _read_meta(src: _Source, full: bool = False) -> _Meta:
    """The validated metadata. ``full``: every payload will be read (remote sources may read ahead)."""
    name, size = src.name, src.size
    if size < HEADER.size + FOOTER.size:
        raise IntegrityError(f"{name}: {size} bytes is too short for a fastpickle file (truncated?)")
    # remote sources: the header and a speculative tail (footer + usually all metadata) in parallel
    tail_len = min(size - HEADER.size, max(FOOTER.size, src.prefetch))
    header = b""
    ahead = src if full and isinstance(src, _BackendSource) else None
    deferred = ahead is not None
    if ahead is not None:  # the header is checked once its request is in, while the payloads are being read
        ahead.read_ahead()
        tail = src.read(size - tail_len, tail_len)
    elif src.concurrency > 1 and src.prefetch:
        with ThreadPoolExecutor(2, thread_name_prefix="fpk-meta") as ex:
            head_f = ex.submit(src.read, 0, HEADER.size)
            tail = src.read(size - tail_len, tail_len)
            header = head_f.result()
    else:
        header, tail = src.read(0, HEADER.size), src.read(size - tail_len, tail_len)
    footer = tail[-FOOTER.size :]
    meta_off, meta_len, meta_hash, rec_size, version, flags, foot_hash, magic = FOOTER.unpack(footer)
    if not deferred and header[:8] != MAGIC:
        raise FormatError(f"{name}: not a fastpickle file (bad magic)")
    if magic != FOOTER_MAGIC or xxhash.xxh3_64_intdigest(footer[:48]) != foot_hash:
        if deferred and src.read(0, HEADER.size)[:8] != MAGIC:
            raise FormatError(f"{name}: not a fastpickle file (bad magic)")
        raise IntegrityError(
            f"{name}: no valid footer in the last {FOOTER.size} bytes: the file is truncated or has trailing bytes"
        )
    if version > VERSION:
        raise FormatError(f"{name}: fastpickle version {version} is newer than this reader ({VERSION}); upgrade ckptio")
    if rec_size != size:
        raise IntegrityError(f"{name}: file is {size} bytes but its footer records {rec_size} (truncated or extended)")
    if meta_off < HEADER.size or meta_off + meta_len + FOOTER.size != size:
        raise IntegrityError(f"{name}: metadata range [{meta_off}, {meta_off + meta_len}) does not fit the file")
    if meta_off >= size - tail_len:
        meta_bytes = tail[meta_off - (size - tail_len) : -FOOTER.size]
    else:
        meta_bytes = src.read(meta_off, meta_len)

    def check_header(header: bytes) -> None:
        hmagic, hversion, hflags, align = HEADER.unpack(header)
        if hmagic != MAGIC:
            raise FormatError(f"{name}: not a fastpickle file (bad magic)")
        h = xxhash.xxh3_64()
        h.update(header)
        h.update(meta_bytes)
        if h.intdigest() != meta_hash:
            raise IntegrityError(
                f"{name}: metadata checksum mismatch (header or bytes [{meta_off}, {meta_off + meta_len}))"
            )
        if (hversion, hflags) != (version, flags) or align != ALIGN:
            raise FormatError(f"{name}: header and footer disagree")

    if not deferred:
        check_header(header)
    try:
        try:
            meta = msgpack.unpackb(meta_bytes, raw=False, strict_map_key=False, use_list=True)
            out = _validate(meta, name, size, meta_off, flags)
        except FormatError:
            raise
        except (ValueError, TypeError, KeyError, IndexError, OverflowError, RecursionError) as e:
            raise FormatError(f"{name}: malformed metadata: {_reason(e)}") from e
    except FormatError:
        if deferred:  # a checksum mismatch (corruption) explains malformed metadata better
            check_header(src.read(0, HEADER.size))
        raise
    if deferred:  # verified before anything is decoded or returned; the footer's own checksum held
        out.check = lambda: check_header(src.read(0, HEADER.size))
    return out


def _is_int(x: Any, lo: int = 0, hi: int = _UINT64_MAX) -> bool:
    return type(x) is int and lo <= x <= hi


def _validate(meta: Any, name: str, size: int, data_end: int, flags: int) -> _Meta:
    def bad(what: str) -> FormatError:
        return FormatError(f"{name}: malformed metadata: {what}")

    if type(meta) is not dict or meta.get("checksum") != "xxh3_64":
        raise bad("not a map with checksum 'xxh3_64'")
    storages, tensors, tree = meta.get("storages"), meta.get("tensors"), meta.get("tree")
    if type(storages) is not list or type(tensors) is not list or type(tree) is not bytes:
        raise bad("missing storages, tensors or tree")
    out_s: list[tuple[int, int, int, str]] = []
    prev_end, all_cpu = HEADER.size, True
    for i, s in enumerate(storages):
        if type(s) is not list or len(s) != 4:
            raise bad(f"storage {i} is not a 4-item list")
        off, nbytes, checksum, loc = s
        if not (_is_int(off) and _is_int(nbytes) and _is_int(checksum) and type(loc) is str and len(loc) <= 64):
            raise bad(f"storage {i} has invalid fields")
        if off % ALIGN or off < prev_end or off + nbytes > data_end:
            raise bad(
                f"storage {i} byte range [{off}, {off + nbytes}) is misaligned, overlaps or lies outside "
                f"the payload area [{HEADER.size}, {data_end})"
            )
        prev_end = off + nbytes
        out_s.append((off, nbytes, checksum, loc))
        all_cpu = all_cpu and loc == "cpu"
    out_t: list[TensorInfo] = []
    qparams: dict[int, list] = {}
    nstor, lim, kinds = len(out_s), size * 8, ("torch", "numpy", "quantized")
    for i, e in enumerate(tensors):
        if type(e) is not list or len(e) != 9:
            raise bad(f"tensor {i} is not a 9-item list")
        kind, sidx, dtype, shape, stride, soff, tflags, path, extra = e
        if not (
            type(kind) is int
            and type(sidx) is int
            and type(soff) is int
            and type(tflags) is int
            and 0 <= kind <= 2
            and 0 <= sidx < nstor
            and 0 <= soff <= lim
            and 0 <= tflags <= 3
            and type(dtype) is str
            and type(path) is str
            and type(shape) is list
            and type(stride) is list
            and len(shape) <= MAX_NDIM
            and _dims_ok(shape)
            and _dims_ok(stride)
        ):
            raise bad(f"tensor {i} has invalid fields")
        nbytes = out_s[sidx][1]
        numel = math.prod(shape)
        key = repr(path if len(path) <= 200 else path[:200] + "...")
        if kind == KIND_NUMPY:
            itemsize = _np_dtype(dtype, f"{name}: malformed metadata: array {key}").itemsize
            if not itemsize:  # numpy would allocate the array anyway, one byte per item
                raise bad(f"array {key}: dtype {dtype} has 0 bytes per item")
            if math.prod(d or 1 for d in shape) * itemsize > _INT64_MAX:
                raise bad(f"array {key}: shape {shape} of {dtype} is larger than any array can be")
            if numel * itemsize != nbytes or stride or soff or tflags:
                raise bad(f"array {key}: shape {shape} of {dtype} does not match its {nbytes} bytes")
        else:
            dt = _DTYPES.get(dtype)
            if dt is None or (dt not in _QUANT_INT if kind == KIND_QUANT else dt in _QUANT_ALL):
                raise bad(f"tensor {key}: unknown dtype {dtype[:40]!r}")
            if len(stride) != len(shape):
                raise bad(f"tensor {key}: shape and stride lengths differ")
            if numel > _INT64_MAX:  # a view may repeat its elements (stride 0): only the count is bounded
                raise bad(f"tensor {key}: shape {shape} has more elements than any tensor can have")
            if (
                numel
                and (soff + sum((d - 1) * s for d, s in zip(shape, stride, strict=True)) + 1) * dt.itemsize > nbytes
            ):
                raise bad(
                    f"tensor {key}: shape {shape} stride {stride} offset {soff} exceeds its storage of {nbytes} bytes"
                )
            if tflags & TF_REQUIRES_GRAD and not (dt.is_floating_point or dt.is_complex):
                raise bad(f"tensor {key}: requires_grad on dtype {dtype}")
            if kind == KIND_QUANT:
                # torch copies a quantized tensor out of its integers: no more elements than stored bytes
                if numel * dt.itemsize > nbytes or not _valid_qextra(extra, shape):
                    raise bad(
                        f"tensor {key}: invalid quantization parameters or shape {shape} larger than its {nbytes} bytes"
                    )
                qparams[i] = extra
        off, nb, checksum, loc = out_s[sidx]
        out_t.append(
            TensorInfo(
                i,
                path,
                kinds[kind],
                dtype,
                tuple(shape),
                tuple(stride),
                soff,
                bool(tflags & TF_REQUIRES_GRAD),
                bool(tflags & TF_PARAMETER),
                sidx,
                off,
                nb,
                checksum,
                loc,
            )
        )
    return _Meta(name, size, flags, out_s, out_t, qparams, tree, all_cpu=all_cpu)


def _dims_ok(dims: list) -> bool:
    """Sizes or strides as torch and numpy hold them (products are checked against the stored bytes)."""
    return not dims or (all(type(d) is int for d in dims) and min(dims) >= 0 and max(dims) <= _INT64_MAX)


def _valid_qextra(extra: Any, shape: list) -> bool:
    if type(extra) is not list or not extra:
        return False
    if extra[0] == "per_tensor_affine":
        return len(extra) == 3 and type(extra[1]) is float and _is_int(extra[2], _INT64_MIN, _INT64_MAX)
    if extra[0] == "per_channel_affine" and len(extra) == 4:
        _, scales, zps, axis = extra
        return (
            _is_int(axis, 0, len(shape) - 1)
            and type(scales) is list
            and type(zps) is list
            and len(scales) == len(zps) == shape[axis]
            and all(type(s) is float for s in scales)
            and all(_is_int(z, _INT64_MIN, _INT64_MAX) for z in zps)
        )
    return False


def _np_dtype(s: Any, where: str) -> np.dtype:
    try:
        if type(s) is not str or len(s) > 32:
            raise TypeError("not a short string")
        dt = np.dtype(s)
    except (TypeError, ValueError) as e:
        raise FormatError(f"{where}: invalid numpy dtype {repr(s)[:40]}") from e
    if dt.kind not in _NP_KINDS or dt.fields is not None or dt.subdtype is not None:
        raise FormatError(f"{where}: numpy dtype {s!r} is not allowed")
    return dt


# ------------------------------------------------------------------------------------------
# reading: payloads
# ------------------------------------------------------------------------------------------
def _runs(idxs: list[int], storages: list[tuple[int, int, int, str]], gap: int, limit: int) -> list[list[int]]:
    """Group needed storages (by file order) into runs read with one request each."""
    runs: list[list[int]] = []
    end = size = 0
    for i in sorted(idxs, key=lambda i: storages[i][0]):
        off, nbytes = storages[i][0], storages[i][1]
        if runs and off - end <= gap and size + nbytes <= limit and len(runs[-1]) < MAX_IOV:
            runs[-1].append(i)
            size += nbytes + (off - end)
        else:
            runs.append([i])
            size = nbytes
        end = off + nbytes
    return runs


def _read_payloads(src: _Source, meta: _Meta, idxs: list[int], verify: bool) -> dict[int, torch.Tensor]:
    """Read the given storages into fresh uint8 tensors, in parallel, verifying each as soon as it is read."""
    bufs = {i: torch.empty(meta.storages[i][1], dtype=torch.uint8) for i in idxs}
    # numpy's stubs give ndarray __buffer__ (the buffer protocol) on Python 3.12+ only
    mvs = {i: memoryview(b.numpy()) for i, b in bufs.items()}  # type: ignore[arg-type]
    part = getattr(src, "part_size", CHUNK)
    # local reads scatter straight into the tensors (preadv); remote runs go through a staging buffer, so
    # they are as large as one request (fewer ranged GETs) and staging stays within concurrency * part_size
    limit = COALESCE_MAX if src.fd is not None else max(COALESCE_MAX, part)
    jobs: list[Callable[[], None]] = []
    split: list[int] = []  # payloads read in several pieces: verified once all pieces are in
    for run in _runs(idxs, meta.storages, COALESCE_GAP, limit):
        first = meta.storages[run[0]]
        if len(run) == 1 and first[1] > part:  # one big payload: parallel ranged reads into slices
            split.append(run[0])
            for pos in range(0, first[1], part):
                jobs.append(_job(src, meta, run, [mvs[run[0]][pos : pos + part]], first[0] + pos))
            continue
        views: list[memoryview] = []
        pos = first[0]
        for i in run:
            off, nbytes = meta.storages[i][:2]
            if off > pos:
                views.append(memoryview(bytearray(off - pos)))
            views.append(mvs[i])
            pos = off + nbytes
        jobs.append(_job(src, meta, run, views, first[0], mvs if verify else None))
    _run_jobs(jobs, src.concurrency)
    if verify and split:
        _run_jobs([functools.partial(_verify, meta, [i], mvs) for i in split], 2)
    return bufs


_PAGE = _mmap.PAGESIZE
_MADV_POPULATE_WRITE = 23  # Linux >= 5.14
_libc: Any = None
_populate_ok = sys.platform == "linux"


def _prefault(mv: memoryview) -> None:
    """Fault in a freshly allocated buffer with one ``madvise(MADV_POPULATE_WRITE)`` before reading into it.

    ``pread`` into untouched memory takes one page fault per 4 KiB inside the copy; populating the
    range first does the same work in one call, measurably faster for fresh allocations. Memory that
    is already resident (a reused allocation) is left alone. A no-op where the kernel lacks it.
    """
    global _libc, _populate_ok
    if not _populate_ok or len(mv) < PREFAULT_MIN:
        return
    try:
        if _libc is None:
            _libc = ctypes.CDLL(None, use_errno=True)
            _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            _libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
        ptr = ctypes.addressof(ctypes.c_char.from_buffer(mv))
    except (OSError, AttributeError, TypeError, ValueError):  # no libc symbol, or a read-only buffer
        _populate_ok = False
        return
    start = (ptr + _PAGE - 1) // _PAGE * _PAGE
    end = (ptr + len(mv)) // _PAGE * _PAGE
    if end <= start:
        return
    vec = ctypes.create_string_buffer(1)
    last = end - _PAGE
    if (
        _libc.mincore(start, _PAGE, vec) == 0
        and vec.raw[0] & 1
        and _libc.mincore(last, _PAGE, vec) == 0
        and vec.raw[0] & 1
    ):
        return  # resident already
    if _libc.madvise(start, end - start, _MADV_POPULATE_WRITE) != 0 and ctypes.get_errno() == errno.EINVAL:
        _populate_ok = False  # an older kernel


def _job(
    src: _Source,
    meta: _Meta,
    run: list[int],
    views: list[memoryview],
    offset: int,
    verify: dict[int, memoryview] | None = None,
) -> Callable[[], None]:
    def job() -> None:
        want = sum(len(v) for v in views)
        if src.fd is not None:
            for v in views:
                _prefault(v)
        got = src.readv(views, offset) if len(views) > 1 else src.readinto(views[0], offset)
        if got != want:
            raise IntegrityError(
                f"{meta.source}: truncated while reading {_who(meta, run[0])}: bytes "
                f"[{offset}, {offset + want}) returned only {got}"
            )
        if verify is not None:  # while the bytes are still in cache
            _verify(meta, run, verify)

    return job


def _run_jobs(jobs: list[Callable[[], None]], concurrency: int) -> None:
    if len(jobs) <= 1 or concurrency <= 1:
        for j in jobs:
            j()
        return
    with ThreadPoolExecutor(min(concurrency, len(jobs)), thread_name_prefix="fpk-io") as ex:
        for f in [ex.submit(j) for j in jobs]:
            f.result()


def _who(meta: _Meta, sidx: int) -> str:
    users = [t.path for t in meta.tensors if t.storage == sidx]
    off, nbytes = meta.storages[sidx][:2]
    who = repr(users[0]) if users else f"storage {sidx}"
    more = f" (and {len(users) - 1} more sharing its storage)" if len(users) > 1 else ""
    return f"tensor {who}{more}, bytes [{off}, {off + nbytes})"


def _verify(meta: _Meta, idxs: list[int], mvs: dict[int, memoryview]) -> None:
    for i in idxs:
        if xxhash.xxh3_64_intdigest(mvs[i]) != meta.storages[i][2]:
            raise IntegrityError(f"{meta.source}: checksum mismatch in {_who(meta, i)}")


def _map_payloads(src: _Source, meta: _Meta, idxs: list[int], verify: bool) -> dict[int, torch.Tensor]:
    """Zero-copy, lazy: each storage is a copy-on-write view of a private mapping of the file."""
    if src.fd is None:
        raise ValueError(f"mmap=True needs a local file; {meta.source} is not one (load it without mmap)")
    mm = _mmap.mmap(src.fd, meta.size, access=_mmap.ACCESS_COPY)
    out: dict[int, torch.Tensor] = {}
    for i in idxs:
        off, nbytes = meta.storages[i][:2]
        if nbytes == 0:
            out[i] = torch.empty(0, dtype=torch.uint8)
        else:
            out[i] = torch.frombuffer(mm, dtype=torch.uint8, count=nbytes, offset=off)
    if verify:
        # numpy's stubs give ndarray __buffer__ (the buffer protocol) on Python 3.12+ only
        _verify(meta, idxs, {i: memoryview(t.numpy()) for i, t in out.items()})  # type: ignore[arg-type]
    return out


# ------------------------------------------------------------------------------------------
# reading: building objects
# ------------------------------------------------------------------------------------------
class _Ref:
    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index

    def __hash__(self) -> int:
        return hash((_Ref, self.index))

    def __eq__(self, other: Any) -> bool:
        return type(other) is _Ref and other.index == self.index


_CONTAINER_EXTS = frozenset((EXT_TUPLE, EXT_ODICT, EXT_GDICT, EXT_SET, EXT_FROZENSET))


class _Pending:
    """A container extension whose items hold containers, built later by :func:`_decode_tree`'s loop.

    ``data`` is its msgpack, still to unpack (``items`` stays empty until then), or None once ``items``
    holds the unpacked list. Nested extensions are never unpacked from inside msgpack's ext hook more
    than one level down: each nested ``unpackb`` takes tens of KB of C stack, so a few hundred nested
    tuples used to overflow it (a segfault).
    """

    __slots__ = ("code", "data", "items", "depth", "parent", "slot")

    def __init__(self, code: int, data: bytes | None, items: list) -> None:
        self.code, self.data, self.items = code, data, items
        self.parent: Any = None  # the list or dict holding it, at ``slot``, ``depth`` containers deep
        self.slot: Any = None
        self.depth = 0


_WALK = frozenset((list, dict, _Pending))
_BUILT = frozenset((tuple, set, frozenset, collections.OrderedDict))  # from extensions holding no containers


def _place(top: list | dict, depth: int, placed: list[_Pending]) -> None:
    """Check the nesting below ``top`` (a container at ``depth``); note where each placeholder sits.

    A container whose items hold no list, dict or placeholder is not walked: a long list of numbers
    or a small dict of tensors costs no Python work per item.
    """
    stack = [(top, depth)]
    while stack:
        c, d = stack.pop()
        d += 1  # the depth of c's items
        if _flat(c.values() if type(c) is dict else c, d):
            continue
        if d > MAX_DEPTH:
            raise _too_deep()
        for k, v in c.items() if type(c) is dict else enumerate(c):
            t = type(v)
            if t is list or t is dict:
                if not _flat(v.values() if t is dict else v, d + 1):
                    stack.append((v, d))
            elif t is _Pending:
                v.parent, v.slot, v.depth = c, k, d
                placed.append(v)


def _flat(items: Iterable[Any], d: int) -> bool:
    """Whether ``items`` (at depth ``d``) hold no list, dict or placeholder; raises if they hold containers
    built already deeper than MAX_DEPTH."""
    if not _WALK.isdisjoint(map(type, items)):
        return False
    if d > MAX_DEPTH and not _BUILT.isdisjoint(map(type, items)):
        raise _too_deep()
    return True


def _too_deep() -> FormatError:
    return FormatError(f"containers nested more than {MAX_DEPTH} deep, the most fastpickle supports")


def _build(code: int, items: list) -> Any:
    if code == EXT_TUPLE:
        return tuple(items)
    if code == EXT_SET:
        return set(items)
    if code == EXT_FROZENSET:
        return frozenset(items)
    if len(items) % 2:
        raise FormatError("dict with an odd number of items")
    pairs = zip(items[0::2], items[1::2], strict=True)
    return collections.OrderedDict(pairs) if code == EXT_ODICT else dict(pairs)


def _reason(e: BaseException) -> str:
    """What an exception from decoding says, never an empty string."""
    if isinstance(e, msgpack.StackError):
        return "msgpack data nested more than msgpack's 1024 levels"
    if isinstance(e, msgpack.FormatError):
        return "invalid msgpack data (a reserved type byte)"
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


def _unpack_plain(data: bytes) -> Any:
    """Unpack data that holds no container extensions (an extension comes back as an ExtType)."""
    return msgpack.unpackb(data, raw=False, strict_map_key=False, use_list=True)


def _decode_tree(meta: _Meta, tensor: Callable[[int], Any], allow_pickle: bool, describe: bool = False) -> Any:
    """Decode the object tree; ``tensor(i)`` supplies tensor ``i``. ``describe``: pickles become PickledObject.

    No native recursion: the ext hook unpacks a container extension one level down, where nested
    ones become :class:`_Pending` placeholders. One holding no containers (a tuple of numbers) is
    built at once; any other is placed by :func:`_place`, which checks the depth against the same
    MAX_DEPTH as at save; a loop unpacks and places the placeholders' own placeholders, then builds
    them deepest first, each into its slot.
    """
    ntensors = len(meta.tensors)
    created = 0

    def leaf(code: int, data: bytes) -> Any:
        if code == EXT_TENSOR:
            idx = int.from_bytes(data, "little")
            if len(data) != 4 or idx >= ntensors:
                raise FormatError(f"tensor reference {data!r} out of range")
            return tensor(idx)
        if code == EXT_SIZE:
            dims = _unpack_plain(data)
            if type(dims) is not list or not all(_is_int(d, 0, _UINT64_MAX) for d in dims):
                raise FormatError("torch.Size with non-integer dimensions")
            return torch.Size(dims)
        if code == EXT_BIGINT:
            return int.from_bytes(data, "little", signed=True)
        if code == EXT_COMPLEX:
            re, im = struct.unpack("<dd", data)
            return complex(re, im)
        if code == EXT_DTYPE:
            dt = _DTYPES.get(data.decode())
            if dt is None:
                raise FormatError(f"unknown torch dtype {data[:40]!r}")
            return dt
        if code == EXT_DEVICE:
            return torch.device(data.decode())
        if code == EXT_NPDTYPE:
            return _np_dtype(data.decode(), "numpy dtype value")
        if code == EXT_NPSCALAR:
            v = _unpack_plain(data)
            if type(v) is not list or len(v) != 2:
                raise FormatError("numpy scalar is not a [dtype, bytes] pair")
            dts, raw = v
            npdt = _np_dtype(dts, "numpy scalar")
            if type(raw) is not bytes or len(raw) != npdt.itemsize or not npdt.itemsize:
                raise FormatError(f"numpy scalar of {dts} with {len(raw) if type(raw) is bytes else 'no'} bytes")
            return np.frombuffer(raw, dtype=npdt)[0]
        if code == EXT_PICKLE:
            if describe:
                return PickledObject(len(data))
            if not allow_pickle:  # unreachable through load(), which checks the file flag first
                raise FormatError(f"{meta.source} contains pickled objects; pass allow_pickle=True if you trust it")
            return pickle.loads(data)
        raise FormatError(f"unknown extension type {code}")

    def inner(code: int, data: bytes) -> Any:  # one level down: containers wait for the loop
        nonlocal created
        if code in _CONTAINER_EXTS:
            created += 1
            return _Pending(code, data, [])
        return leaf(code, data)

    def hook(code: int, data: bytes) -> Any:
        nonlocal created
        if code not in _CONTAINER_EXTS:
            return leaf(code, data)
        items = msgpack.unpackb(data, ext_hook=inner, raw=False, strict_map_key=False, use_list=True)
        if type(items) is not list:
            raise FormatError(f"extension {code} does not hold a list")
        if _WALK.isdisjoint(map(type, items)):
            return _build(code, items)
        created += 1
        return _Pending(code, None, items)

    def unpack(data: bytes) -> Any:
        return msgpack.unpackb(data, ext_hook=hook, raw=False, strict_map_key=False, use_list=True)

    try:
        root = [unpack(meta.tree)]
        placed: list[_Pending] = []
        _place(root, 0, placed)
        i = 0
        while i < len(placed):  # placed grows as placeholders' items are placed in turn
            p = placed[i]
            i += 1
            if p.data is not None:
                items = unpack(p.data)
                if type(items) is not list:
                    raise FormatError(f"extension {p.code} does not hold a list")
                p.items, p.data = items, None
            _place(p.items, p.depth, placed)
        if created != len(placed):
            raise FormatError("a tuple, set or dict extension used as a map key")
        by_depth: list[list[_Pending]] = [[] for _ in range(MAX_DEPTH + 1)]
        for p in placed:
            by_depth[p.depth].append(p)
        for level in reversed(by_depth):  # the deepest first: a placeholder's items are built before it
            for p in level:
                p.parent[p.slot] = _build(p.code, p.items)
        return root[0]
    except FormatError as e:
        raise FormatError(f"{meta.source}: malformed tree: {e}") from e
    except (
        ValueError,
        TypeError,
        KeyError,
        IndexError,
        OverflowError,
        RecursionError,
        struct.error,
        UnicodeDecodeError,
        RuntimeError,
    ) as e:
        raise FormatError(f"{meta.source}: malformed tree: {_reason(e)}") from e


def _target_storage(storage: torch.UntypedStorage, location: str, map_location: Any) -> torch.UntypedStorage:
    if callable(map_location):
        out = map_location(storage, location)
        if out is not None:
            return getattr(out, "_untyped_storage", out)
        map_location = None
    if isinstance(map_location, dict):
        target = map_location.get(location, location)
    elif map_location is not None:
        target = str(map_location)
    else:
        target = location
    try:
        dev = torch.device(target)
    except (RuntimeError, TypeError, ValueError) as e:
        raise FormatError(f"invalid device location {target!r}") from e
    if dev.type == "cpu":
        return storage
    try:
        return storage.to(device=dev)
    except Exception as e:  # no such device, or its module is not available here
        raise FormatError(
            f"cannot restore tensors saved on {location!r} to {target!r} ({type(e).__name__}: {e}); "
            f"pass map_location='cpu' or another device"
        ) from e


def _tensor_factory(meta: _Meta, payloads: dict[int, torch.Tensor], map_location: Any) -> Callable[[int], Any]:
    storages: dict[int, torch.UntypedStorage] = {}
    made: dict[int, Any] = {}

    cpu_only = map_location is None or (isinstance(map_location, (str, torch.device)) and str(map_location) == "cpu")

    def storage(sidx: int) -> torch.UntypedStorage:
        st = storages.get(sidx)
        if st is None:
            st = payloads[sidx].untyped_storage()
            if not (cpu_only and meta.storages[sidx][3] == "cpu"):
                st = _target_storage(st, meta.storages[sidx][3], map_location)
            storages[sidx] = st
        return st

    if not (cpu_only and meta.all_cpu):  # devices first: their errors name the file and tensor, not the tree
        for sidx in sorted(payloads.keys() & {t.storage for t in meta.tensors if t.kind != "numpy"}):
            try:
                storage(sidx)
            except FormatError as e:
                raise FormatError(f"{meta.source}: {_who(meta, sidx)}: {e}") from e

    def make(idx: int) -> Any:
        if idx in made:
            return made[idx]
        info = meta.tensors[idx]
        if info.kind == "numpy":
            dt = _np_dtype(info.dtype, meta.source)
            u8 = payloads[info.storage]
            out: Any = u8.numpy().view(dt).reshape(info.shape) if u8.numel() else np.empty(info.shape, dtype=dt)
        elif info.kind == "quantized":
            st = storage(info.storage)
            ints = torch.empty(0, dtype=_QUANT_INT[_DTYPES[info.dtype]], device=st.device).set_(
                st, info.storage_offset, info.shape, info.stride
            )
            q = meta.qparams[idx]
            if q[0] == "per_tensor_affine":
                out = torch._make_per_tensor_quantized_tensor(ints, q[1], q[2])
            else:
                out = torch._make_per_channel_quantized_tensor(
                    ints,
                    torch.tensor(q[1], dtype=torch.float64, device=st.device),
                    torch.tensor(q[2], dtype=torch.int64, device=st.device),
                    q[3],
                )
        else:
            st = storage(info.storage)
            out = torch.empty(0, dtype=_DTYPES[info.dtype], device=st.device).set_(
                st, info.storage_offset, info.shape, info.stride
            )
            if info.parameter:
                out = torch.nn.Parameter(out, requires_grad=info.requires_grad)
            elif info.requires_grad:
                out.requires_grad_(True)
        made[idx] = out
        return out

    return make


# ------------------------------------------------------------------------------------------
# partial loads
# ------------------------------------------------------------------------------------------
def _split_key(key: Any) -> list:
    if isinstance(key, (list, tuple)):
        return list(key)
    if not isinstance(key, str):
        raise TypeError(f"keys must be dotted strings or sequences of path components, got {key!r}")
    return key.split(".") if key else []


def _select(tree: Any, key: Any) -> Any:
    """The subtree at ``key`` (dotted path; dict keys may contain dots, the longest match wins)."""
    parts = _split_key(key)
    node, i = tree, 0
    while i < len(parts):
        part = parts[i]
        if isinstance(node, dict):
            best = None
            for k in node:  # the longest dict key spelled by parts[i:j]
                ks = str(k)
                for j in range(len(parts), i, -1):
                    if ks == ".".join(map(str, parts[i:j])):
                        if best is None or j > best[1]:
                            best = (k, j)
                        break
            if best is None:
                raise KeyError(f"no key {_path_str(parts[: i + 1])!r} in the checkpoint")
            node, i = node[best[0]], best[1]
        elif isinstance(node, (list, tuple)):
            try:
                node = node[int(part)]
            except (ValueError, IndexError):
                raise KeyError(f"no key {_path_str(parts[: i + 1])!r} in the checkpoint") from None
            i += 1
        else:
            raise KeyError(f"no key {_path_str(parts[: i + 1])!r} in the checkpoint")
    return node


def _refs(x: Any, out: set[int]) -> None:
    if type(x) is _Ref:
        out.add(x.index)
    elif isinstance(x, dict):
        for k, v in x.items():
            _refs(k, out)
            _refs(v, out)
    elif isinstance(x, (list, tuple, set, frozenset)):
        for v in x:
            _refs(v, out)


def _substitute(x: Any, make: Callable[[int], Any]) -> Any:
    t = type(x)
    if t is _Ref:
        return make(x.index)
    if t is dict or t is collections.OrderedDict:
        return t((_substitute(k, make), _substitute(v, make)) for k, v in x.items())
    if t is list:
        return [_substitute(v, make) for v in x]
    if t is tuple or t is set or t is frozenset:
        return t(_substitute(v, make) for v in x)
    return x


# ------------------------------------------------------------------------------------------
# load / inspect
# ------------------------------------------------------------------------------------------
def _load_source(
    src: _Source,
    *,
    map_location: Any = None,
    mmap: bool = False,
    keys: Iterable[Any] | None = None,
    verify: bool | None = None,
    allow_pickle: bool = False,
) -> Any:
    meta = _read_meta(src, full=keys is None and not mmap)
    if meta.flags & FLAG_PICKLE and not allow_pickle:
        raise FormatError(
            f"{src.name} contains pickled objects, and unpickling can run arbitrary code; "
            f"pass allow_pickle=True only if you trust the file"
        )
    if verify is None:
        verify = not mmap  # a mapping stays lazy unless verification is asked for
    if keys is not None:
        keys = list(keys)
        skeleton = _decode_tree(meta, _Ref, allow_pickle)
        picked = [(k, _select(skeleton, k)) for k in keys]
        needed: set[int] = set()
        for _, sub in picked:
            _refs(sub, needed)
        sidxs = sorted({meta.tensors[i].storage for i in needed})
    else:
        sidxs = sorted({t.storage for t in meta.tensors})
    reader = _map_payloads if mmap else _read_payloads
    try:
        payloads = reader(src, meta, sidxs, verify)
    finally:
        if meta.check is not None:  # a bad header or metadata checksum is the error to report
            meta.check()
    make = _tensor_factory(meta, payloads, map_location)
    if keys is not None:
        return {(k if isinstance(k, str) else ".".join(map(str, k))): _substitute(sub, make) for k, sub in picked}
    return _decode_tree(meta, make, allow_pickle)


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Building ten thousands of small objects would otherwise trigger full collections over everything."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _with_source(src: _Source, fn: Callable[[_Source], Any]) -> Any:
    try:
        with _gc_paused():
            return fn(src)
    finally:
        src.close()


def load(
    uri_or_file: Any,
    *,
    map_location: Any = None,
    mmap: bool = False,
    keys: Iterable[Any] | None = None,
    verify: bool | None = None,
    allow_pickle: bool = False,
    **backend_options: Any,
) -> Any:
    """Load a fastpickle file from a URI or an open binary file. Never runs code unless ``allow_pickle``.

    ``map_location`` works like ``torch.load``'s (device, string, dict of locations, or
    ``fn(storage, location)``). ``mmap=True`` (local files) returns zero-copy, lazily paged views of
    the file. ``keys=["model.fc.weight", "optim"]`` reads only the byte ranges those subtrees need and
    returns ``{key: value}``; dict keys may themselves contain dots. Payload checksums are verified
    unless ``verify=False`` (with ``mmap=True`` only when ``verify=True``, since it reads every page);
    the metadata checksum is always verified.
    """
    return _with_source(
        _open_source(uri_or_file, backend_options),
        lambda src: _load_source(
            src, map_location=map_location, mmap=mmap, keys=keys, verify=verify, allow_pickle=allow_pickle
        ),
    )


def inspect(uri_or_file: Any, **backend_options: Any) -> Inspection:
    """The tree (tensors replaced by :class:`TensorInfo`) and the tensor table; reads no tensor bytes."""

    def run(src: _Source) -> Inspection:
        meta = _read_meta(src)
        tree = _decode_tree(meta, meta.tensors.__getitem__, allow_pickle=False, describe=True)
        return Inspection(VERSION, meta.size, bool(meta.flags & FLAG_PICKLE), tree, meta.tensors)

    return _with_source(_open_source(uri_or_file, backend_options), run)


# ------------------------------------------------------------------------------------------
# the registered format
# ------------------------------------------------------------------------------------------
class FastpickleFormat(Format):
    """``.fpk`` for :func:`ckptio.dump` / :func:`ckptio.load`; options as for :func:`save` / :func:`load`."""

    name = "fastpickle"
    extensions = (".fpk",)

    def dump(
        self,
        obj: Any,
        backend: Backend,
        uri: str,
        *,
        mode: WriteMode = "overwrite",
        durable: bool = True,
        allow_pickle: bool = False,
        **kwargs: Any,
    ) -> None:
        if kwargs:
            raise TypeError(f"fastpickle dump got unexpected options {sorted(kwargs)}")
        with _gc_paused():
            enc, tree = _encode(obj, allow_pickle)  # fails before anything is created
            with backend.open_writer(uri, mode=mode, durable=durable) as w:
                _write_stream(enc, tree, _sink_for(w, durable and getattr(backend, "durable", True)))

    def load(self, backend: Backend, uri: str, **kwargs: Any) -> Any:
        return _with_source(_source_for(backend, uri), lambda src: _load_source(src, **kwargs))

    def dump_file(self, obj: Any, f: IO, **kwargs: Any) -> None:
        save(obj, f, **kwargs)

    def load_file(self, f: IO, **kwargs: Any) -> Any:
        return load(f, **kwargs)

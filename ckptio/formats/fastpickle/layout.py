"""The ``.fpk`` byte layout: constants, header/footer structs, dtype tables, what ``inspect`` returns,
and the validation of a file's metadata tables against the file.

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
"""

from __future__ import annotations

import functools
import math
import operator
import re
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgpack
import numpy as np

from ...errors import FormatError

if TYPE_CHECKING:
    import torch

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
MAX_IOV = 512  # most buffers in one vectored read or write
MAX_NDIM = 64

# Containers (dict, list, tuple, set, frozenset, OrderedDict) nested deeper than this are refused at save
# (ValueError naming the key path) and at load (FormatError). Real training state nests a few levels; the
# bound keeps the encoder and every recursive consumer of a loaded tree far from Python's recursion limit.
MAX_DEPTH = 128

# Every torch dtype a tensor may be stored with: name -> (bytes per element, "f" floating point, "c" complex,
# "q" quantized, "o" other). Without torch: inspecting a file (``ckptio info``) does not import it. The
# tests check it against torch's own dtypes; torch's dtype objects are DTYPES/QUANT_INT, made on first use.
ELEMENTS: dict[str, tuple[int, str]] = {
    **dict.fromkeys(("bool", "int8", "uint8", "bits8", "bits1x8", "bits2x4", "bits4x2"), (1, "o")),
    **{f"{u}int{b}": (1, "o") for u in ("", "u") for b in range(1, 8)},
    **{"int16": (2, "o"), "uint16": (2, "o"), "bits16": (2, "o"), "int32": (4, "o"), "uint32": (4, "o")},
    **{"int64": (8, "o"), "uint64": (8, "o")},
    **dict.fromkeys(("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz"), (1, "f")),
    **{"float8_e8m0fnu": (1, "f"), "float4_e2m1fn_x2": (1, "f"), "float16": (2, "f"), "bfloat16": (2, "f")},
    **{"float32": (4, "f"), "float64": (8, "f"), "complex32": (4, "c"), "complex64": (8, "c")},
    **{"complex128": (16, "c"), "qint8": (1, "q"), "quint8": (1, "q"), "qint32": (4, "q")},
    **{"quint4x2": (1, "q"), "quint2x4": (1, "q")},
}
QUANT_INT_NAMES = {"qint8": "int8", "quint8": "uint8", "qint32": "int32"}  # the quantized dtypes a file may hold
NP_KINDS = "biufcmMSU"
INT64_MIN, INT64_MAX, UINT64_MAX = -(1 << 63), (1 << 63) - 1, (1 << 64) - 1
pack = functools.partial(msgpack.packb, use_bin_type=True, strict_types=True)


@functools.cache
def _torch_tables() -> tuple[dict[str, torch.dtype], dict[torch.dtype, torch.dtype]]:
    import torch

    dtypes = {
        str(d).removeprefix("torch."): d for d in (getattr(torch, n) for n in dir(torch)) if isinstance(d, torch.dtype)
    }
    return dtypes, {dtypes[q]: dtypes[i] for q, i in QUANT_INT_NAMES.items()}


def __getattr__(name: str) -> Any:
    """``DTYPES`` (name -> torch dtype) and ``QUANT_INT`` (quantized -> its integer dtype): import torch."""
    if name == "DTYPES":
        return _torch_tables()[0]
    if name == "QUANT_INT":
        return _torch_tables()[1]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def path_str(path: Sequence[Any]) -> str:
    return ".".join(map(str, path)) if path else "<root>"


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
# the validated metadata
# ------------------------------------------------------------------------------------------
@dataclass
class Meta:
    source: str
    size: int
    flags: int
    storages: list[tuple[int, int, int, str]]
    tensors: list[TensorInfo]
    qparams: dict[int, list]  # quantization parameters by tensor index
    tree: bytes
    check: Callable[[], None] | None = None  # a metadata check still to run (remote full loads)
    all_cpu: bool = True  # every storage was saved from CPU memory


def is_int(x: Any, lo: int = 0, hi: int = UINT64_MAX) -> bool:
    return type(x) is int and lo <= x <= hi


def validate(meta: Any, name: str, size: int, data_end: int, flags: int) -> Meta:
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
        # inline, not is_int(): this loop and the next run once per storage and tensor of every load
        if not (
            type(off) is int
            and type(nbytes) is int
            and type(checksum) is int
            and nbytes >= 0
            and 0 <= checksum <= UINT64_MAX
            and type(loc) is str
            and len(loc) <= 64
        ):
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
        if kind == KIND_NUMPY:
            itemsize = np_dtype(dtype, f"{name}: malformed metadata: array {_key(path)}").itemsize
            if not itemsize:  # numpy would allocate the array anyway, one byte per item
                raise bad(f"array {_key(path)}: dtype {dtype} has 0 bytes per item")
            if math.prod(d or 1 for d in shape) * itemsize > INT64_MAX:
                raise bad(f"array {_key(path)}: shape {shape} of {dtype} is larger than any array can be")
            if numel * itemsize != nbytes or stride or soff or tflags:
                raise bad(f"array {_key(path)}: shape {shape} of {dtype} does not match its {nbytes} bytes")
        else:
            el = ELEMENTS.get(dtype)
            if el is None or (dtype not in QUANT_INT_NAMES if kind == KIND_QUANT else el[1] == "q"):
                raise bad(f"tensor {_key(path)}: unknown dtype {dtype[:40]!r}")
            itemsize, ekind = el
            if len(stride) != len(shape):
                raise bad(f"tensor {_key(path)}: shape and stride lengths differ")
            if numel > INT64_MAX:  # a view may repeat its elements (stride 0): only the count is bounded
                raise bad(f"tensor {_key(path)}: shape {shape} has more elements than any tensor can have")
            # the last element's offset: sum((d - 1) * s) over the dimensions, without a Python-level loop
            # (map() stops at the shorter list: this relies on the length check just above)
            if numel and (soff + sum(map(operator.mul, shape, stride)) - sum(stride) + 1) * itemsize > nbytes:
                raise bad(
                    f"tensor {_key(path)}: shape {shape} stride {stride} offset {soff} exceeds its storage of "
                    f"{nbytes} bytes"
                )
            if tflags & TF_REQUIRES_GRAD and ekind not in ("f", "c"):
                raise bad(f"tensor {_key(path)}: requires_grad on dtype {dtype}")
            if kind == KIND_QUANT:
                # torch copies a quantized tensor out of its integers: no more elements than stored bytes
                if numel * itemsize > nbytes or not _valid_qextra(extra, shape):
                    raise bad(
                        f"tensor {_key(path)}: invalid quantization parameters or shape {shape} larger than its "
                        f"{nbytes} bytes"
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
    return Meta(name, size, flags, out_s, out_t, qparams, tree, all_cpu=all_cpu)


def _key(path: str) -> str:
    """A tensor's path for an error message (built only when there is one)."""
    return repr(path if len(path) <= 200 else path[:200] + "...")


def _dims_ok(dims: list) -> bool:
    """Sizes or strides as torch and numpy hold them (products are checked against the stored bytes)."""
    for d in dims:  # a plain loop: a third of the time of all() over a generator, for a dimension or two
        if type(d) is not int or d < 0 or d > INT64_MAX:
            return False
    return True


def _valid_qextra(extra: Any, shape: list) -> bool:
    if type(extra) is not list or not extra:
        return False
    if extra[0] == "per_tensor_affine":
        return len(extra) == 3 and type(extra[1]) is float and is_int(extra[2], INT64_MIN, INT64_MAX)
    if extra[0] == "per_channel_affine" and len(extra) == 4:
        _, scales, zps, axis = extra
        return (
            is_int(axis, 0, len(shape) - 1)
            and type(scales) is list
            and type(zps) is list
            and len(scales) == len(zps) == shape[axis]
            and all(type(s) is float for s in scales)
            and all(is_int(z, INT64_MIN, INT64_MAX) for z in zps)
        )
    return False


_NP_DTYPE_NAME = re.compile(r"[<>|=]?[a-zA-Z]+[0-9]*(\[[a-zA-Z0-9]+\])?")  # "<f8", "U10", "M8[ns]", "bool"


def np_dtype(s: Any, where: str) -> np.dtype:
    try:
        if type(s) is not str or len(s) > 32:
            raise TypeError("not a short string")
        if not _NP_DTYPE_NAME.fullmatch(s):  # numpy parses "a,b" and "(2,)i4" as structured/subarray dtypes
            raise ValueError("not a plain dtype name")
        dt = np.dtype(s)
    except (TypeError, ValueError, SyntaxError) as e:
        raise FormatError(f"{where}: invalid numpy dtype {repr(s)[:40]}") from e
    if dt.kind not in NP_KINDS or dt.fields is not None or dt.subdtype is not None:
        raise FormatError(f"{where}: numpy dtype {s!r} is not allowed")
    return dt


def describe_payload(meta: Meta, sidx: int) -> str:
    users = [t.path for t in meta.tensors if t.storage == sidx]
    off, nbytes = meta.storages[sidx][:2]
    who = repr(users[0]) if users else f"storage {sidx}"
    more = f" (and {len(users) - 1} more sharing its storage)" if len(users) > 1 else ""
    return f"tensor {who}{more}, bytes [{off}, {off + nbytes})"


def reason(e: BaseException) -> str:
    """What an exception from decoding says, never an empty string."""
    if isinstance(e, msgpack.StackError):
        return "msgpack data nested more than msgpack's 1024 levels"
    if isinstance(e, msgpack.FormatError):
        return "invalid msgpack data (a reserved type byte)"
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__

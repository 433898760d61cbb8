"""The safetensors layout: the size limits, the dtype table (safetensors code, bits per element,
torch dtype) in the package's enum order, :class:`TensorEntry` and :class:`Inspection`, and the
validation of a header (:func:`parse_header`) against the rules in :mod:`ckptio.formats.safetensors`.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass, field
from typing import Any

from ...errors import FormatError, IntegrityError

MAX_HEADER = 100_000_000  # the package's limit
MAX_INDEX = 64 << 20  # a shard index is a few MB even for the largest models
MAX_NDIM = 64
HEAD_PREFETCH = 256 << 10  # the first read: the length and, almost always, the whole header
INDEX_SUFFIX = ".safetensors.index.json"

# safetensors dtype -> (bits per element, torch dtype name or None). In the order of the package's
# Dtype enum: save_file writes tensors by descending position in it, then by key.
DTYPE_TABLE = (
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
BITS = {code: bits for code, bits, _ in DTYPE_TABLE}
RANK = {code: i for i, (code, _, _) in enumerate(DTYPE_TABLE)}
# the torch dtype of each code, by name (without torch: ``ckptio info`` does not import it); a torch too old
# for one is told at load (read._torch_layout)
TORCH_NAME = {code: name for code, _, name in DTYPE_TABLE if name is not None}


@functools.cache
def _code_of() -> dict[Any, str]:
    import torch

    return {getattr(torch, n): code for code, n in TORCH_NAME.items() if hasattr(torch, n)}


def __getattr__(name: str) -> Any:
    """``CODE_OF``: torch dtype -> safetensors code, of the dtypes this torch has (imports torch)."""
    if name == "CODE_OF":
        return _code_of()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
        """The torch dtype's name (``"float32"``), None where torch has no equivalent (F6); one a torch
        older than the dtype lacks is refused at load."""
        return TORCH_NAME.get(self.dtype)


@dataclass
class Inspection:
    """What ``ckptio info`` shows: the tensors of a file or of every shard of an index."""

    uri: str
    size: int  # bytes of the file (of the index and all its shards)
    metadata: dict[str, Any]  # the file's __metadata__, or the index's "metadata"
    tensors: list[TensorEntry] = field(default_factory=list)
    files: list[str] = field(default_factory=list)


class _DuplicateKey(Exception):
    pass


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise _DuplicateKey(k)
        out[k] = v
    return out


def parse_json(raw: bytes, name: str, what: str) -> Any:
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
    doc = parse_json(raw, name, "safetensors header")
    if type(doc) is not dict:
        raise FormatError(f"{name}: the safetensors header is not a JSON object")
    metadata = doc.pop("__metadata__", None)  # null is absent, as for the package; [], 0, "" are not
    if metadata is None:
        metadata = {}
    elif type(metadata) is not dict or not all(type(v) is str for v in metadata.values()):
        raise FormatError(
            f"{name}: __metadata__ must be a JSON object of strings to strings, got {json.dumps(metadata)[:80]} "
            f"(not a valid safetensors file)"
        )
    data_start = 8 + len(raw)
    entries: list[TensorEntry] = []
    for key, info in doc.items():

        def bad(what: str, key: str = key) -> FormatError:
            return FormatError(f"{name}: tensor {key!r}: {what}")

        if type(info) is not dict:
            raise bad("its entry is not a JSON object")
        dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if type(dtype) is not str or dtype not in BITS:
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
        bits = math.prod(shape) * BITS[dtype]
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

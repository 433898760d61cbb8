"""What :mod:`ckptio.dcp`'s reader checks before it reads a checkpoint's items: nothing runs, nothing huge is allocated.

**Non-tensor items.** DCP stores each non-tensor value (an int step, an optimizer's
``param_groups``, an ``io.BytesIO``, any object) as a ``torch.save`` archive, a BYTE_IO item, and
torch's ``DefaultLoadPlanner.load_bytes`` (like every planner torch ships) reads it back with
``torch.load(weights_only=False)``: a plain unpickle that runs whatever the file names. The reader
hands an item to the planner only after :func:`pickle_problem` found nothing, whatever planner the
caller uses (``allow_pickle=True`` skips the check for checkpoints you trust). An item passes when

* it is a ``torch.save`` zip archive (a legacy or non-zip stream would be unpickled by plain
  ``pickle`` before any zip is looked at) and not a TorchScript archive (``torch.load`` hands those
  to ``torch.jit.load``);
* its pickle parses, memoizes at no index beyond its position in the pickle (the C unpickler
  sizes its memo array by the largest index, so 8 bytes of pickle could make it allocate and clear
  32 GiB), applies ``BUILD`` to no global and calls nothing that allocates from a small argument
  (``bytearray(n)``, ``torch.FloatTensor(n)``, which torch's allow-list admits):
  :func:`ckptio.formats.torch.pickle_problem`;
* and ``torch.load(weights_only=True)`` loads it (torch's restricted unpickler: containers,
  numbers, strings, bytes, tensors, ``torch.Size``, dtypes, devices, ``OrderedDict``/``Counter``/
  ``set``, plus whatever the process registered with ``torch.serialization.add_safe_globals``), or it
  is a plain ``io.BytesIO`` (DCP's own leaf type, refused by that unpickler), checked with the C
  unpickler allowing only ``_io.BytesIO`` and ``_codecs.encode``.

Why the planner's full unpickle of the same bytes is then safe: a pickle is a straight-line
program (no branches, no loops), so both unpicklers run the same opcodes in the same order (only
protocol-2 opcodes: the restricted unpickler knows no others, e.g. no EXT codes, which the C
unpickler may serve from a cache without resolving a name), and torch.load goes down the same path
(zip, same ``data.pkl`` record, same ``persistent_load``, ``encoding="utf-8"``). Code
runs only where an opcode calls something: GLOBAL resolves a name, REDUCE/NEWOBJ call a stack
object, BUILD calls ``__setstate__`` or sets attributes, APPEND(S)/SETITEM(S) call the container's
methods, persistent ids load storages. The restricted unpickler admits GLOBAL only for its
allow-list, calls only allow-listed callables, BUILDs only tensors, parameters, ``OrderedDict``
and allow-listed classes, appends only to lists and sets items only on dicts, and loads only
storages, so the full unpickle calls the same functions on the same kinds of objects. The one
place the two could differ is name resolution (a lookup in the allow-list by ``module.name``
against an import): every callable on torch's default allow-list resolves, through torch.load's
own ``find_class``, to the same object or fails (tests/test_dcp_trust.py checks each one, for
pickle protocols 2 and 4). Registrations with ``add_safe_globals`` are trusted, as torch trusts
them; one made as ``(obj, "module.name")`` lets the check see ``obj`` where the full unpickle
imports ``module.name``. Numpy scalars and arrays are refused by default: numpy's unpickling builds dtypes from
flags in the file (see :mod:`ckptio.formats.safepickle`).

**Sizes.** Nothing is allocated from a number in ``.metadata`` before it is checked against what
is stored: every storage entry a load reads must have non-negative integer ``offset``/``length``
inside its data object (one ``stat`` per object), must not overlap another entry of the same
object, and, when ckptio wrote it, a torch dtype, a shape whose size is its ``nbytes``, tensor
bytes inside the item and one checksum per block (:func:`entry_problem`); a read of part of a
tensor must lie inside the stored shape (:func:`box_problem`); a tensor the Checkpointer creates
from the metadata must be backed by the stored bytes of its chunks (:func:`tensor_problem`).
Anything handed to ``torch.load`` (torch-written tensors, non-tensor items) must be a zip whose
records are stored uncompressed and fit in the item together (:func:`zip_problem`): torch
allocates each record's size as its zip header states it. Items with torch's stream transforms
(``transform_descriptors``, e.g. zstd) are decompressed by torch's extension and not bounded here.
"""

from __future__ import annotations

import io
import math
import pickle
import zipfile
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex

from .. import torch_internals as _ti
from ..backends.readers import BytesReader
from ..formats.torch import pickle_problem as _scan_problem

__all__ = ["box_problem", "entry_problem", "pickle_problem", "tensor_problem", "zip_problem"]

_ZIP_MAGIC = b"PK\x03\x04"  # torch.load reads anything else as a legacy (plain pickle) file
_BYTESIO_GLOBALS = frozenset({("_io", "BytesIO"), ("_codecs", "encode")})


def zip_problem(data: Any) -> str | None:
    """Why ``torch.load`` must not be given ``data`` (it could allocate far more than ``data``); None if it may."""
    if bytes(data[:4]) != _ZIP_MAGIC:
        return "is not a torch.save zip archive"
    try:
        records = zipfile.ZipFile(BytesReader(data)).infolist()
    except Exception as e:  # noqa: BLE001 - BadZipFile, ValueError, OSError, NotImplementedError...
        return f"is not a readable zip archive ({type(e).__name__}: {e})"
    for r in records:
        if r.compress_type != zipfile.ZIP_STORED or r.file_size != r.compress_size:
            return f"has a compressed zip record {r.filename!r} (torch.save stores records uncompressed)"
    if sum(r.file_size for r in records) > len(data):
        return "has zip records larger together than the item"
    return None


def pickle_problem(data: Any) -> str | None:
    """Why unpickling the BYTE_IO item ``data`` (a zip: see :func:`zip_problem`) could run code; None if it cannot.

    See the module docstring: None means torch.load's full unpickle of ``data`` calls only what
    ``torch.load(weights_only=True)`` calls (or builds only a plain ``io.BytesIO``).
    """
    try:
        archive = _ti.PyTorchFileReader(BytesReader(data))
        records = archive.get_all_records()
        pkl = archive.get_record("data.pkl")
    except Exception as e:  # noqa: BLE001 - torch raises RuntimeError for a bad archive
        return f"is not a readable torch.save archive ({type(e).__name__}: {_first_line(e)})"
    if "constants.pkl" in records:
        return "is a TorchScript archive (torch.load runs it with torch.jit.load)"
    why = _scan_problem(pkl, len(data))
    if why is not None:
        return why
    try:
        torch.load(BytesReader(data), map_location="cpu", weights_only=True)  # type: ignore[arg-type]  # a binary file object
        return None
    except Exception as e:  # noqa: BLE001 - whatever the restricted load refuses is refused
        refused = e
    if _is_plain_bytesio(pkl):
        return None
    unsafe = _unsafe_globals(data)
    if unsafe:
        return f"refers to {', '.join(unsafe)}, which torch.load(weights_only=True) does not allow"
    return f"is refused by torch.load(weights_only=True) ({type(refused).__name__}: {_first_line(refused)})"


def _unsafe_globals(data: Any) -> list[str]:
    try:
        return torch.serialization.get_unsafe_globals_in_checkpoint(BytesReader(data))  # type: ignore[arg-type]  # a binary file object
    except Exception:  # noqa: BLE001 - torch < 2.5, or a pickle it cannot scan: the caller reports the load error
        return []


def _first_line(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return (lines[-1] if lines else "")[:300]


class _BytesIOUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _BYTESIO_GLOBALS:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("persistent id")


def _is_plain_bytesio(pkl: bytes) -> bool:
    """Whether ``pkl`` (a data.pkl) builds an ``io.BytesIO`` (no instance attributes) from bytes and nothing else."""
    try:
        obj = _BytesIOUnpickler(io.BytesIO(pkl), encoding="utf-8").load()
    except Exception:  # noqa: BLE001 - anything else is not a plain BytesIO
        return False
    return type(obj) is io.BytesIO and not vars(obj)


def _natural(v: Any) -> bool:
    return type(v) is int and v >= 0


def entry_problem(sinfo: Any, tensor: bool, default_block: int) -> str | None:
    """Why the storage entry ``sinfo`` (a ``_StorageInfo`` from ``.metadata``) is malformed; None if it is sound.

    ``tensor``: the entry holds a tensor (else a BYTE_IO item); ``default_block``: the checksum
    block size when the entry records none. No I/O: the caller checks the entry against its data
    object's size.
    """
    for field in ("offset", "length"):
        v = getattr(sinfo, field, None)
        if not _natural(v):
            return f"has {field} {v!r}, not a non-negative int"
    info = getattr(sinfo, "ckptio", None)
    if info is None or getattr(sinfo, "transform_descriptors", None):
        return None
    if not isinstance(info, dict):
        return f"has a ckptio record that is a {type(info).__name__}, not a dict"
    covered = sinfo.length
    if tensor:
        start, nbytes, name, shape = (info.get(k) for k in ("data", "nbytes", "dtype", "shape"))
        if not (_natural(start) and _natural(nbytes)):
            return f"has tensor data at {start!r} of {nbytes!r} bytes, not non-negative ints"
        dtype = getattr(torch, name, None) if isinstance(name, str) else None
        if not isinstance(dtype, torch.dtype):
            return f"has dtype {name!r}, not a torch dtype"
        if not isinstance(shape, (list, tuple)) or not all(_natural(s) for s in shape):
            return f"has shape {shape!r}, not a list of non-negative ints"
        if math.prod(shape) * _ti.element_size(dtype) != nbytes:
            return f"has shape {list(shape)} of {name}, which is not its {nbytes} bytes"
        if start + nbytes > sinfo.length:
            return f"has tensor bytes [{start}, {start + nbytes}) outside its {sinfo.length}-byte item"
        covered = nbytes
    hashes, block = info.get("xxh3"), info.get("block", default_block)
    if hashes is not None and not (
        type(block) is int and block > 0 and isinstance(hashes, list) and len(hashes) == max(1, -(-covered // block))
    ):
        return f"has checksums that do not match its size ({covered} bytes in blocks of {block!r})"
    return None


def box_problem(shape: Sequence[int], offsets: Any, lengths: Any) -> str | None:
    """Why the box ``offsets``/``lengths`` is not inside a tensor of ``shape``; None if it is."""
    box = f"offsets {offsets!r}, lengths {lengths!r}"
    if not all(isinstance(v, (list, tuple)) and len(v) == len(shape) for v in (offsets, lengths)):
        return f"{box}: not {len(shape)} dims"
    if not all(_natural(o) and _natural(n) and o + n <= s for o, n, s in zip(offsets, lengths, shape, strict=True)):
        return f"{box}: outside the shape {list(shape)}"
    return None


def tensor_problem(fqn: str, meta: Any, storage: dict) -> tuple[str | None, list[MetadataIndex]]:
    """Why the tensor ``fqn`` (``meta``: its entry in ``state_dict_metadata``) is bigger than the bytes
    its chunks' storage entries (in ``storage``) claim; None if it is not. Also the chunks' storage
    indices, which the caller checks against the stored data (as for any entry).

    Each chunk must lie inside the tensor and need no more bytes than its entry holds (its ``nbytes``
    when ckptio wrote it, else its length; compressed entries are not bounded), and the chunks must
    hold at least the tensor's bytes.
    """
    size = getattr(meta, "size", None)
    dtype = getattr(getattr(meta, "properties", None), "dtype", None)
    if not (isinstance(size, tuple) and all(_natural(n) for n in size) and isinstance(dtype, torch.dtype)):
        return f"is a tensor of size {size!r} and dtype {dtype!r}", []
    esize, chunks, indices, held = _ti.element_size(dtype), getattr(meta, "chunks", None), {}, 0
    for chunk in chunks if isinstance(chunks, list) else []:
        why = box_problem(size, getattr(chunk, "offsets", None), getattr(chunk, "sizes", None))
        if why is not None:
            return f"has a chunk at {why}", []
        index = MetadataIndex(fqn, chunk.offsets)
        if index in indices:
            continue
        sinfo = storage.get(index)
        info = getattr(sinfo, "ckptio", None)
        stored = info.get("nbytes") if isinstance(info, dict) else getattr(sinfo, "length", None)
        nbytes = math.prod(chunk.sizes) * esize
        if getattr(sinfo, "transform_descriptors", None):
            stored = nbytes  # compressed: its size once decompressed is not known here
        if not _natural(stored) or nbytes > stored:
            return f"has a chunk at offsets {list(chunk.offsets)} of {nbytes} bytes stored in {stored!r} bytes", []
        indices[index] = True
        held += nbytes
    if math.prod(size) * esize > held:
        return f"is a tensor of {math.prod(size) * esize} bytes whose chunks hold {held}", []
    return None, list(indices)

"""Loading some entries of a ``torch.save`` file's top-level mapping, reading only their bytes.

:func:`load_entries` (a Checkpointer load with ``keys=``/``exclude=`` of a ``pt`` checkpoint): a local
file (or node-cache entry) is mapped (``torch.load(mmap=True)``), so only the pages of the entries
kept are read. A remote object: its zip directory (the tail), the zip's small members (``data.pkl``,
``version``...) and the records of the storages the kept entries' tensors use are fetched, each by
one ranged read from one version of the object (``pin_version``), into a sparse temporary file at
their own offsets; ``torch.load(mmap=True)`` of it builds the tree (the other entries' tensors map
holes, never read) and the kept entries are returned. Which storages an entry uses is read from the
pickle by ckptio's inspecting unpickler, which calls nothing. The load itself is torch's, with the
caller's ``weights_only``. A file that is not a zip (legacy ``torch.save``) or not a mapping loads whole,
and so does one with a storage the walk from the top-level entries does not reach (so none is missed).
"""

from __future__ import annotations

import io
import os
import pickle
import tempfile
import zipfile
from collections.abc import Iterable
from typing import Any

from ..backends.base import Backend, RangeReader
from ..errors import IntegrityError
from ..osio import anonymous
from .torch import TensorInfo, TorchFormat, _TorchInspector

_CHUNK = 64 << 20  # the most bytes one ranged read puts in memory before they are written out
_STORAGE_REF = {"dtype", "key", "numel"}  # what _TorchInspector.persistent_load returns for a storage
_TAIL = 64 << 10  # the zip directory is read with this much read-ahead (one request for most files)


def load_entries(backend: Backend, uri: str, keys: Iterable[str], **kw: Any) -> dict[str, Any]:
    """``{k: torch.load(uri)[k] for k in keys if present}``, reading only those entries' bytes."""
    import torch

    keys = list(keys)
    kw.setdefault("weights_only", not kw.pop("allow_pickle", False))
    kw.pop("mmap", None)
    with backend.local_file(uri) as path:
        if path is not None:
            return _pick(torch.load(path, mmap=True, **kw), keys)
    reads = backend.pin_version(uri)  # directory, pickle and records from one version of the object
    size = reads.stat(uri).size
    ranges = _ranges(reads, uri, size, keys)
    if ranges is None:
        return _pick(TorchFormat().load(backend, uri, **kw), keys)
    with tempfile.TemporaryDirectory(prefix="ckptio-") as tmp:
        path = os.path.join(tmp, "entries.pt")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
            for start, end in ranges:
                _copy_range(reads, uri, fd, start, end)
        finally:
            os.close(fd)
        return _pick(torch.load(path, mmap=True, **kw), keys)  # the mapping outlives the file


def _pick(obj: Any, keys: list[str]) -> dict[str, Any]:
    if not isinstance(obj, dict):
        return obj  # the caller reports what it holds
    return {k: obj[k] for k in keys if k in obj}


def _ranges(reads: Backend, uri: str, size: int, keys: list[str]) -> list[tuple[int, int]] | None:
    """The byte ranges to fetch: the zip directory, the small members, the kept entries' records;
    None when the object is not a zip holding a mapping (then it loads whole)."""
    raw = io.BufferedReader(RangeReader(reads, uri, size), buffer_size=_TAIL)
    try:
        z = zipfile.ZipFile(raw)
    except zipfile.BadZipFile:
        return None
    with z:
        infos = sorted(z.infolist(), key=lambda i: i.header_offset)
        pkl = next((i for i in infos if i.filename.endswith("/data.pkl") or i.filename == "data.pkl"), None)
        if pkl is None:
            return None
        inspector = _Recording(io.BytesIO(z.read(pkl)))
        try:
            tree = inspector.load()
        except (pickle.UnpicklingError, EOFError, ValueError, TypeError, zipfile.BadZipFile) as e:
            raise IntegrityError(f"{uri}: cannot decode {pkl.filename}: {e}") from None
        if not isinstance(tree, dict) or not inspector.seen <= _storages([tree]):
            return None  # not a mapping, or a storage the walk cannot place: load whole, never a hole
        prefix = pkl.filename[: -len("data.pkl")] + "data/"
        records = {prefix + key for key in _storages([tree[k] for k in keys if k in tree])}
        ends = [i.header_offset for i in infos[1:]] + [z.start_dir]
        ranges = [
            (i.header_offset, end)
            for i, end in zip(infos, ends, strict=True)
            if not i.filename.startswith(prefix) or i.filename in records
        ]
        ranges.append((z.start_dir, size))
    return ranges


class _Recording(_TorchInspector):
    """The inspector, noting the key of every storage the pickle refers to."""

    def __init__(self, f: Any) -> None:
        super().__init__(f)
        self.seen: set[str] = set()

    def persistent_load(self, pid: Any) -> Any:
        ref = super().persistent_load(pid)
        if isinstance(ref, dict):
            self.seen.add(ref["key"])
        return ref


def _storages(roots: list[Any]) -> set[str]:
    """The storage keys anything reachable from ``roots`` uses: tensors, and the storages of objects the
    inspector did not rebuild (their arguments and state are walked too), so no kept tensor maps a hole."""
    out: set[str] = set()
    seen: set[int] = set()
    stack = list(roots)
    while stack:
        o = stack.pop()
        if id(o) in seen:
            continue
        seen.add(id(o))
        if isinstance(o, TensorInfo):
            out.add(o.storage)
        elif isinstance(o, dict):
            if _STORAGE_REF <= o.keys() and isinstance(o.get("key"), str):  # the inspector's storage reference
                out.add(o["key"])
            stack.extend(o.keys())
            stack.extend(o.values())
        elif isinstance(o, (list, tuple, set, frozenset)):
            stack.extend(o)
        elif hasattr(o, "__dict__") and not isinstance(o, type):
            stack.extend(vars(o).values())
    return out


def _copy_range(reads: Backend, uri: str, fd: int, start: int, end: int) -> None:
    buf = anonymous(min(end - start, _CHUNK)) if end > start else None
    pos = start
    while pos < end:
        assert buf is not None
        mv = memoryview(buf)[: min(len(buf), end - pos)]
        n = reads.readinto(uri, mv, pos)
        if n <= 0:
            raise IntegrityError(f"{uri}: object shrank while reading at byte {pos} (changed while read?)")
        os.pwrite(fd, mv[:n], pos)
        pos += n

"""Loading some entries of a ``torch.save`` file's top-level mapping, reading only their bytes.

:func:`load_entries` (a Checkpointer load with ``keys=``/``exclude=`` of a ``pt`` checkpoint): a local file
(or node-cache entry) is mapped (``torch.load(mmap=True)``), so only the pages of the entries kept are read.
A remote object: its first and last bytes (the pickle, the zip directory), the zip's other small members
(``version``...) and the records of the storages the kept entries' tensors use are fetched by ranged reads
(ranges closer than :data:`_GAP` merged, several at once), all from one version of the object
(``pin_version``), into a sparse temporary file at their own offsets; ``torch.load(mmap=True)`` of it builds
the tree (the other entries' tensors map holes, never read) and the kept entries are returned. Which
storages an entry uses is read from the pickle by ckptio's inspecting unpickler, which calls nothing. The
load itself is torch's, with the caller's ``weights_only``. A file that is not a zip (legacy ``torch.save``)
or not a mapping loads whole, and so does one with a storage the walk from the top-level entries does not
reach (so none is missed).
"""

from __future__ import annotations

import io
import os
import pickle
import tempfile
import zipfile
from collections.abc import Iterable
from typing import Any

from ..backends.base import Backend
from ..backends.readers import RangeReader
from ..errors import FormatError, IntegrityError
from ..osio import anonymous
from ..threads import Pool
from .torch import (
    TensorInfo,
    TorchFormat,
    _load_checked,
    _TorchInspector,
    archive_problem,
    check_members,
    pickle_problem,
)

_CHUNK = 16 << 20  # the most bytes one ranged read puts in memory before they are written out
_STORAGE_REF = {"dtype", "key", "numel"}  # what _TorchInspector.persistent_load returns for a storage
_ENDS = 64 << 10  # the first and last bytes read up front: the pickle and the zip directory of most files
_THREADS = 8  # ranges read at once (each in at most _CHUNK of memory)
_GAP = 64 << 10  # ranges closer than this are read as one (and the zip's own reads buffered by this much)


def load_entries(backend: Backend, uri: str, keys: Iterable[str], **kw: Any) -> dict[str, Any]:
    """``{k: torch.load(uri)[k] for k in keys if present}``, reading only those entries' bytes."""
    keys = list(keys)
    kw.setdefault("weights_only", not kw.pop("allow_pickle", False))
    kw.pop("mmap", None)
    with backend.local_file(uri) as path:
        if path is not None:
            return _pick(_load_checked(path, os.path.getsize(path), uri, {**kw, "mmap": True}), keys)
    reads = backend.pin_version(uri)  # directory, pickle and records from one version of the object
    size = reads.stat(uri).size
    raw = _Ends(reads, uri, size)
    ranges = _ranges(raw, uri, size, keys)
    if ranges is None:
        return _pick(TorchFormat().load(backend, uri, **kw), keys)
    with tempfile.TemporaryDirectory(prefix="ckptio-") as tmp:
        path = os.path.join(tmp, "entries.pt")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
            os.pwrite(fd, raw.head, 0)
            os.pwrite(fd, raw.tail, raw.tail_start)
            todo = _merged(ranges, len(raw.head), raw.tail_start)
            with Pool(max(1, min(len(todo), _THREADS)), thread_name_prefix="ckptio-pt-entries") as ex:
                list(ex.map(lambda r: _copy_range(reads, uri, fd, *r), todo))
        finally:
            os.close(fd)
        if backend.assembled(uri):  # an incremental step's blocks: the records read are checked (torch does not)
            with open(path, "rb") as f:
                check_members(f, uri, names=_fetched(f, ranges))
        return _pick(_load_checked(path, size, uri, {**kw, "mmap": True}), keys)  # the mapping outlives the file


class _Ends(RangeReader):
    """The object, its first and last :data:`_ENDS` bytes read once (the pickle comes first in a torch
    zip, the directory last) and served from memory; other reads are ranged reads."""

    def __init__(self, backend: Backend, uri: str, size: int) -> None:
        super().__init__(backend, uri, size)
        self.head = backend.read_range(uri, 0, min(size, _ENDS))
        self.tail_start = max(len(self.head), size - _ENDS)
        self.tail = backend.read_range(uri, self.tail_start, size) if self.tail_start < size else b""

    def readinto(self, b: Any) -> int:
        mv = memoryview(b).cast("B")
        for start, data in ((0, self.head), (self.tail_start, self.tail)):
            if start <= self._pos < start + len(data):
                n = min(len(mv), start + len(data) - self._pos)
                mv[:n] = data[self._pos - start : self._pos - start + n]
                self._pos += n
                return n
        if self._pos < self.tail_start:
            mv = mv[: self.tail_start - self._pos]
        return super().readinto(mv)


def _merged(ranges: list[tuple[int, int]], head_end: int, tail_start: int) -> list[tuple[int, int]]:
    """``ranges`` less what the ends already hold, those less than :data:`_GAP` apart merged."""
    out: list[list[int]] = []
    for a, b in sorted(ranges):
        a, b = max(a, head_end), min(b, tail_start)
        if a >= b:
            continue
        if out and a - out[-1][1] < _GAP:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _fetched(f: Any, ranges: list[tuple[int, int]]) -> set[str]:
    """The names of the members whose local header starts one of ``ranges`` (the ones fetched)."""
    starts = {a for a, _ in ranges}
    with zipfile.ZipFile(f) as z:
        return {i.filename for i in z.infolist() if i.header_offset in starts}


def _pick(obj: Any, keys: list[str]) -> dict[str, Any]:
    if not isinstance(obj, dict):
        return obj  # the caller reports what it holds
    return {k: obj[k] for k in keys if k in obj}


def _ranges(raw: RangeReader, uri: str, size: int, keys: list[str]) -> list[tuple[int, int]] | None:
    """The byte ranges to fetch: the zip directory, the small members, the kept entries' records;
    None when the object is not a zip holding a mapping (then it loads whole)."""
    try:
        z = zipfile.ZipFile(io.BufferedReader(raw, buffer_size=_GAP))
    except zipfile.BadZipFile:
        return None
    with z:
        infos = sorted(z.infolist(), key=lambda i: i.header_offset)
        pkl = next((i for i in infos if i.filename.endswith("/data.pkl") or i.filename == "data.pkl"), None)
        if pkl is None:
            return None
        why = archive_problem(z, size)
        data = z.read(pkl) if why is None else b""
        why = why or pickle_problem(data, size)
        if why is not None:
            raise FormatError(f"{uri}: {why}; refusing to read it (the file is corrupt or crafted)")
        inspector = _Recording(io.BytesIO(data))
        try:
            tree = inspector.load()
        except (
            pickle.UnpicklingError,
            EOFError,
            ValueError,
            TypeError,
            AttributeError,
            LookupError,
            zipfile.BadZipFile,
        ) as e:
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

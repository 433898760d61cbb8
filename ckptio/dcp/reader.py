"""ckptio's DCP :class:`StorageReader`: ranged reads straight into the destination tensors, checked first.

Reads are ranged: only the bytes of the requested items (widened to checksum blocks when
verifying) are fetched, large ranges in ``part_size`` pieces and small nearby ones coalesced into
single reads (:class:`_Ranges`), on a thread pool. Items written by torch's own writers are read
whole and decoded by ``torch.load``. The reader runs no code from the data objects and allocates
nothing from a number in ``.metadata`` before checking it against the stored bytes (the rules:
:mod:`ckptio.dcp.checks`).
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import dataclasses
import io
import os
import uuid
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch.distributed.checkpoint import storage as _storage
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from .. import torch_internals as _ti
from .. import uri as _uri
from ..backends.base import Backend
from ..backends.readers import BytesReader
from ..errors import FormatError, IncompleteCheckpointError, IntegrityError
from ..threads import Inline, executor
from .checks import box_problem, entry_problem, pickle_problem, tensor_problem, zip_problem
from .heads import DataObjects, check_spans
from .layout import (
    CHECKSUM_BLOCK,
    INFO_ATTR,
    METADATA_NAME,
    AtURI,
    block_hashes,
    merge_backend_options,
    metadata_name,
    uint8_view,
)
from .metadata import data_objects, loads_metadata

__all__ = ["StorageReader", "contiguous_span"]

COALESCE_MAX = 1024 * 1024  # ranges below this are merged with their neighbours into one read
COALESCE_GAP = 64 * 1024
INLINE_MAX = 4 * 1024 * 1024  # a plan reading at most this many bytes runs its reads in the calling thread


@dataclasses.dataclass
class _Unit:
    """One item to load, once its byte ranges have arrived."""

    req: ReadItem
    obj: str  # data object URI
    finish: Callable[[], None]
    futures: list[cf.Future] = dataclasses.field(default_factory=list)
    temp_bytes: int = 0


def _copy_into(planner: LoadPlanner, req: ReadItem, dest: torch.Tensor, src: torch.Tensor, where: str) -> None:
    """Copy a stored tensor into the planner's destination and commit it, refusing a shape mismatch."""
    if dest.size() != src.size():
        raise IntegrityError(
            f"{where}: stored shape {tuple(src.shape)} does not match the destination {tuple(dest.shape)}"
        )
    dest.copy_(src)
    planner.commit_tensor(req, dest)


def contiguous_span(shape: Sequence[int], offsets: Sequence[int], lengths: Sequence[int]) -> tuple[int, int] | None:
    """Element range ``[start, stop)`` of a sub-box in a row-major array, if the box is contiguous there."""
    d = 0
    while d < len(shape) and lengths[d] == 1:
        d += 1
    if any(lengths[i] != shape[i] for i in range(d + 1, len(shape))):
        return None
    start, stride = 0, 1
    for i in reversed(range(len(shape))):
        start += offsets[i] * stride
        stride *= shape[i]
    count = 1
    for n in lengths:
        count *= n
    return start, start + count


def _block_check(hashes: list[int] | None, block: int, obj: str, what: str) -> Callable[[memoryview, int], None]:
    """A check of bytes ``mv`` of an item's data, from byte ``start`` (a block boundary), against its ``hashes``."""

    def check(mv: memoryview, start: int) -> None:
        if hashes is None:
            return
        got = block_hashes(mv, start, block)
        first = start // block
        for i, h in enumerate(got):
            if hashes[first + i] != h:
                raise IntegrityError(
                    f"checksum mismatch in {obj}, {what}, bytes [{start + i * block}, "
                    f"{min(start + (i + 1) * block, start + len(mv))}) of its data: the checkpoint is corrupt"
                )

    return check


class _Ranges:
    """Reads byte ranges of data objects into their targets on ``pool``: ranges longer than a group in
    ``part_size`` pieces, the others coalesced with their neighbours into single reads
    (:meth:`submit_small`) that stream through the targets (``Backend.readv``, a scatter read). On remote
    storage a group is up to ``part_size`` bytes (one request where there were one per tensor); where
    reads are local, ranges from ``COALESCE_MAX`` up are read alone, in parallel, and groups stay small."""

    def __init__(self, backend: Backend, pool: cf.Executor, objects: DataObjects) -> None:
        self.backend, self.pool, self.piece, self.objects = backend, pool, backend.part_size, objects
        self.alone = COALESCE_MAX if backend.reads_local else backend.part_size  # read by itself from this size
        self.group = 4 * COALESCE_MAX if backend.reads_local else backend.part_size  # the largest coalesced read
        self.small: dict[str, list[tuple[int, int, memoryview, _Unit]]] = {}

    def fetch(self, unit: _Unit, obj: str, start: int, target: memoryview) -> None:
        """Read ``target``'s bytes from ``obj`` at ``start``; the futures go to ``unit`` (small ones once submitted)."""
        n = len(target)
        if n < self.alone:
            self.small.setdefault(obj, []).append((start, start + n, target, unit))
            return
        for off in range(0, n, self.piece):
            unit.futures.append(self.pool.submit(self._read_exact, obj, start + off, target[off : off + self.piece]))

    def submit_small(self) -> None:
        """Coalesce nearby small ranges of each object into single reads, then scatter into their targets."""
        for obj, ranges in self.small.items():
            ranges.sort(key=lambda r: r[0])
            groups: list[list] = []
            for r in ranges:
                if groups and r[0] - groups[-1][-1][1] <= COALESCE_GAP and r[1] - groups[-1][0][0] <= self.group:
                    groups[-1].append(r)
                else:
                    groups.append([r])
            for g in groups:
                start, stop = g[0][0], max(r[1] for r in g)
                f = self.pool.submit(self._read_scatter, obj, start, stop, [(a, b, t) for a, b, t, _ in g])
                for *_, unit in g:
                    unit.futures.append(f)
        self.small.clear()

    def _read_exact(self, obj: str, start: int, target: memoryview) -> None:
        if self.objects.copy_out(obj, start, [(start, start + len(target), target)]):
            return
        n = self.backend.readinto(obj, target, start)
        if n != len(target):
            raise IntegrityError(
                f"data object {obj} is truncated: wanted bytes [{start}, {start + len(target)}), got {n}"
            )

    def _read_scatter(self, obj: str, start: int, stop: int, parts: list[tuple[int, int, memoryview]]) -> None:
        if self.objects.copy_out(obj, start, parts):
            return None
        if len(parts) == 1:
            return self._read_exact(obj, start, parts[0][2])
        views: list[memoryview] = []
        pos = start
        for a, b, t in parts:  # in file order: the targets, and throwaway buffers for the gaps between them
            if a < pos:  # overlapping ranges: read once into a staging buffer, then copy out
                buf = bytearray(stop - start)
                self._read_exact(obj, start, memoryview(buf))
                for a2, b2, t2 in parts:
                    t2[:] = buf[a2 - start : b2 - start]
                return None
            if a > pos:
                views.append(memoryview(bytearray(a - pos)))
            views.append(t)
            pos = b
        n = self.backend.readv(obj, views, start)
        if n != pos - start:
            raise IntegrityError(f"data object {obj} is truncated: wanted bytes [{start}, {pos}), got {n}")
        return None


def _plan_foreign(
    req: ReadItem, planner: LoadPlanner, sinfo: Any, obj: str, fetch: Callable, load_bytes: Callable
) -> _Unit:
    """An item written by torch's writers: one ranged read of the item, then torch's own decoding."""
    buf = torch.empty(sinfo.length, dtype=torch.uint8, device="cpu")
    unit = _Unit(req, obj, lambda: None, temp_bytes=sinfo.length)

    def finish() -> None:
        stream: Any = BytesReader(buf.numpy(), obj)  # type: ignore[arg-type]  # an ndarray is bytes-like
        descriptors = getattr(sinfo, "transform_descriptors", None)
        if descriptors:
            stream = _ti.StorageReaderTransforms().transform_load_stream(req, descriptors, stream)
            if not stream.seekable():
                stream = io.BytesIO(stream.read())
        if req.type == LoadItemType.BYTE_IO:
            load_bytes(req, planner, stream.read(), obj)
            return
        why = zip_problem(buf.numpy()) if not descriptors else None
        if why is not None:
            raise FormatError(f"{obj}: item {req.storage_index.fqn!r} {why}; refusing to load it")
        t = torch.load(stream, map_location="cpu", weights_only=True)
        if not isinstance(t, torch.Tensor):
            raise FormatError(f"{obj}: item {req.storage_index.fqn!r} holds a {type(t).__name__}, not a tensor")
        t = _ti.narrow_tensor_by_index(t, req.storage_offsets, req.lengths)
        _copy_into(planner, req, planner.resolve_tensor(req).detach(), t, f"{obj}, item {req.storage_index.fqn!r}")

    unit.finish = finish
    fetch(unit, obj, sinfo.offset, memoryview(buf.numpy()))  # type: ignore[arg-type]  # numpy's stubs: ndarray.__buffer__ on 3.12+ only
    return unit


class StorageReader(AtURI, _storage.StorageReader):
    """Read a DCP checkpoint (ckptio's or torch's ``FileSystemWriter``/``FsspecWriter`` layout) from any URI.

    Reads are ranged: only the bytes of the requested items (widened to checksum blocks when
    ``verify``) are fetched, in ``part_size`` pieces, ``thread_count`` at a time (default: the
    backend's ``concurrency``, at least 4), straight into
    the destination tensors when they match the stored layout. ``verify=False`` skips checksums.
    Non-tensor items reach the planner (whose ``load_bytes`` unpickles them) only when they are
    plain data, else a :class:`FormatError` names the item; ``allow_pickle=True`` skips that check
    for checkpoints you trust. Offsets and sizes from ``.metadata`` are checked against the stored
    data before anything is allocated (see :mod:`ckptio.dcp.checks`). ``backend`` (internal): a
    wrapper of the resolved backend to read the data objects through (the Checkpointer's
    incremental store); ``.metadata`` is read plainly.
    """

    def __init__(
        self,
        uri: str | os.PathLike,
        *,
        verify: bool = True,
        thread_count: int | None = None,
        part_size: int | None = None,
        concurrency: int | None = None,
        allow_pickle: bool = False,
        backend: Backend | None = None,
        **backend_options: Any,
    ) -> None:
        super().__init__()
        self._given = backend
        if thread_count is not None and int(thread_count) < 1:
            raise ValueError(f"thread_count must be >= 1, got {thread_count!r}")
        self.verify = bool(verify)
        self.allow_pickle = bool(allow_pickle)
        self._options = merge_backend_options(part_size, concurrency, backend_options)
        self._set_uri(uri)
        # ranged requests in flight; by default as many as the backend runs per object (at least 4)
        self.thread_count = int(thread_count) if thread_count is not None else max(4, self.backend.concurrency)
        self.storage_data: dict[MetadataIndex, Any] = {}
        self.load_id = uuid.uuid4().hex
        self.rank: int | None = None
        self._metadata_error: BaseException | None = None  # torch's load reports it only as "metadata is None"
        self._meta_uri = self._path(METADATA_NAME)
        self._objects: dict[str, str] = {}  # data object name in the metadata -> URI, checked to be inside
        self._data = DataObjects(self.data_backend)  # data objects' sizes, small ones' bytes fetched with them
        self._metadata: Metadata | None = None
        self._checked: tuple[Metadata | None, dict[str, str]] = (None, {})  # metadata read, its data objects
        self._kept: Metadata | None = None  # keep_metadata()

    @property
    def metadata_error(self) -> BaseException | None:
        """What ``read_metadata`` raised for the global ``.metadata``, which torch's load reports only as
        an ``AssertionError`` ("metadata is None"): pass it to :func:`ckptio.dcp.surface_error`."""
        return self._metadata_error

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        self.storage_data = {}
        self._objects = {}
        self._metadata = None
        self._metadata_error = None
        self._checked = (None, {})
        self._kept = None
        if checkpoint_id:
            self._set_uri(checkpoint_id)
        self._data = DataObjects(self.data_backend)
        self._meta_uri = self._path(METADATA_NAME)
        self.load_id = uuid.uuid4().hex

    def keep_metadata(self) -> Metadata:
        """Read the global ``.metadata`` now and answer this load's later ``read_metadata`` calls with it
        (a caller that plans from the metadata first, then loads: one read, not two)."""
        self._kept = None
        self._kept = self.read_metadata()
        return self._kept

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        if rank is None and self._kept is not None:
            return self._kept
        try:
            metadata = self._read_metadata(self._path(metadata_name(rank, rank is None)))
        except Exception as e:
            if rank is None:
                self._metadata_error = e
            raise
        storage_meta = getattr(metadata, "storage_meta", None) or StorageMeta()
        storage_meta.load_id = self.load_id
        metadata.storage_meta = storage_meta
        return metadata

    def _read_metadata(self, meta: str) -> Metadata:
        try:
            data = self.backend.read(meta)
        except FileNotFoundError:
            if self.backend.isdir(self.root):
                raise IncompleteCheckpointError(
                    f"checkpoint {self.uri!r} is incomplete: it has no {_uri.basename(meta)} (the save was "
                    f"interrupted or is still running)"
                ) from None
            raise
        metadata = loads_metadata(data, meta)
        # refuse names outside the checkpoint up front; set_up_storage_reader reuses the answer
        self._checked = (metadata, data_objects(metadata, self.backend, self.root, meta))
        self._meta_uri = meta
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if metadata.storage_data is None:
            raise IncompleteCheckpointError(f"checkpoint {self.uri!r}: metadata has no storage_data")
        checked, objects = self._checked
        names = {getattr(s, "relative_path", None) for s in metadata.storage_data.values()}
        if checked is not metadata or not names <= objects.keys():  # metadata not read here, or changed since
            objects = data_objects(metadata, self.backend, self.root, self._meta_uri)
        self._objects = objects
        self.storage_data = metadata.storage_data
        self._metadata, self._data = metadata, DataObjects(self.data_backend)
        self.rank = kwargs.get("rank")

    # ---- checks before anything is allocated (see ckptio.dcp.checks) -------------------------
    def _malformed(self, index: MetadataIndex, why: str, obj: str | None = None) -> FormatError:
        where = obj or self._meta_uri
        return FormatError(
            f"{where}: item {index.fqn!r} (offset {list(index.offset or [])}) {why}: the "
            f"checkpoint's {METADATA_NAME} is corrupt or crafted; nothing was loaded"
        )

    def _check_entries(self, entries: dict[MetadataIndex, bool], reading: bool = False) -> None:
        """Check the storage entries ``entries`` (index -> holds a tensor) before any of them is read.

        Each must be sound (:func:`entry_problem`), lie inside its data object (one size lookup per
        object, or one GET of a small object's bytes that tells its size: :mod:`.heads`) and overlap
        no other entry of the batch: a crafted ``.metadata`` can then make a load allocate no more
        than the data objects hold. ``reading``: the entries are read next (by this reader).
        """
        by_object: dict[str, list[tuple[int, int, MetadataIndex]]] = {}
        for index, tensor in entries.items():
            sinfo = self.storage_data.get(index)
            if sinfo is None:
                raise self._malformed(index, "has no storage entry")
            why = entry_problem(sinfo, tensor, CHECKSUM_BLOCK)
            if why is not None:
                raise self._malformed(index, why, self._objects.get(sinfo.relative_path))
            by_object.setdefault(self._objects[sinfo.relative_path], []).append(
                (sinfo.offset, sinfo.offset + sinfo.length, index)
            )
        check_spans(self._data, by_object, self._malformed, reading)

    def _check_plan(self, plan: LoadPlan) -> None:
        self._check_entries({req.storage_index: req.type != LoadItemType.BYTE_IO for req in plan.items}, reading=True)
        for req in plan.items:
            sinfo = self.storage_data[req.storage_index]
            info = getattr(sinfo, INFO_ATTR, None)
            if (
                req.type != LoadItemType.BYTE_IO
                and info is not None
                and not getattr(sinfo, "transform_descriptors", None)
            ):
                why = box_problem(info["shape"], tuple(req.storage_offsets), tuple(req.lengths))
                if why is not None:
                    raise self._malformed(req.storage_index, f"is read at {why}", self._objects[sinfo.relative_path])

    def check_tensors(self, fqns: Iterable[str]) -> None:
        """Refuse, with a :class:`FormatError`, any tensor in ``fqns`` whose size in the metadata is not
        backed by stored bytes; call it (after ``set_up_storage_reader``) before allocating such
        tensors from the metadata, as the Checkpointer does for entries its state lacks."""
        if self._metadata is None:
            raise RuntimeError("check_tensors needs set_up_storage_reader first")
        entries: dict[MetadataIndex, bool] = {}
        for fqn in fqns:
            why, indices = tensor_problem(fqn, self._metadata.state_dict_metadata.get(fqn), self.storage_data)
            if why is not None:
                raise self._malformed(MetadataIndex(fqn), why)
            entries.update(dict.fromkeys(indices, True))
        self._check_entries(entries)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    # ---- reading ---------------------------------------------------------------------------
    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        window = max(4 * self.data_backend.part_size * self.thread_count, 256 << 20)  # temp bytes allowed in flight
        pending: collections.deque[_Unit] = collections.deque()
        temp_in_flight = 0

        self._check_plan(plan)
        small = sum(self.storage_data[r.storage_index].length for r in plan.items) <= INLINE_MAX
        pool = Inline() if small else executor(self.thread_count, "ckptio-dcp-read")
        with pool:
            ranges = _Ranges(self.data_backend, pool, self._data)

            def drain(limit: int) -> None:
                nonlocal temp_in_flight
                while pending and (temp_in_flight > limit or limit < 0):
                    u = pending.popleft()
                    for f in u.futures:
                        f.result()
                    u.finish()
                    temp_in_flight -= u.temp_bytes

            try:
                for req in sorted(plan.items, key=self._order):
                    unit = self._plan_item(req, planner, ranges.fetch)
                    pending.append(unit)
                    temp_in_flight += unit.temp_bytes
                    if temp_in_flight > window:
                        ranges.submit_small()
                        drain(window // 2)
                ranges.submit_small()
                drain(-1)
            except BaseException:
                for u in pending:
                    for f in u.futures:
                        f.cancel()
                raise
            finally:
                self._data.release()  # the heads fetched with the sizes: read
        fut: Future = Future()
        fut.set_result(None)
        return fut

    def _order(self, req: ReadItem) -> tuple[str, int]:
        s = self.storage_data[req.storage_index]
        return (s.relative_path, s.offset)

    def _plan_item(self, req: ReadItem, planner: LoadPlanner, fetch: Callable) -> _Unit:
        sinfo = self.storage_data[req.storage_index]
        obj = self._objects[sinfo.relative_path]
        info = getattr(sinfo, INFO_ATTR, None)
        what = f"item {req.storage_index.fqn!r} (offset {list(req.storage_index.offset or [])})"
        if info is None or getattr(sinfo, "transform_descriptors", None):
            return _plan_foreign(req, planner, sinfo, obj, fetch, self._load_bytes)
        # an incremental step's too: a block's name proves its bytes are some stored block's, not this item's
        hashes = info.get("xxh3") if self.verify else None
        block = info.get("block", CHECKSUM_BLOCK)

        check = _block_check(hashes, block, obj, what)

        if req.type == LoadItemType.BYTE_IO:
            buf = bytearray(sinfo.length)
            unit = _Unit(req, obj, lambda: None, temp_bytes=len(buf))

            def finish_bytes() -> None:
                check(memoryview(buf), 0)
                self._load_bytes(req, planner, buf, obj)

            unit.finish = finish_bytes
            fetch(unit, obj, sinfo.offset, memoryview(buf))
            return unit

        dtype = getattr(torch, info["dtype"])
        shape = tuple(info["shape"])
        esize = _ti.element_size(dtype)
        nbytes = info["nbytes"]
        base = sinfo.offset + info["data"]
        dest = planner.resolve_tensor(req).detach()
        span = contiguous_span(shape, req.storage_offsets, req.lengths)
        a, b = (span[0] * esize, span[1] * esize) if span is not None else (0, nbytes)
        lo, hi = a, b
        if hashes is not None:  # widen to whole checksum blocks
            lo, hi = (a // block) * block, min(nbytes, -(-b // block) * block)
        direct = (
            lo == a
            and hi == b
            and span is not None
            and dest.is_cpu
            and dest.is_contiguous()
            and dest.dtype == dtype
            and dest.numel() * esize == b - a
        )
        if direct:
            target = uint8_view(dest)
            unit = _Unit(req, obj, lambda: None)
        else:
            target = torch.empty(hi - lo, dtype=torch.uint8, device="cpu")
            unit = _Unit(req, obj, lambda: None, temp_bytes=hi - lo)

        def finish_tensor() -> None:
            check(memoryview(target.numpy()), lo)  # type: ignore[arg-type]  # numpy's stubs: ndarray.__buffer__ on 3.12+ only
            if direct:
                planner.commit_tensor(req, dest)
                return
            raw = target[a - lo : b - lo].view(dtype)
            if span is not None:
                src = raw.view(tuple(req.lengths))
            else:
                src = raw.view(shape)
                for d, (o, n) in enumerate(zip(req.storage_offsets, req.lengths, strict=True)):
                    src = src.narrow(d, o, n)
            _copy_into(planner, req, dest, src, f"{obj}, {what}")

        unit.finish = finish_tensor
        if hi > lo:
            fetch(unit, obj, base + lo, memoryview(target.numpy()))  # type: ignore[arg-type]  # numpy's stubs: ndarray.__buffer__ on 3.12+ only
        return unit

    def _load_bytes(self, req: ReadItem, planner: LoadPlanner, data: Any, obj: str) -> None:
        """Hand the non-tensor item ``data`` to the planner, which unpickles it: refused unless it is plain data."""
        why = None if self.allow_pickle else zip_problem(data) or pickle_problem(data)
        if why is not None:
            raise FormatError(
                f"checkpoint {self.uri!r}: the non-tensor item {req.storage_index.fqn!r} ({obj}) {why}; "
                f"ckptio unpickles only plain data by default (other pickles can run code from the "
                f"file). If you trust the checkpoint, load it with allow_pickle=True"
            )
        planner.load_bytes(req, io.BytesIO(data))

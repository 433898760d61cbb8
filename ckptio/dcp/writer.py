"""ckptio's DCP :class:`StorageWriter`: each rank's items streamed into data objects within a memory budget.

Items are split over up to ``thread_count`` data objects of similar size, each of at least
``min_object_bytes`` (a small payload is one object: one file and its fsyncs, or one request).
Each is one streaming :meth:`Backend.open_writer`, a tensor item framed as a ``torch.save`` zip
(:mod:`ckptio.dcp.zipframe`) around its bytes, written straight from tensor memory where it is
contiguous, with xxh3-64 checksums per block (:mod:`ckptio.dcp.layout`). :func:`bound_memory`
keeps the upload buffers within ``max_buffer_bytes``. The commit is :mod:`ckptio.dcp.metadata`'s.
"""

from __future__ import annotations

import dataclasses
import io
import os
import threading
import uuid
from collections.abc import Iterator, Sequence
from typing import Any, cast

import torch
import xxhash
from torch.distributed.checkpoint import storage as _storage
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from .. import torch_internals as _ti
from ..backends.base import Backend, Writer
from ..threads import Pool
from .layout import (
    CHECKSUM_BLOCK,
    DCP_VERSION,
    FORMAT_VERSION,
    INFO_ATTR,
    AtURI,
    Prefix,
    merge_backend_options,
    metadata_name,
    note,
    uint8_view,
)
from .metadata import commit, delete_objects, prepare_overwrite
from .zipframe import framing

__all__ = ["StorageWriter", "bound_memory"]

_STAGING_CHUNK = 8 << 20  # largest staging copy for a non-contiguous or non-CPU tensor
MIN_OBJECT_BYTES = 16 << 20  # a rank's payload is split into data objects of at least this many bytes


def _item_nbytes(item: WriteItem) -> int:
    if item.tensor_data is None:
        return 0
    n = _ti.element_size(item.tensor_data.properties.dtype)
    for s in item.tensor_data.size:
        n *= s
    return n


def _split(items: Sequence[WriteItem], bins: int) -> list[list[WriteItem]]:
    """Items into at most ``bins`` groups of similar byte size (one data object per group)."""
    bins = max(1, min(bins, len(items)))
    groups: list[list[WriteItem]] = [[] for _ in range(bins)]
    sizes = [0] * bins
    for i, it in enumerate(x for x in items if x.type == WriteItemType.BYTE_IO):
        groups[i % bins].append(it)
    for it in sorted((x for x in items if x.type != WriteItemType.BYTE_IO), key=_item_nbytes, reverse=True):
        j = min(range(bins), key=sizes.__getitem__)
        groups[j].append(it)
        sizes[j] += _item_nbytes(it)
    return [g for g in groups if g]


def _tensor_chunks(t: torch.Tensor, max_bytes: int) -> Iterator[memoryview]:
    """The bytes of ``t`` in row-major order, as memoryviews; copies only non-contiguous or non-CPU slabs."""
    t = t.detach()
    if t.is_cpu and t.is_contiguous():
        if t.numel():
            yield memoryview(uint8_view(t).numpy())  # type: ignore[arg-type]  # numpy's stubs: ndarray.__buffer__ on 3.12+ only
        return
    if t.dim() == 0 or t.numel() == 0:
        if t.numel():
            yield memoryview(uint8_view(t.cpu().contiguous()).numpy())  # type: ignore[arg-type]  # numpy's stubs: ndarray.__buffer__ on 3.12+ only
        return
    row = max(1, t[0].numel() * t.element_size())
    step = max(1, max_bytes // row)
    for i in range(0, t.shape[0], step):
        yield memoryview(uint8_view(t[i : i + step].to("cpu").contiguous()).numpy())  # type: ignore[arg-type]  # numpy's stubs: ndarray.__buffer__ on 3.12+ only


def _tuned(backend: Backend, **option: Any) -> Backend:
    """``backend`` with ``option`` changed, or ``backend`` itself where it cannot change it (declines)."""
    try:
        return backend.with_options(**option)
    except ValueError:  # Backend.with_options' way to decline: keep the storage as it is
        return backend


def bound_memory(
    backend: Backend, options: dict[str, Any], budget: int | None, thread_count: int, payload: int, objects: int
) -> tuple[int, Backend]:
    """Objects to write at once, and the backend to write them with, keeping upload buffers within the budget.

    Backends that bound their writers' copies by ``max_buffer_bytes`` (S3, GCS) get a share of the
    budget each; other object-store writers buffer about ``(concurrency + 1) * part_size`` per object
    (and the client may copy each part in flight once more), so their concurrency is lowered; a
    backend that ``writes_in_place`` (local files) is written straight from tensor memory. The
    budget is ``budget``, by default max(64 MiB, payload / 10). ``options``: the backend options
    the caller chose (those are kept).
    """
    if backend.writes_in_place or objects == 0:
        return objects, backend
    budget = budget or max(64 << 20, payload // 10)
    if backend.max_buffer_bytes is not None:
        # Object-store writers bound their own copies by ``max_buffer_bytes`` and upload large
        # tensor writes straight from tensor memory: split the budget over the objects in flight
        # and keep each writer's full part concurrency.
        workers = max(1, min(objects, thread_count))
        share = max(1, budget // workers)
        if "max_buffer_bytes" not in options and share != backend.max_buffer_bytes:
            return workers, _tuned(backend, max_buffer_bytes=share)
        return workers, backend
    per_part = 2 * backend.part_size  # the part buffer plus the client's copy of it
    parts = max(1, budget // per_part)  # parts this rank may hold at once
    workers = max(1, min(objects, parts // 2))
    if "concurrency" not in options:
        concurrency = max(1, min(backend.concurrency, parts // workers - 1))
        if concurrency != backend.concurrency:
            return workers, _tuned(backend, concurrency=concurrency)
    return workers, backend


def _write_bytes(w: Writer, data: Any, checksums: bool, info: dict[str, Any]) -> int:
    """Write the BYTE_IO item ``data``; records its checksum in ``info``; returns its length."""
    buf = data.getbuffer() if isinstance(data, io.BytesIO) else memoryview(data)
    w.write(buf)
    length = len(buf)
    if checksums:
        info["xxh3"] = [xxhash.xxh3_64_intdigest(buf)]
        info["block"] = max(length, 1)
    del buf
    return length


def _write_tensor(w: Writer, t: torch.Tensor, checksums: bool, info: dict[str, Any], key: str) -> int:
    """Write the tensor ``t`` framed as a torch.save archive (its frame named by the item ``key``: the
    same bytes at every save); records its layout and checksums in ``info``."""
    nbytes = t.numel() * t.element_size()
    z = framing(t.dtype, tuple(t.shape), nbytes, key)
    w.write(z.head)
    hashes: list[int] = []
    h = xxhash.xxh3_64() if checksums else None
    filled = 0
    # the tensor's own memory stays unchanged until write_data returns: lent; a copy made here (a
    # non-contiguous or device tensor, in slabs) is written, so the writer need not keep it alive
    put = w.write_borrowed if t.is_cpu and t.is_contiguous() else w.write
    for mv in _tensor_chunks(t, _STAGING_CHUNK):
        put(mv)
        if h is not None:  # block hashes over a stream of arbitrary-size pieces
            pos = 0
            while pos < len(mv):
                take = min(len(mv) - pos, CHECKSUM_BLOCK - filled)
                h.update(mv[pos : pos + take])
                pos, filled = pos + take, filled + take
                if filled == CHECKSUM_BLOCK:
                    hashes.append(h.intdigest())
                    h.reset()
                    filled = 0
    if h is not None and (filled or not hashes):
        hashes.append(h.intdigest())
    w.write(z.tail)
    info.update(data=z.data_offset, nbytes=nbytes, dtype=str(t.dtype).removeprefix("torch."), shape=list(t.shape))
    if checksums:
        info["xxh3"], info["block"] = hashes, CHECKSUM_BLOCK
    return z.total


class StorageWriter(AtURI, _storage.StorageWriter):
    """Write a DCP checkpoint to any ckptio URI.

    Up to ``thread_count`` data objects per rank, of at least ``min_object_bytes`` of tensor data
    each (default 16 MiB: a small payload is one object, one file or request), are written
    concurrently, each streamed with bounded memory by its backend writer. ``part_size`` and
    ``concurrency`` go to the backend (multipart part size and parallel parts per object);
    ``overwrite`` allows replacing a committed checkpoint; ``checksums=False`` skips recording
    checksums; ``durable=False`` skips fsync on local storage; ``max_buffer_bytes`` caps upload
    buffers on object stores (default max(64 MiB, 10% of the rank's payload)) by lowering objects
    and parts in flight. Other keyword arguments are backend options (as for
    :func:`ckptio.resolve`). ``backend`` (internal): a wrapper of the resolved backend to write the
    data objects through (the Checkpointer's incremental store).
    """

    def __init__(
        self,
        uri: str | os.PathLike,
        *,
        thread_count: int = 4,
        part_size: int | None = None,
        concurrency: int | None = None,
        overwrite: bool = False,
        checksums: bool = True,
        durable: bool = True,
        max_buffer_bytes: int | None = None,
        min_object_bytes: int = MIN_OBJECT_BYTES,
        backend: Backend | None = None,
        **backend_options: Any,
    ) -> None:
        super().__init__()
        self._given = backend
        self.max_buffer_bytes = max_buffer_bytes
        if int(thread_count) < 1:
            raise ValueError(f"thread_count must be >= 1, got {thread_count!r}")
        self.thread_count = int(thread_count)
        self.min_object_bytes = max(1, int(min_object_bytes))
        self.overwrite = bool(overwrite)
        self.checksums = bool(checksums)
        self.durable = bool(durable)
        self._options = merge_backend_options(part_size, concurrency, backend_options)
        self._set_uri(uri)
        self.save_id = uuid.uuid4().hex
        self.rank: int | None = None
        self.is_coordinator = False
        self.use_collectives = True
        self._replaced: list[str] = []  # data objects of the checkpoint this save replaces (coordinator)

    # ---- the StorageWriter protocol --------------------------------------------------------
    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id:
            self._set_uri(checkpoint_id)
        self.save_id = uuid.uuid4().hex
        self._replaced = []

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        self.rank = kwargs.get("rank")
        self.use_collectives = kwargs.get("use_collectives", True)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.uri, save_id=self.save_id)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        if not self.use_collectives and self.rank is not None:
            plan = dataclasses.replace(plan, storage_data=Prefix(f"__{self.rank}_"))
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        # Runs on the coordinator before any rank gets its plan, hence before any data is written.
        meta = self._path(metadata_name(self.rank, self.use_collectives))
        self._replaced = []
        self._replaced = prepare_overwrite(self.backend, self.root, meta, self.overwrite, self.uri)
        attempt = uuid.uuid4().hex[:16]  # this save's data object names: no other save writes or deletes them
        return [
            dataclasses.replace(
                p, storage_data=Prefix(p.storage_data.prefix if p.storage_data is not None else f"__{i}_", attempt)
            )
            for i, p in enumerate(plans)
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        payload = sum(_item_nbytes(i) for i in plan.items)
        groups = _split(plan.items, min(self.thread_count, -(-payload // self.min_object_bytes)))
        cancel = threading.Event()
        jobs = [(plan.storage_data.name(n), g) for n, g in enumerate(groups)]
        results: list[WriteResult] = []
        workers = self._bound_memory(payload, len(jobs))
        try:
            if workers <= 1:
                for name, g in jobs:
                    results += self._write_object(name, g, planner, cancel)
            else:
                with Pool(workers, thread_name_prefix="ckptio-dcp-write") as pool:
                    futs = [pool.submit(self._write_object, name, g, planner, cancel) for name, g in jobs]
                    try:
                        for f in futs:
                            results += f.result()
                    except BaseException:
                        cancel.set()
                        raise
        except BaseException as e:  # this save will not commit: its objects are debris (names only it uses)
            failed = delete_objects(self.data_backend, [self._path(name) for name, _ in jobs])
            if failed:
                note(e, f"ckptio.dcp: could not delete this save's data objects: {'; '.join(failed)}")
            raise
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def _bound_memory(self, payload: int, objects: int) -> int:
        """Objects to write at once (see :func:`bound_memory`); sets the backend they are written with."""
        workers, self._write_backend = bound_memory(
            self.data_backend, self._options, self.max_buffer_bytes, self.thread_count, payload, objects
        )
        return workers

    def _write_object(
        self, name: str, items: list[WriteItem], planner: SavePlanner, cancel: threading.Event
    ) -> list[WriteResult]:
        uri = self._path(name)
        results: list[WriteResult] = []
        item: WriteItem | None = None
        try:
            with self._write_backend.open_writer(uri, mode="overwrite", durable=self.durable) as w:
                offset = 0
                for item in items:
                    w.mark_boundary()  # an unchanged item is an unchanged block (ckptio.incremental)
                    if cancel.is_set():
                        raise RuntimeError(f"cancelled: another data object of this rank failed ({uri})")
                    data = planner.resolve_data(item)
                    info: dict[str, Any] = {"v": FORMAT_VERSION}
                    if item.type == WriteItemType.BYTE_IO:
                        length = _write_bytes(w, data, self.checksums, info)
                    else:  # a tensor item resolves to a tensor
                        key = f"{item.index.fqn}{list(item.index.offset or [])}"
                        length = _write_tensor(w, cast(torch.Tensor, data).detach(), self.checksums, info, key)
                    sinfo = _ti.StorageInfo(name, offset, length)
                    setattr(sinfo, INFO_ATTR, info)
                    results.append(WriteResult(index=item.index, size_in_bytes=length, storage_data=sinfo))
                    offset += length
        except Exception as e:
            what = f"item {item.index.fqn!r}" if item is not None else "opening"
            note(e, f"ckptio.dcp: rank {self.rank}: writing data object {uri} ({what}) failed")
            raise
        return results

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        metadata.version = DCP_VERSION
        metadata.storage_data = {wr.index: wr.storage_data for rank in results for wr in rank}
        metadata.storage_meta = self.storage_meta()
        meta = self._path(metadata_name(self.rank, self.use_collectives))
        own = {self._path(sinfo.relative_path) for sinfo in metadata.storage_data.values()}
        replaced, self._replaced = self._replaced, []  # the data objects of the .metadata this save removed
        commit(self.backend, meta, metadata, own, replaced, self.uri)

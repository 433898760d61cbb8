"""Reading an ``.fpk`` file's payloads: coalesced parallel reads into fresh tensors (or the caller's), each
payload verified right after its read, or a private mapping of a local file (``mmap=True``). A local
payload read alone is hashed piece by piece as it is read (``Source.read_each``), while each piece is in
the CPU cache; a run of small ones is hashed once read (at most ``COALESCE_MAX``, still in the cache).

A remote source's ranges read ahead (:meth:`.read.BackendSource.read_ahead`) are never waited for by the
other reads: payloads inside them are views of them (``share``) or copies, a payload straddling one fetches
only its part outside it; all of them are awaited (and checked) once the other reads are in.
"""

from __future__ import annotations

import functools
import mmap as _mmap
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

import xxhash

from ...errors import IntegrityError
from ...osio import fault_in_striped, prefault
from ...threads import PARALLEL_MIN, Pool, deal, shared_pool
from .layout import MAX_IOV, Meta, describe_payload
from .read import HEAD_PREFETCH
from .source import Source

if TYPE_CHECKING:
    import torch

COALESCE_GAP = 64 << 10  # read across gaps up to this between needed payloads
COALESCE_MAX = 8 << 20  # largest coalesced run of small payloads (local reads)
# A local verified load reads a payload of up to this share of one thread's part of the load in one job,
# hashed piece by piece as read, where a larger one is read in parallel slices and hashed once all are in
# (a second pass over memory). Loads into resident tensors from the page cache, 2 threads, interleaved
# rounds, medians: 8 x 128 MiB 76.0 -> 56.6 ms, 4 x 256 MiB 91.2 -> 67.7 ms; a payload over it (1 x 1 GiB,
# 3 x 300 MiB) keeps its slices, as one thread per payload would leave the other idle
WHOLE_SHARE = 0.5
# A remote read's ranges are at least this: half the first range read ahead (read.HEAD_PREFETCH), so a
# piece that starts a round trip after it (once the tail has told the layout) still ends with it, and no
# more requests are made than that needs. 32 MiB through the realistic proxy (20 ms, 90 MB/s a connection),
# medians of two runs of 7 interleaved rounds: 2 MiB 0.167, 0.177 GB/s; 4 MiB 0.196, 0.207; 8 MiB 0.168, 0.177 (the
# pieces then end after the head); on loopback 2 MiB 0.347, 0.385; 4 MiB 0.337, 0.416
MIN_PIECE = HEAD_PREFETCH // 2  # 4 MiB
# A remote read of at least this much into fresh tensors has them faulted in by a helper thread while the
# requests are in flight (osio.fault_in_striped), not page by page in the copies on the IO loop. 256 MiB
# through the realistic proxy, two runs of interleaved rounds: 0.462 -> 0.488 and 0.456 -> 0.463 GB/s, the
# client's CPU 1.38 -> 1.23 and 1.42 -> 1.30 s/GB; 32 MiB gained nothing (0.229 -> 0.221): not below this
FAULT_HELPER_MIN = 64 << 20


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


def _piece(nbytes: int, share: int, most: int) -> int:
    """The slice of one remote payload of ``nbytes`` that each ranged GET reads: ``nbytes`` cut into equal
    slices, as many as the share per connection (``share``) fits best, none over ``most`` (part_size); a
    5 MiB payload with a 4 MiB share is one read, not 4 MiB and 1 MiB."""
    n = max(-(-nbytes // most), round(nbytes / share), 1)
    return -(-nbytes // n)


def read_payloads(
    src: Source,
    meta: Meta,
    idxs: list[int],
    verify: bool,
    into: dict[int, torch.Tensor] | None = None,
    share: bool = False,
) -> dict[int, torch.Tensor]:
    """Read the given storages into fresh uint8 tensors (or the caller's, ``into``: storage index ->
    uint8 tensor of the payload's size), in parallel, verifying each as soon as it is read.

    ``share``: a payload that lies wholly inside a range a remote source read ahead (the first
    ``min(part_size, HEAD_PREFETCH)`` bytes and the tail; a small object whole) is returned as a view of
    that buffer instead of a copy, as a mapped local load returns views of its mapping: one fresh buffer,
    not two."""
    import torch  # here, not at the top: reading the metadata (``ckptio info``) needs no torch

    into = into or {}
    shared: dict[int, torch.Tensor] = {}
    if share:
        for i in idxs:
            off, nbytes = meta.storages[i][:2]
            # not waited for: the other reads start now, the ranges read ahead are awaited after them
            view = src.ahead_view(off, nbytes, wait=False) if i not in into and nbytes else None
            if view is not None:
                shared[i] = torch.frombuffer(view, dtype=torch.uint8)
        if all(i in shared or not meta.storages[i][1] for i in idxs) and not into:
            return _views_only(src, meta, idxs, shared, verify)  # a small object, read ahead whole
    bufs = {
        i: into[i]
        if i in into
        else shared[i]
        if i in shared
        else torch.empty(meta.storages[i][1], dtype=torch.uint8, device="cpu")
        for i in idxs
    }
    # numpy's stubs give ndarray __buffer__ (the buffer protocol) on Python 3.12+ only
    mvs = {i: memoryview(b.numpy()) for i, b in bufs.items()}  # type: ignore[arg-type]
    part = src.part_size
    jobs: list[Callable[[], None]] = []
    split: list[int] = []  # payloads read in several pieces: verified once all pieces are in
    # a payload inside a range read ahead (not shared) is copied once that range is in, and one that
    # straddles it fetches only the bytes outside it (the part inside copied then), so no read waits
    # for a range read ahead
    spans = list(meta.storages)
    copies: list[tuple[int, int, int]] = []  # (payload, its offset in the file, bytes) copied from ahead
    for i in idxs:
        off, nbytes = meta.storages[i][:2]
        if i in shared or not nbytes:
            continue
        lo, hi, inside = src.outside_ahead(off, nbytes)
        if inside:
            copies += [(i, at, n) for at, n in inside]
            spans[i] = (lo, hi - lo, *meta.storages[i][2:])
            split.append(i)

    def view_of(i: int) -> memoryview:
        return mvs[i][spans[i][0] - meta.storages[i][0] :][: spans[i][1]]

    # local reads scatter straight into the tensors (preadv, readinto) in runs of up to COALESCE_MAX; a
    # remote read is shared out evenly over its connections: about ``concurrency`` ranged GETs of at least
    # MIN_PIECE and at most ``part_size``, each streamed through the tensors it spans (Backend.readv), unstaged
    if src.local:
        limit = COALESCE_MAX
    else:
        todo = sum(spans[i][1] for i in idxs if i not in shared)
        part = limit = min(part, max(MIN_PIECE, -(-todo // max(1, src.concurrency))))

    empty = [i for i in idxs if not meta.storages[i][1]]  # nothing to read (checked below, as the others)
    fresh: list[list[memoryview]] = []  # per remote read: the parts of its buffers that are fresh tensors
    # a local verified load reads a payload of up to WHOLE_SHARE of the load a thread in one job, hashed
    # piece by piece as it comes in (Source.read_each), not in parallel slices hashed once all are in
    whole_max = 0
    if src.local and verify:
        todo = sum(spans[i][1] for i in idxs if i not in shared)
        whole_max = int(todo * WHOLE_SHARE / max(1, src.concurrency))
    for run in _runs([i for i in idxs if i not in shared and spans[i][1]], spans, COALESCE_GAP, limit):
        first = spans[run[0]]
        step = part if src.local else _piece(first[1], part, src.part_size)
        step = max(step, whole_max)
        if len(run) == 1 and first[1] > step:  # one big payload: parallel ranged reads into slices
            if run[0] not in split:
                split.append(run[0])
            for pos in range(0, first[1], step):
                jobs.append(_job(src, meta, run, [view_of(run[0])[pos : pos + step]], first[0] + pos))
                fresh.append([view_of(run[0])[pos : pos + step]] if run[0] not in into else [])
            continue
        views: list[memoryview] = []
        pos = first[0]
        for i in run:
            off, nbytes = spans[i][:2]
            if off > pos:
                views.append(memoryview(bytearray(off - pos)))
            views.append(view_of(i))
            pos = off + nbytes
        whole = [i for i in run if i not in split]  # verified in the job; the rest once their copies are in
        jobs.append(_job(src, meta, run, views, first[0], mvs if verify else None, whole))
        fresh.append([view_of(i) for i in run if i not in into])
    if verify:
        src.checks_payloads()
    helper = stop = None
    if not src.local and sum(len(v) for views in fresh for v in views) >= FAULT_HELPER_MIN:
        stop = threading.Event()
        helper = shared_pool().submit(fault_in_striped, fresh, stop)
    try:
        try:
            _run_jobs(jobs, src.concurrency)
        finally:
            if helper is not None and stop is not None:
                stop.set()
                if not helper.cancel():  # not queued behind other work: it ends at its next step
                    helper.result()
        src.wait_ahead()
        for i, at, n in copies:
            src.readinto(mvs[i][at - meta.storages[i][0] :][:n], at)  # copied from the range read ahead
        if verify and (split or shared or empty):
            verify_parallel(meta, split + list(shared) + empty, mvs)
    except IntegrityError:
        for i in idxs:  # a damaged block of an assembled source is named by its own error
            src.blame(*meta.storages[i][:2])
        raise
    return bufs


def _views_only(
    src: Source, meta: Meta, idxs: list[int], shared: dict[int, torch.Tensor], verify: bool
) -> dict[int, torch.Tensor]:
    """:func:`read_payloads` where every payload is a view of what the source read ahead (or empty): once
    that is in, each verified."""
    import torch

    bufs = {i: shared[i] if i in shared else torch.empty(0, dtype=torch.uint8, device="cpu") for i in idxs}
    src.wait_ahead()
    if verify:
        try:
            verify_parallel(meta, idxs, {i: memoryview(b.numpy()) for i, b in bufs.items()})  # type: ignore[arg-type]
        except IntegrityError:
            for i in idxs:  # a damaged block of an assembled source is named by its own error
                src.blame(*meta.storages[i][:2])
            raise
    return bufs


def _job(
    src: Source,
    meta: Meta,
    run: list[int],
    views: list[memoryview],
    offset: int,
    verify: dict[int, memoryview] | None = None,
    check: list[int] | None = None,
) -> Callable[[], None]:
    """Read ``views`` (the payloads ``run``, in file order) from ``offset``; with ``verify``, check the
    payloads ``check`` (default: all of ``run``) as soon as they are in."""

    one = run[0] if len(views) == 1 and verify is not None and (check is None or check == run) else None

    def job() -> None:
        want = sum(len(v) for v in views)
        if src.local:  # fresh buffers populated at once, not page by page under the copy
            for v in views:
                prefault(v)
        if one is not None and src.local:  # one payload: hashed piece by piece while in the CPU cache
            hasher = xxhash.xxh3_64()
            got = src.read_each(views[0], offset, hasher.update)
            if got == want:
                if hasher.intdigest() != meta.storages[one][2]:
                    raise IntegrityError(f"{meta.source}: checksum mismatch in {describe_payload(meta, one)}")
                return
        else:
            got = src.readv(views, offset) if len(views) > 1 else src.readinto(views[0], offset)
        if got != want:
            raise IntegrityError(
                f"{meta.source}: truncated while reading {describe_payload(meta, run[0])}: bytes "
                f"[{offset}, {offset + want}) returned only {got}"
            )
        if verify is not None:  # while the bytes are still in cache
            _verify(meta, run if check is None else check, verify)

    return job


def _run_jobs(jobs: list[Callable[[], None]], concurrency: int) -> None:
    if len(jobs) <= 1 or concurrency <= 1:
        for j in jobs:
            j()
        return
    with Pool(min(concurrency, len(jobs)), thread_name_prefix="fpk-io") as ex:
        for f in [ex.submit(j) for j in jobs]:
            f.result()


def _verify(meta: Meta, idxs: list[int], mvs: dict[int, memoryview]) -> None:
    for i in idxs:
        if xxhash.xxh3_64_intdigest(mvs[i]) != meta.storages[i][2]:
            raise IntegrityError(f"{meta.source}: checksum mismatch in {describe_payload(meta, i)}")


def map_payloads(src: Source, meta: Meta, idxs: list[int], verify: bool) -> dict[int, torch.Tensor]:
    """Zero-copy, lazy: each storage is a copy-on-write view of a private mapping of the file."""
    import torch

    if src.fd is None:
        raise ValueError(f"mmap=True needs a local file; {meta.source} is not one (load it without mmap)")
    mm = _mmap.mmap(src.fd, meta.size, access=_mmap.ACCESS_COPY)
    out: dict[int, torch.Tensor] = {}
    for i in idxs:
        off, nbytes = meta.storages[i][:2]
        if nbytes == 0:
            out[i] = torch.empty(0, dtype=torch.uint8, device="cpu")
        else:
            out[i] = torch.frombuffer(mm, dtype=torch.uint8, count=nbytes, offset=off)
    if verify:  # the same pages the tensors map
        whole = memoryview(mm)
        verify_parallel(meta, idxs, {i: whole[s[0] : s[0] + s[1]] for i in idxs for s in (meta.storages[i],)})
    return out


def verify_parallel(meta: Meta, idxs: list[int], mvs: dict[int, memoryview], threads: int = 2) -> None:
    """:func:`_verify` with the payloads shared out among ``threads`` (xxhash releases the GIL), largest
    first, each to the least loaded thread; in the calling thread below ``PARALLEL_MIN`` bytes."""
    if threads <= 1 or sum(meta.storages[i][1] for i in idxs) < PARALLEL_MIN:
        _verify(meta, idxs, mvs)
        return
    groups = deal({i: meta.storages[i][1] for i in idxs}, threads)
    _run_jobs([functools.partial(_verify, meta, g, mvs) for g in groups if g], threads)

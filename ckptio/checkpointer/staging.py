"""Async save: snapshot copies of the state and the single background thread that persists them.

With ``async_save=True``, ``save`` copies every tensor into staging buffers kept between saves
(:class:`_Stager`: one copy of the state at most; reallocated only when shape, dtype or layout change;
populated once when allocated), then returns. ``Checkpointer.prepare(state)`` allocates and populates them
ahead, in the background thread (:meth:`_Stager.prepare`), so the first save only copies. Dense CPU tensors
are copied as raw bytes (:func:`ckptio.osio.memmove`, GIL released) in 16 MiB chunks that the calling thread
and up to three helpers take one at a time (:func:`_memmove_all`): torch's ``copy_`` splits each copy
statically over its intra-op threads and spins at a barrier, which collapses when other processes (data loader
workers) keep the cores busy (1 GiB: ~2 s instead of ~0.15 s on a busy 2-core machine). Other tensors (strided
views with gaps, conjugate/negative views, CUDA tensors, copied into pinned buffers with ``non_blocking``) use
``copy_``; sparse, quantized and subclass tensors are cloned.

A single background thread (:class:`Background`) persists and commits. The next
``save``/``load``/``wait`` first waits for it and re-raises its exception if it failed; a failure is
also logged at once, in case no such call comes.
"""

from __future__ import annotations

import concurrent.futures as cf
import copy
import functools
import os
import threading
from collections.abc import Callable
from typing import Any

import torch

from .. import osio
from ..errors import logger
from ..threads import Pool, lower_priority

log = logger("ckptio.checkpointer")

_CHUNK = 16 << 20  # the unit of work the copy threads take, one at a time
_PARALLEL_MIN = 64 << 20  # below this, the calling thread copies alone
_THREADS = max(1, min(4, os.cpu_count() or 1))


def _memmove_all(jobs: list[tuple[torch.Tensor, torch.Tensor]], threads: int = _THREADS) -> None:
    """Copy the bytes of each ``(dst, src)`` pair of dense CPU tensors with equal strides, in chunks
    taken one at a time by the calling thread and ``threads - 1`` helpers: no static split and no
    barrier spinning, so a thread the scheduler preempts (busy cores) delays the end by one chunk at
    most while the others take the rest."""
    spans = [(d.data_ptr(), s.data_ptr(), s.numel() * s.element_size()) for d, s in jobs]
    chunks = [(d + o, s + o, min(_CHUNK, n - o)) for d, s, n in spans for o in range(0, n, _CHUNK)]
    total = sum(n for _, _, n in spans)
    it = iter(chunks)  # shared: each next() hands one chunk to one thread

    def work() -> None:
        for d, s, n in it:
            osio.memmove(d, s, n)

    helpers = []
    if threads > 1 and total >= _PARALLEL_MIN:
        helpers = [threading.Thread(target=work, name="ckptio-staging", daemon=True) for _ in range(threads - 1)]
    for h in helpers:
        h.start()
    work()
    for h in helpers:
        h.join()


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill ``numel`` consecutive slots in some order of its dimensions
    (contiguous, channels-last, transposed...): then its bytes are one span from ``data_ptr()``."""
    if t.numel() == 0:
        return True
    expected = 1
    for stride, size in sorted((s, n) for s, n in zip(t.stride(), t.shape, strict=True) if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True


class _Stager:
    """Copies a state tree into CPU buffers reused across calls (keyed by path, reallocated on change)."""

    torch_copy = False  # benchmarks/checkpointer_bench.py only: the old path (torch copy_ for every tensor)

    def __init__(self) -> None:
        self._bufs: dict[tuple, torch.Tensor] = {}
        self.nbytes = 0
        self.allocations = 0  # buffers allocated so far (tests: a prepared save allocates none)
        self._lock = threading.Lock()  # one stage/prepare at a time: both replace buffers in _bufs

    def _alloc(self, t: torch.Tensor, flat: bool) -> torch.Tensor:
        """A buffer for ``t``: its strides when its bytes are one span (so one memmove fills it), pinned for
        CUDA tensors, and populated at once (fresh memory faults in slowly; later saves reuse it)."""
        pin = t.device.type == "cuda"
        self.allocations += 1
        if flat and not self.torch_copy:
            buf = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu", pin_memory=pin)
        else:
            buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
        if not pin and buf.numel() and not self.torch_copy:
            osio.prefault_range(buf.data_ptr(), buf.numel() * buf.element_size())
        return buf

    def prepare(self, tree: Any) -> None:
        """Allocate and fault in the buffers that staging ``tree`` needs, copying nothing (its tensors are a
        template: shapes, dtypes, strides, devices), so the next :meth:`stage` of a tree of that shape only
        copies. Costs what staging would: one buffer per tensor of ``tree``, held until a later stage drops it."""
        with self._lock:
            self._stage(tree, (), set(), None)
            self.nbytes = sum(b.numel() * b.element_size() for b in self._bufs.values())

    def release(self) -> None:
        """Drop every buffer (a closed Checkpointer holds no copy of the state; a later save allocates anew)."""
        with self._lock:
            self._bufs.clear()
            self.nbytes = 0

    def stage(self, tree: Any) -> Any:
        used: set[tuple] = set()
        jobs: list[tuple[torch.Tensor, torch.Tensor]] = []
        with self._lock:
            out = self._stage(tree, (), used, jobs)
            _memmove_all(jobs)
            for k in set(self._bufs) - used:  # bounded: only buffers of the current state are kept
                del self._bufs[k]
            self.nbytes = sum(b.numel() * b.element_size() for b in self._bufs.values())
            if any(b.is_pinned() for b in self._bufs.values()):
                torch.cuda.synchronize()
        return out

    def _stage(
        self, obj: Any, path: tuple, used: set[tuple], jobs: list[tuple[torch.Tensor, torch.Tensor]] | None
    ) -> Any:
        """Stage ``obj`` into the buffers; ``jobs=None`` (prepare): only make sure the buffers exist."""
        if isinstance(obj, torch.Tensor):
            t = obj.detach()
            if t.layout != torch.strided or t.is_quantized or t.is_nested or type(t) is not torch.Tensor:
                return None if jobs is None else t.clone()  # sparse, quantized, DTensor...: a plain copy, not pooled
            flat = t.device.type == "cpu" and _dense(t) and not (t.is_conj() or t.is_neg())
            buf = self._bufs.get(path)
            if (
                buf is None
                or buf.shape != t.shape
                or buf.dtype != t.dtype
                or (flat and not self.torch_copy and buf.stride() != t.stride())
            ):
                buf = self._alloc(t, flat)
                self._bufs[path] = buf
            used.add(path)
            if jobs is None:
                return None
            if flat and not self.torch_copy:
                jobs.append((buf, t))
            else:
                buf.copy_(t, non_blocking=buf.is_pinned())
            return buf
        if isinstance(obj, dict):
            try:
                out = type(obj)()
            except TypeError:
                out = {}
            for k, v in obj.items():
                out[k] = self._stage(v, path + (k,), used, jobs)
            return out
        if isinstance(obj, list):
            return [self._stage(v, path + (i,), used, jobs) for i, v in enumerate(obj)]
        if isinstance(obj, tuple):
            items = [self._stage(v, path + (i,), used, jobs) for i, v in enumerate(obj)]
            return type(obj)(*items) if hasattr(obj, "_fields") else tuple(items)
        return None if jobs is None else copy.deepcopy(obj)


def _report_background_failure(uri: str, fut: cf.Future) -> None:
    """Log a failed background save at once: if the program ends without another call, the error
    would otherwise vanish. It is still raised by the next ``save``/``wait``/``close``."""
    exc = fut.exception()
    if exc is not None:
        log.error("background save of %s failed; it will be raised by the next save/wait/close: %r", uri, exc)


class Background:
    """The one background persist thread (started on first use) and the save it runs, if any."""

    def __init__(self) -> None:
        self._pool: Pool | None = None
        self._future: cf.Future | None = None
        self._lock = threading.Lock()

    def submit(self, uri: str, nice: int | None, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn(*args)`` (the save of ``uri``) in the thread, started at nice increment ``nice``."""
        if self._pool is None:
            self._pool = Pool(
                1,
                thread_name_prefix="ckptio-checkpointer",
                initializer=lower_priority,
                initargs=(nice,),
                inline_at_exit=True,  # a save started while the interpreter exits completes before save() returns
            )
        self._future = self._pool.submit(fn, *args)
        self._future.add_done_callback(functools.partial(_report_background_failure, uri))

    def wait(self) -> None:
        """Wait for the background save, if any; re-raise its exception if it failed."""
        with self._lock:
            fut, self._future = self._future, None
        err = None if fut is None else fut.exception()
        if err is not None:
            # raised from no local of this frame (the error's traceback holds it): no reference cycle
            # keeping the failed save's frames, and the state they staged, until the gc runs
            del fut
            try:
                raise err
            finally:
                del err

    def close(self) -> None:
        """Wait for the background save (raising its error) and stop the thread."""
        try:
            self.wait()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None

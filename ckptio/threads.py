"""Thread pools sized to the work, and that keep working while the interpreter exits.

Starting a pool's threads and handing work to them costs 0.1-0.2 ms per call (more with the CPU
caches cold, as they are between a training step's saves), which is as long as hashing or copying
a few MiB. Below :data:`PARALLEL_MIN` bytes the work runs in the calling thread: :func:`executor`
hands out an :class:`Inline` executor that behaves as a pool does (errors through the future).
Tasks that mostly wait on storage go to :func:`shared_pool`, whose threads are started once.

Every pool in ckptio is a :class:`Pool`. Once the interpreter starts to exit (before ``atexit``
handlers run), ``concurrent.futures`` refuses new work on every pool ("cannot schedule new futures
after interpreter shutdown"): a save made by an ``atexit`` handler, often a job's last checkpoint,
failed as soon as it used a thread. A :class:`Pool`'s tasks then queue for at most ``max_workers``
threads of its own, and :func:`exit_safe` gives an event loop one as its default executor.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures as cf
import logging
import os
import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any

_log = logging.getLogger("ckptio")

PARALLEL_MIN = 8 << 20  # bytes of hashing or copying below which another thread does not pay for itself


class Pool(cf.ThreadPoolExecutor):
    """A ``ThreadPoolExecutor`` that still runs tasks while the interpreter exits (see the module
    docstring). Then its tasks queue for at most ``max_workers`` threads of its own, started as
    needed and joined by ``shutdown(wait=True)``: the same concurrency as before the exit, so a
    large load does not start a thread per request. ``inline_at_exit``: run each task in the caller
    instead, for work nothing may wait for (an async save whose caller returns: threads started
    during the exit are not waited for by the interpreter). A pool shut down by its owner, or
    broken, refuses work as any pool does."""

    def __init__(
        self,
        max_workers: int | None = None,
        thread_name_prefix: str = "",
        *,
        inline_at_exit: bool = False,
        **kw: Any,
    ) -> None:
        super().__init__(max_workers, thread_name_prefix, **kw)
        self._limit = max_workers if max_workers is not None else min(32, (os.cpu_count() or 1) + 4)  # as the base's
        self._name = thread_name_prefix or "ckptio"
        self._inline_at_exit = inline_at_exit
        self._closed = False
        self._lock = threading.Lock()
        self._queue: collections.deque[tuple[cf.Future, Callable[..., Any], tuple, dict]] = collections.deque()
        self._workers = 0  # threads of its own taking from _queue
        self._started: list[threading.Thread] = []

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> cf.Future:
        try:
            return super().submit(fn, *args, **kwargs)
        except cf.BrokenExecutor:
            raise
        except RuntimeError:
            if self._closed:  # shut down by its owner: as any pool
                raise
        f: cf.Future = cf.Future()  # refused because the interpreter is exiting
        if self._inline_at_exit:
            _run_into(f, fn, args, kwargs)
            return f
        with self._lock:
            self._queue.append((f, fn, args, kwargs))
            if self._workers < self._limit:
                self._workers += 1
                t = threading.Thread(target=self._work, name=f"{self._name}-exiting")
                self._started.append(t)
                t.start()
        return f

    def _work(self) -> None:
        while True:
            with self._lock:
                if not self._queue:
                    self._workers -= 1
                    return
                task = self._queue.popleft()
            _run_into(*task)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self._closed = True
        super().shutdown(wait, cancel_futures=cancel_futures)
        with self._lock:
            if cancel_futures:
                for f, *_ in self._queue:
                    f.cancel()
                self._queue.clear()
            started, self._started = self._started, []
        if wait:
            for t in started:
                t.join()


def _run_into(f: cf.Future, fn: Callable[..., Any], args: tuple, kwargs: dict) -> None:
    if not f.set_running_or_notify_cancel():
        return
    try:
        f.set_result(fn(*args, **kwargs))
    except BaseException as e:  # noqa: BLE001 - handed on through the future, as a pool would
        f.set_exception(e)


class Inline(cf.Executor):
    """Runs each task at once in the calling thread (no threads to start or hand over to)."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> cf.Future:
        f: cf.Future = cf.Future()
        try:
            f.set_result(fn(*args, **kwargs))
        except BaseException as e:  # noqa: BLE001 - handed on through the future, as a pool would
            f.set_exception(e)
        return f


def deal(sizes: dict[int, int], workers: int) -> list[list[int]]:
    """The keys of ``sizes`` shared out among ``workers`` by size: the largest first, each to the worker
    with the least so far (each share in the order dealt)."""
    shares: list[list[int]] = [[] for _ in range(workers)]
    loads = [0] * workers
    for i in sorted(sizes, key=lambda i: -sizes[i]):
        k = loads.index(min(loads))
        shares[k].append(i)
        loads[k] += sizes[i]
    return shares


def executor(workers: int, name: str, nbytes: int | None = None) -> cf.Executor:
    """A pool of ``workers`` threads named ``name``, or :class:`Inline` when the work (``nbytes``, when
    given) is below :data:`PARALLEL_MIN`."""
    if nbytes is not None and nbytes < PARALLEL_MIN:
        return Inline()
    return Pool(max(1, workers), thread_name_prefix=name)


_safe_loops: weakref.WeakSet = weakref.WeakSet()
_safe_lock = threading.Lock()


def exit_safe(loop: asyncio.AbstractEventLoop) -> None:
    """Give ``loop`` a :class:`Pool` as its default executor, once: what it runs in threads
    (``run_in_executor(None)``, the DNS lookup of each new connection) then still runs while the
    interpreter exits. For the IO loop of the object store and fsspec backends (fsspec's)."""
    if loop in _safe_loops:
        return
    with _safe_lock:
        if loop not in _safe_loops:
            loop.set_default_executor(Pool(thread_name_prefix="ckptio-loop"))
            _safe_loops.add(loop)


_shared: Pool | None = None
_shared_lock = threading.Lock()
SHARED_WORKERS = 16


def shared_pool() -> cf.Executor:
    """One process-wide pool for short tasks that mostly wait on storage (a load's read-ahead
    requests): its threads outlive a call, so a small load does not start and join threads of its
    own. Only for tasks that never wait on other tasks of this pool (no deadlock when it is full:
    they queue). A forked child starts a new one (the parent's threads do not exist there)."""
    global _shared
    pool = _shared
    if pool is None:
        with _shared_lock:
            if _shared is None:
                _shared = Pool(SHARED_WORKERS, thread_name_prefix="ckptio-io")
            pool = _shared
    return pool


def lower_priority(nice: int | None) -> None:
    """Raise the calling thread's nice value (Linux: per thread, inherited by threads it creates)."""
    if nice and sys.platform.startswith("linux"):
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), os.getpriority(os.PRIO_PROCESS, 0) + nice)
        except OSError as e:
            _log.debug("could not lower the persist thread's priority: %s", e)


def _forget_after_fork() -> None:
    global _shared, _shared_lock
    _shared, _shared_lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)


def all_of(futs: list[cf.Future[int]]) -> cf.Future[int]:
    """A future of the sum of ``futs``' results once every one is done (not before: none is still
    running when it is); the first failure's error if any failed, CancelledError if one was cancelled."""
    out: cf.Future[int] = cf.Future()
    out.set_running_or_notify_cancel()
    if not futs:
        out.set_result(0)
        return out
    futs = list(futs)  # emptied once all are done: each keeps the callback that holds it (a reference cycle)
    left = [len(futs)]
    lock = threading.Lock()

    def done(_: cf.Future[int]) -> None:
        with lock:
            left[0] -= 1
            if left[0] > 0:
                return
            ended = futs[:]
            futs.clear()
        if any(f.cancelled() for f in ended):
            out.set_exception(cf.CancelledError())
            return
        errors = [e for e in (f.exception() for f in ended) if e is not None]
        if errors:
            out.set_exception(errors[0])
        else:
            out.set_result(sum(f.result() for f in ended))

    for f in futs:
        f.add_done_callback(done)
    return out

"""Thread pools sized to the work.

Starting a pool's threads and handing work to them costs 0.1-0.2 ms per call (more with the CPU
caches cold, as they are between a training step's saves), which is as long as hashing or copying
a few MiB. Below :data:`PARALLEL_MIN` bytes the work runs in the calling thread: :func:`executor`
hands out an :class:`Inline` executor that behaves as a pool does (errors through the future).
Tasks that mostly wait on storage go to :func:`shared_pool`, whose threads are started once.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import threading
from collections.abc import Callable
from typing import Any

PARALLEL_MIN = 8 << 20  # bytes of hashing or copying below which another thread does not pay for itself


class Inline(cf.Executor):
    """Runs each task at once in the calling thread (no threads to start or hand over to)."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> cf.Future:
        f: cf.Future = cf.Future()
        try:
            f.set_result(fn(*args, **kwargs))
        except BaseException as e:  # noqa: BLE001 - handed on through the future, as a pool would
            f.set_exception(e)
        return f


def executor(workers: int, name: str, nbytes: int | None = None) -> cf.Executor:
    """A pool of ``workers`` threads named ``name``, or :class:`Inline` when the work (``nbytes``, when
    given) is below :data:`PARALLEL_MIN`."""
    if nbytes is not None and nbytes < PARALLEL_MIN:
        return Inline()
    return cf.ThreadPoolExecutor(max(1, workers), thread_name_prefix=name)


_shared: cf.ThreadPoolExecutor | None = None
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
                _shared = cf.ThreadPoolExecutor(SHARED_WORKERS, thread_name_prefix="ckptio-io")
            pool = _shared
    return pool


def _forget_after_fork() -> None:
    global _shared, _shared_lock
    _shared, _shared_lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)

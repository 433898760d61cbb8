"""Thread pools sized to the work.

Starting a pool's threads and handing work to them costs 0.1-0.2 ms per call (more with the CPU
caches cold, as they are between a training step's saves), which is as long as hashing or copying
a few MiB. Below :data:`PARALLEL_MIN` bytes the work runs in the calling thread: :func:`executor`
hands out an :class:`Inline` executor that behaves as a pool does (errors through the future).
"""

from __future__ import annotations

import concurrent.futures as cf
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

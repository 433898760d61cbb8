"""Eviction of the node-local cache: leftovers of dead fills first, then entries by least recent use
(file mtime), removed until the cache holds at most a given number of bytes. Only entries whose lock
can be taken exclusively without waiting are removed (the protocol is in :mod:`ckptio.cache.store`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable

from .entries import Item, scan
from .locks import FileLock


def shrink(cache_dir: str, limit: int, *, everything: bool = False, evicted: Callable[[], None] = lambda: None) -> None:
    """Remove leftovers of dead fills, then entries by least recent use, until ``cache_dir`` holds at
    most ``limit`` bytes (``everything``: all that is not in use); ``evicted()`` is called for each
    entry removed. Never waits for a lock."""
    locks = os.path.join(cache_dir, "locks")
    items = sorted(scan(cache_dir), key=lambda it: (it.kind == "entry", it.mtime))
    total = sum(it.size for it in items)
    for it in items:
        if total <= limit and not everything:
            break
        lockp = os.path.join(locks, f"{it.key}.lock")
        lock = FileLock.try_exclusive(lockp)
        if lock is None:
            continue  # in use or being filled
        with lock:
            if _remove(it, evicted):
                total -= it.size
            with contextlib.suppress(FileNotFoundError):
                os.unlink(lockp)  # holders re-check the inode, so this is safe


def _remove(it: Item, evicted: Callable[[], None]) -> bool:
    """Holding ``it``'s exclusive lock: remove its files unless they changed since the scan."""
    if it.kind == "entry":
        if not os.path.exists(it.paths[0]):
            return False  # evicted by someone else
        evicted()
    elif it.kind == "meta":
        with contextlib.suppress(FileNotFoundError):
            if any(n.startswith(it.key + "-") for n in os.listdir(os.path.dirname(it.paths[0]))):
                return False  # its fill completed after the scan
    for p in it.paths:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(p)
    return True

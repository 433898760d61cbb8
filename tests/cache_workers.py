"""Subprocess entry points for the cache and distributed tests (spawned, so importable by path)."""

from __future__ import annotations

import json
import os
import sys
import time

from ckptio.backends.cached import CachedBackend
from ckptio.backends.local import LocalBackend


class SlowLocal(LocalBackend):
    """A local 'remote' that counts reads and sleeps on each, so fills take long enough to race or kill."""

    def __init__(self, delay: float = 0.0, **kw) -> None:
        super().__init__(**kw)
        self.delay = delay
        self.reads = 0

    def readinto(self, uri, buf, offset=0):
        self.reads += 1
        time.sleep(self.delay)
        return super().readinto(uri, buf, offset)


def slow_cache(cache_dir: str, delay: float, part_size: int = 4096, **kw) -> CachedBackend:
    return CachedBackend(SlowLocal(delay, part_size=part_size, concurrency=1), cache_dir, **kw)


def fill_main(uri: str, cache_dir: str, delay: float, go: str) -> None:
    """Wait for ``go`` to exist, fill ``uri``, read it back, print stats and the bytes' length as JSON."""
    cache = slow_cache(cache_dir, delay)
    while not os.path.exists(go):
        time.sleep(0.005)
    data = cache.read(uri)
    with open(uri, "rb") as f:
        ok = f.read() == data
    print(json.dumps({**cache.stats(), "ok": ok, "reads": cache.inner.reads}), flush=True)


if __name__ == "__main__":
    cmd, *args = sys.argv[1:]
    if cmd == "fill":
        fill_main(args[0], args[1], float(args[2]), args[3])
    else:
        raise SystemExit(f"unknown command {cmd!r}")

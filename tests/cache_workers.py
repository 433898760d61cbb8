"""Subprocess entry points for the cache and distributed tests (spawned, so importable by path)."""

from __future__ import annotations

import json
import os
import sys
import time

from ckptio.backends.local import LocalBackend
from ckptio.cache import CachedBackend


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


def readonly_main(cache_dir: str, uri: str) -> None:
    """Use a cache directory the caller made read-only: print what a load and ``ckptio cache`` did, as JSON."""
    import contextlib
    import io

    import ckptio
    from ckptio import cli

    def attempt(fn) -> dict:
        try:
            fn()
            return {"ok": True}
        except Exception as e:  # the parent asserts on the kind and the message
            return {
                "ok": False,
                "type": type(e).__name__,
                "permission": isinstance(e, PermissionError),
                "not_found": isinstance(e, FileNotFoundError),
                "message": str(e),
            }

    def run_cli(*argv: str) -> dict:
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = cli.main(["cache", *argv, "--cache-dir", cache_dir])
        return {"code": code, "out": out.getvalue(), "err": err.getvalue()}

    res = {
        "load": attempt(lambda: ckptio.load(uri, cache=cache_dir)),
        "stats": run_cli("stats"),
        "clear": run_cli("clear"),
    }
    print(json.dumps(res), flush=True)


def _outcome(fn) -> list:
    try:
        return ["ok", fn()]
    except Exception as e:  # the parent asserts on the type and message
        return ["error", type(e).__name__, str(e)]


def dist_main(rank: int, world: int, port: int, backends: dict, root: str, tmp: str) -> None:
    """One gloo rank running every ckptio.distributed scenario against ``root``; results to ``tmp/rank<r>.json``."""
    import datetime

    import torch
    import torch.distributed as dist

    import ckptio
    import ckptio.distributed as D

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    ckptio.configure(backends=backends)
    node = f"n{rank // 2}"
    res: dict = {}
    res["one_node"] = _outcome(lambda: D.load(f"{root}/a.pt", cache=f"{tmp}/one", timeout=30)["w"].tolist())
    res["two_nodes"] = _outcome(
        lambda: D.load(f"{root}/b.pt", cache=f"{tmp}/{node}", node=node, timeout=30)["w"].tolist()
    )
    res["network"] = _outcome(lambda: D.load(f"{root}/c.pt", mode="network", chunk_size=700, timeout=30)["w"].tolist())

    def dcp_load():
        sd = {"w": torch.zeros(8, 4), "b": torch.zeros(16, dtype=torch.int64)}
        D.load_dcp(sd, f"{root}/dcp", cache=f"{tmp}/one", timeout=30)
        return [sd["w"].sum().item(), sd["b"].tolist()]

    res["dcp"] = _outcome(dcp_load)
    res["missing"] = _outcome(lambda: D.load(f"{root}/missing.pt", cache=f"{tmp}/one", timeout=30))
    res["missing_network"] = _outcome(lambda: D.load(f"{root}/missing.pt", mode="network", timeout=30))
    if rank == 0:  # the downloading rank gets stuck in its fill: the others must give up at their timeout
        fill = CachedBackend.fill
        CachedBackend.fill = lambda self, *a, **kw: (time.sleep(4), fill(self, *a, **kw))[1]  # type: ignore
    t0 = time.monotonic()
    res["stuck"] = _outcome(lambda: D.load(f"{root}/a.pt", cache=f"{tmp}/one", timeout=1.5))
    res["stuck_seconds"] = time.monotonic() - t0
    with open(os.path.join(tmp, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)
    os._exit(0)  # the group is unusable after the timeout scenario


if __name__ == "__main__":
    cmd, *args = sys.argv[1:]
    if cmd == "fill":
        fill_main(args[0], args[1], float(args[2]), args[3])
    elif cmd == "readonly":
        readonly_main(args[0], args[1])
    else:
        raise SystemExit(f"unknown command {cmd!r}")

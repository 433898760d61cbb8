"""Tiered checkpoints (issue 17): blocking time of a save and restore time, tiered vs plain, on moto S3.

For a state of ``size`` bytes (:func:`ckptio.bench.workload.make_state`), per repeat, each in a fresh root:

* save, blocking time: a plain local-root save (sync), a tiered save (sync: the local commit; the
  replication runs after), today's async save to S3 and a tiered async save (both: until ``save``
  returns); the replication time of the tiered save (``wait``) is reported too;
* restore: a plain local restore vs a tiered restore on the same node (the verified local copy), and
  today's remote restore vs a tiered restore on a "fresh node" (an empty local tier: the remote copy).

Every load faults in every page (:func:`~ckptio.bench.workload.touch`). Reported: the median of the
repeats and the ratios the issue targets (tiered sync save <= 1.1x local; restore same node >= 0.9x
of local speed; fresh node no slower than remote).
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import statistics
import tempfile
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .workload import make_state, same, touch


def _timed(fn: Callable[[], Any]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _blank(ref: dict[str, torch.Tensor]) -> dict[str, Any]:
    return {"model": {k: torch.empty_like(v) for k, v in ref.items()}}


@contextlib.contextmanager
def _s3() -> Iterator[str]:
    import ckptio

    from .servers import MOTO_S3_OPTIONS, MotoServer, make_s3_bucket

    with MotoServer() as srv:
        make_s3_bucket(srv.url, "bench")
        ckptio.configure(backends={"s3": {"endpoint_url": srv.url, **MOTO_S3_OPTIONS}})
        yield "s3://bench"


def one_round(base: str, tmp: str, fmt: str, state: dict[str, torch.Tensor], flip: bool = False) -> dict[str, float]:
    """Seconds of every measurement, once, each in fresh roots; the two sides of each comparison run in
    turn, the tiered one second (``flip``: first), so neither always pays for the other's writeback."""
    from ..checkpointer import Checkpointer

    run = uuid.uuid4().hex[:8]
    out: dict[str, float] = {}
    sd = {"model": state}

    def load(ck: Checkpointer) -> float:
        target = _blank(state)

        def go() -> None:
            ck.load(target, step=1)
            touch(target)

        took = _timed(go)
        assert same(state, target["model"]), "restored state differs"
        return took

    def pair(a: tuple[str, Callable[[], float]], b: tuple[str, Callable[[], float]]) -> None:
        for name, fn in (b, a) if flip else (a, b):
            out[name] = fn()

    plain = Checkpointer(f"{tmp}/{run}-plain", format=fmt)
    tiered = Checkpointer(f"{base}/{run}-tiered", format=fmt, local_tier=f"{tmp}/{run}-tier")
    pair(
        ("save local (sync)", lambda: _timed(lambda: plain.save(1, sd))),
        ("save tiered (sync)", lambda: _timed(lambda: tiered.save(1, sd))),
    )
    out["replication (wait)"] = _timed(tiered.wait)
    plain_async = Checkpointer(f"{base}/{run}-async", format=fmt, async_save=True)
    tiered_async = Checkpointer(f"{base}/{run}-tasync", format=fmt, async_save=True, local_tier=f"{tmp}/{run}-tasync")

    def save_async(ck: Checkpointer) -> float:
        took = _timed(lambda: ck.save(1, sd))
        ck.wait()
        return took

    pair(
        ("save s3 (async)", lambda: save_async(plain_async)), ("save tiered (async)", lambda: save_async(tiered_async))
    )
    pair(("restore local", lambda: load(plain)), ("restore tiered, same node", lambda: load(tiered)))
    fresh = Checkpointer(f"{base}/{run}-tiered", format=fmt, local_tier=f"{tmp}/{run}-fresh")
    pair(
        ("restore s3", lambda: load(Checkpointer(f"{base}/{run}-tiered"))),
        ("restore tiered, fresh node", lambda: load(fresh)),
    )
    for ck in (tiered, tiered_async, fresh, plain_async):
        ck.close()
    return {k: out[k] for k in ORDER}


ORDER = (
    "save local (sync)",
    "save tiered (sync)",
    "replication (wait)",
    "save s3 (async)",
    "save tiered (async)",
    "restore local",
    "restore tiered, same node",
    "restore s3",
    "restore tiered, fresh node",
)
RATIOS = (
    ("tiered sync save / local sync save (target <= 1.1)", "save tiered (sync)", "save local (sync)"),
    ("tiered async save / s3 async save (target ~1)", "save tiered (async)", "save s3 (async)"),
    ("local restore / tiered same-node restore (speed, target >= 0.9)", "restore local", "restore tiered, same node"),
    ("tiered fresh-node restore / s3 restore (target <= 1)", "restore tiered, fresh node", "restore s3"),
)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", type=int, default=256, help="state size in MiB (default 256)")
    p.add_argument("--repeats", type=int, default=3, help="rounds (median)")
    p.add_argument("--format", default="fpk", choices=["fpk", "pt", "dcp"])
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore")
    state = make_state(args.size << 20)
    rounds = []
    with _s3() as base, tempfile.TemporaryDirectory(prefix="ckptio-tier-") as tmp:
        one_round(base, tmp, args.format, make_state(1 << 20))  # warm-up: imports, clients, threads
        for i in range(args.repeats):
            rounds.append(one_round(base, tmp, args.format, state, flip=i % 2 == 1))
            shutil.rmtree(tmp, ignore_errors=True)
    print(f"== tiered checkpoints ({args.format}, {args.size} MiB, moto S3, median [min-max] of {args.repeats})")
    for k in ORDER:
        print(f"{k:<30} {_spread([r[k] for r in rounds], 3)} s")
    for label, a, b in RATIOS:  # per round: the two sides ran back to back
        print(f"{label:<66} {_spread([r[a] / r[b] for r in rounds], 2)}")
    return 0


def _spread(xs: list[float], digits: int) -> str:
    return f"{statistics.median(xs):.{digits}f} [{min(xs):.{digits}f}-{max(xs):.{digits}f}]"

"""Incremental checkpoints (issue 16), workload F: five saves of a state whose bytes are ~90% frozen.

State of ``size`` bytes: a frozen backbone (90%), a trainable head and the head's Adam moments (the
other 10%, new every save). For each target (local with fsync; S3 on a moto server), five saves with
``Checkpointer(incremental=True)`` and five without, interleaved per repeat; reported per save: the
median seconds and the bytes written, then the ratio of saves 2-5 (non-incremental / incremental).
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
from collections.abc import Iterator
from typing import Any

import torch

SAVES = 5


def workload_f(size: int, step: int) -> dict[str, Any]:
    """~90% frozen backbone (same bytes every step), head + its two Adam moments (new every step)."""
    g = torch.Generator().manual_seed(0)
    per = max(1, size * 9 // 10 // 16 // 4)
    backbone = {f"backbone.{i}": torch.randn(per, generator=g) for i in range(16)}
    head_n = max(1, size // 10 // 3 // 4)
    g.manual_seed(1000 + step)
    head = torch.randn(head_n, generator=g)
    moments = {"exp_avg": torch.randn(head_n, generator=g), "exp_avg_sq": torch.rand(head_n, generator=g)}
    return {"model": {**backbone, "head": head}, "optim": {"state": {"head": moments}}, "step": step}


@contextlib.contextmanager
def targets(which: list[str]) -> Iterator[Iterator[tuple[str, str]]]:
    """(name, base URI) of each storage target, its server running for the block."""
    import ckptio

    from .servers import MOTO_S3_OPTIONS, MotoServer, make_s3_bucket

    stack = contextlib.ExitStack()
    out = []
    with stack:
        if "local" in which:
            out.append(("local", stack.enter_context(tempfile.TemporaryDirectory(prefix="ckptio-inc-"))))
        if "s3" in which:
            srv = stack.enter_context(MotoServer())
            make_s3_bucket(srv.url, "bench")
            ckptio.configure(backends={"s3": {"endpoint_url": srv.url, **MOTO_S3_OPTIONS}})
            out.append(("s3", "s3://bench"))
        yield iter(out)


def run_saves(root: str, fmt: str, incremental: bool, size: int) -> list[tuple[float, int]]:
    """(seconds, bytes written) of each of the five saves into a fresh root."""
    from ..checkpointer import Checkpointer

    ck = Checkpointer(root, format=fmt, incremental=incremental)
    out = []
    for step in range(1, SAVES + 1):
        state = workload_f(size, step)
        t = time.perf_counter()
        ck.save(step, state)
        took = time.perf_counter() - t
        res = ck.last_save
        written = res.bytes_written if res is not None and res.bytes_written is not None else _logical(state)
        out.append((took, written))
    return out


def _logical(state: Any) -> int:
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(_logical(v) for v in state.values())
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", type=int, default=1024, help="state size in MiB (default 1024)")
    p.add_argument("--repeats", type=int, default=3, help="runs of the five saves per mode (median)")
    p.add_argument("--format", default="fpk", choices=["fpk", "pt"])
    p.add_argument("--targets", default="local,s3", help="comma-separated: local, s3")
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore")
    size = args.size << 20
    with targets(args.targets.split(",")) as found:
        for name, base in found:
            times: dict[bool, list[list[float]]] = {False: [], True: []}
            written: dict[bool, list[int]] = {}
            for _ in range(args.repeats):
                for inc in (False, True):
                    root = f"{base.rstrip('/')}/{uuid.uuid4().hex[:8]}-{'inc' if inc else 'full'}"
                    res = run_saves(root, args.format, inc, size)
                    times[inc].append([t for t, _ in res])
                    written[inc] = [w for _, w in res]
                    if name == "local":
                        shutil.rmtree(root, ignore_errors=True)
            print(f"== {name} ({args.format}, {args.size} MiB, median of {args.repeats})")
            print(f"{'save':>4} {'full s':>8} {'inc s':>8} {'full MiB':>9} {'inc MiB':>9} {'inc %':>6}")
            for i in range(SAVES):
                full_t = statistics.median(r[i] for r in times[False])
                inc_t = statistics.median(r[i] for r in times[True])
                fw, iw = written[False][i], written[True][i]
                mib = f"{fw / 2**20:>9.1f} {iw / 2**20:>9.1f}"
                print(f"{i + 1:>4} {full_t:>8.3f} {inc_t:>8.3f} {mib} {100 * iw / fw:>6.1f}")
            full_rest = statistics.median(t for r in times[False] for t in r[1:])
            inc_rest = statistics.median(t for r in times[True] for t in r[1:])
            print(f"saves 2-{SAVES}: non-incremental / incremental time = {full_rest / inc_rest:.2f}x")
    return 0

"""Checkpointer async save: how long ``save`` blocks, and how much a training loop slows down while
persistence runs in the background. Local storage, fsync included, median of N, interleaved.

1. Blocking time of ``Checkpointer(async_save=True).save`` on a state of ``--mib`` MiB of float32
   tensors (staging buffers warm: the first save, which allocates them, is reported separately),
   against a single-threaded ``memmove`` of the same bytes into preallocated, touched tensors (the
   memcpy floor) and against the old staging path (torch ``copy_`` for every tensor, selected by the
   private ``_Stager.torch_copy`` flag), measured in the same run, A B C A B C. With ``--busy`` the same
   again while ``--hogs`` processes (default: one per core) spin pure-Python loops, as data loader
   workers do: torch's intra-op threads collapse under such contention, a single-threaded copy does not.
2. A CPU-bound training loop (matmuls, ``--train-threads`` intra-op threads) timed alone and while a
   save persists in the background (the loop starts right after ``save`` returns and runs a fixed
   number of iterations sized to outlast the persist).

    python -m benchmarks.checkpointer_bench [--mib 1024] [--repeats 3] [--format fpk] [--train-threads 1] [--nice 10]
                                            [--busy [--hogs N]] [--no-train]

Targets (issues 6 and 14): blocking <= 0.1 s/GiB idle and <= 0.25 s/GiB with every core busy; training
slowdown <= 25%.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import statistics
import tempfile
import time
import warnings
from typing import Any

import psutil
import torch

from ckptio.bench.busy import cpu_hog
from ckptio.checkpointer import Checkpointer

GIB = 1 << 30


def make_state(mib: int, n: int = 16) -> dict[str, torch.Tensor]:
    per = mib * (1 << 20) // n // 4
    return {f"layer{i}.weight": torch.randn(per) for i in range(n)}


def nbytes(sd) -> int:
    return sum(v.numel() * v.element_size() for v in sd.values())


def memcpy(src, dst) -> float:
    """One single-threaded libc memmove per tensor (the floor; torch's threaded copy_ collapses when busy)."""
    t = time.perf_counter()
    for k, v in src.items():
        ctypes.memmove(dst[k].data_ptr(), v.data_ptr(), v.numel() * v.element_size())
    return time.perf_counter() - t


def train_loop(iters: int, a: torch.Tensor, b: torch.Tensor) -> float:
    t = time.perf_counter()
    for _ in range(iters):
        c = a @ b
        a.add_(c, alpha=1e-6)
    return time.perf_counter() - t


def spread(xs: list[float], gib: float) -> str:
    """``median [min-max]`` of ``xs`` in seconds per GiB."""
    return f"{statistics.median(xs) / gib:.3f} [{min(xs) / gib:.3f}-{max(xs) / gib:.3f}]"


def blocking(
    cks: dict[str, Checkpointer], state, dst, repeats: int, step: int
) -> tuple[dict[str, float], dict[str, list[float]], int]:
    """First-save blocking time per staging path, then ``repeats`` interleaved rounds (memcpy floor, then
    each path's save, timed until ``save`` returns; each persist waited for outside the timing)."""
    first = {}
    for ck in cks.values():  # one-time costs (imports, the persist thread) out of the first save's figure
        step += 1
        ck.save(step, {"warmup": torch.zeros(4)})
        ck.wait()
    for name, ck in cks.items():
        step += 1
        t = time.perf_counter()
        ck.save(step, {"model": state})
        first[name] = time.perf_counter() - t
        ck.wait()
    runs: dict[str, list[float]] = {"memcpy": [], **{name: [] for name in cks}}
    for _ in range(repeats):
        runs["memcpy"].append(memcpy(state, dst))
        for name, ck in cks.items():
            step += 1
            t = time.perf_counter()
            ck.save(step, {"model": state})
            runs[name].append(time.perf_counter() - t)
            ck.wait()
    return first, runs, step


def staging_table(res: dict, gib: float) -> None:
    print(
        f"\nstaging: blocking time of save(), s/GiB, median [min-max] of {res['repeats']} "
        "(targets: idle <= 0.1, busy <= 0.25)"
    )
    print(
        f"{'':<24}{'copy_ (old)':>24}{'memmove (new)':>24}{'old/new':>9}{'memcpy floor':>24}{'first save old/new':>22}"
    )
    for cond, r in res["staging"].items():
        old, new = r["runs"]["copy_"], r["runs"]["memmove"]
        ratio = statistics.median(old) / statistics.median(new)
        first = f"{r['first']['copy_'] / gib:.2f}/{r['first']['memmove'] / gib:.2f}"
        floor = spread(r["runs"]["memcpy"], gib)
        print(f"{cond:<24}{spread(old, gib):>24}{spread(new, gib):>24}{ratio:>8.2f}x{floor:>24}{first:>22}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--format", default="fpk", choices=["fpk", "pt", "dcp"])
    ap.add_argument("--train-threads", type=int, default=1)
    ap.add_argument("--nice", type=int, default=10, help="Checkpointer(background_nice=...); 0: same priority")
    ap.add_argument(
        "--busy", action="store_true", help="also measure staging while --hogs processes keep the cores busy"
    )
    ap.add_argument(
        "--hogs", type=int, default=os.cpu_count() or 1, help="CPU hog processes for --busy (default: one per core)"
    )
    ap.add_argument("--no-train", action="store_true", help="skip the training-loop slowdown")
    ap.add_argument("--dir", default=None, help="where checkpoints go (default: a temporary directory)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")

    root = tempfile.mkdtemp(prefix="ckptio-ckbench-", dir=args.dir)
    state = make_state(args.mib)
    size = nbytes(state)
    gib = size / GIB
    dst = {k: torch.empty_like(v).fill_(0) for k, v in state.items()}  # touched: no page faults in memcpy
    nice = args.nice or None
    ck = Checkpointer(os.path.join(root, "new"), format=args.format, async_save=True, keep_last=1, background_nice=nice)
    old = Checkpointer(
        os.path.join(root, "old"), format=args.format, async_save=True, keep_last=1, background_nice=nice
    )
    old._stager.torch_copy = True  # the staging path before issue 14, for comparison only
    cks = {"copy_": old, "memmove": ck}
    proc = psutil.Process()
    rss0 = proc.memory_info().rss
    step = 0
    staging: dict[str, dict[str, Any]] = {}
    try:
        # ---- 1. blocking time, idle and busy, old and new staging -------------------------------
        first, runs, step = blocking(cks, state, dst, args.repeats, step)
        staging["idle"] = {"first": first, "runs": runs}
        staging_rss = proc.memory_info().rss - rss0
        persists = []
        for _ in range(args.repeats):
            step += 1
            t = time.perf_counter()
            ck.save(step, {"model": state})
            ck.wait()
            persists.append(time.perf_counter() - t)
        if args.busy:
            for c in cks.values():  # the first save of the busy round allocates again
                c._stager = type(c._stager)()
            old._stager.torch_copy = True
            with cpu_hog(args.hogs):
                first_b, runs_b, step = blocking(cks, state, dst, args.repeats, step)
            staging[f"busy ({args.hogs} hogs)"] = {"first": first_b, "runs": runs_b}

        # ---- 2. training-loop slowdown ------------------------------------------------------
        alone, overlapped, iters = [], [], 0
        if not args.no_train:
            torch.set_num_threads(args.train_threads)
            a, b = torch.randn(384, 384), torch.randn(384, 384) * 1e-3
            train_loop(20, a, b)
            per_iter = train_loop(50, a, b) / 50
            iters = max(50, int(1.5 * statistics.median(persists) / per_iter))  # outlasts one persist
            for _ in range(args.repeats):
                alone.append(train_loop(iters, a, b))
                step += 1
                ck.save(step, {"model": state})
                overlapped.append(train_loop(iters, a, b))
                ck.wait()
        ck.close()
        old.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)

    med = statistics.median
    blocks, copies = staging["idle"]["runs"]["memmove"], staging["idle"]["runs"]["memcpy"]
    res = {
        "format": args.format,
        "bytes": size,
        "repeats": args.repeats,
        "fsync": True,
        "cpu_count": os.cpu_count(),
        "first_save_block_s": staging["idle"]["first"]["memmove"],
        "block_s": med(blocks),
        "block_s_per_gib": med(blocks) / gib,
        "memcpy_s_per_gib": med(copies) / gib,
        "block_over_memcpy": med(blocks) / med(copies),
        "staging": staging,
        "persist_s": med(persists),
        "persist_gb_s": size / med(persists) / 1e9,
        "staging_rss_mib": staging_rss / (1 << 20),
        "train_threads": args.train_threads,
        "background_nice": args.nice,
        "train_iters": iters,
        "train_alone_s": med(alone) if alone else None,
        "train_overlapped_s": med(overlapped) if alone else None,
        "train_slowdown": med(overlapped) / med(alone) - 1 if alone else None,
        "runs": {"persist": persists, "alone": alone, "overlapped": overlapped},
    }
    print(
        f"state {size / GIB:.2f} GiB, format {args.format}, median of {args.repeats}, fsync on, {os.cpu_count()} cores"
    )
    print(
        f"save blocks      {res['block_s_per_gib']:.3f} s/GiB   (target <= 0.1 idle)   "
        f"memcpy {res['memcpy_s_per_gib']:.3f} s/GiB   ratio {res['block_over_memcpy']:.2f}x"
    )
    print(f"first save       {res['first_save_block_s']:.3f} s blocking (allocates staging)")
    print(
        f"background       {res['persist_s']:.2f} s per save incl. block ({res['persist_gb_s']:.2f} GB/s)   "
        f"staging RSS +{res['staging_rss_mib']:.0f} MiB (both paths' buffers)"
    )
    if alone:
        print(
            f"training loop    alone {res['train_alone_s']:.2f} s, with persist {res['train_overlapped_s']:.2f} s: "
            f"slowdown {100 * res['train_slowdown']:.1f}% (target <= 25%, {args.train_threads} intra-op thread(s), "
            f"persist at nice +{args.nice})"
        )
    staging_table(res, gib)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()

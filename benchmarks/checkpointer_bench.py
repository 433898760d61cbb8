"""Checkpointer async save: how long ``save`` blocks, and how much a training loop slows down while
persistence runs in the background. Local storage, fsync included, median of N, interleaved.

1. Blocking time of ``Checkpointer(async_save=True).save`` on a state of ``--mib`` MiB of float32
   tensors (staging buffers warm: the first save, which allocates them, is reported separately),
   against a ``copy_`` of the same bytes into preallocated, touched tensors (the memcpy floor),
   measured in the same run, A B A B.
2. A CPU-bound training loop (matmuls, ``--train-threads`` intra-op threads) timed alone and while a
   save persists in the background (the loop starts right after ``save`` returns and runs a fixed
   number of iterations sized to outlast the persist).

    python benchmarks/checkpointer_bench.py [--mib 1024] [--repeats 3] [--format fpk] [--train-threads 1] [--nice 10]

Targets (issue 6): blocking <= 0.25 s/GiB; training slowdown <= 25%.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings

import psutil
import torch

warnings.filterwarnings("ignore")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from ckptio.checkpointer import Checkpointer  # noqa: E402

GIB = 1 << 30


def make_state(mib: int, n: int = 16) -> dict[str, torch.Tensor]:
    per = mib * (1 << 20) // n // 4
    return {f"layer{i}.weight": torch.randn(per) for i in range(n)}


def nbytes(sd) -> int:
    return sum(v.numel() * v.element_size() for v in sd.values())


def memcpy(src, dst) -> float:
    t = time.perf_counter()
    for k, v in src.items():
        dst[k].copy_(v)
    return time.perf_counter() - t


def train_loop(iters: int, a: torch.Tensor, b: torch.Tensor) -> float:
    t = time.perf_counter()
    for _ in range(iters):
        c = a @ b
        a.add_(c, alpha=1e-6)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--format", default="fpk", choices=["fpk", "pt", "dcp"])
    ap.add_argument("--train-threads", type=int, default=1)
    ap.add_argument("--nice", type=int, default=10, help="Checkpointer(background_nice=...); 0: same priority")
    ap.add_argument("--dir", default=None, help="where checkpoints go (default: a temporary directory)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    root = tempfile.mkdtemp(prefix="ckptio-ckbench-", dir=args.dir)
    state = make_state(args.mib)
    size = nbytes(state)
    gib = size / GIB
    dst = {k: torch.empty_like(v).fill_(0) for k, v in state.items()}  # touched: no page faults in memcpy
    ck = Checkpointer(root, format=args.format, async_save=True, keep_last=1, background_nice=args.nice or None)
    proc = psutil.Process()
    rss0 = proc.memory_info().rss
    step = 0
    try:
        # ---- 1. blocking time -----------------------------------------------------------------
        t = time.perf_counter()
        ck.save(step, {"model": state})
        first = time.perf_counter() - t
        t = time.perf_counter()
        ck.wait()
        first_persist = time.perf_counter() - t + first
        blocks, copies, persists = [], [], []
        for _ in range(args.repeats):
            copies.append(memcpy(state, dst))
            step += 1
            t = time.perf_counter()
            ck.save(step, {"model": state})
            blocks.append(time.perf_counter() - t)
            ck.wait()
            persists.append(time.perf_counter() - t)
        staging_rss = proc.memory_info().rss - rss0

        # ---- 2. training-loop slowdown ------------------------------------------------------
        torch.set_num_threads(args.train_threads)
        a, b = torch.randn(384, 384), torch.randn(384, 384) * 1e-3
        train_loop(20, a, b)
        per_iter = train_loop(50, a, b) / 50
        iters = max(50, int(1.5 * statistics.median(persists) / per_iter))  # outlasts one persist
        alone, overlapped = [], []
        for _ in range(args.repeats):
            alone.append(train_loop(iters, a, b))
            step += 1
            ck.save(step, {"model": state})
            overlapped.append(train_loop(iters, a, b))
            ck.wait()
        ck.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)

    med = statistics.median
    res = {
        "format": args.format,
        "bytes": size,
        "repeats": args.repeats,
        "fsync": True,
        "first_save_block_s": first,
        "first_save_total_s": first_persist,
        "block_s": med(blocks),
        "block_s_per_gib": med(blocks) / gib,
        "memcpy_s_per_gib": med(copies) / gib,
        "block_over_memcpy": med(blocks) / med(copies),
        "persist_s": med(persists),
        "persist_gb_s": size / med(persists) / 1e9,
        "staging_rss_mib": staging_rss / (1 << 20),
        "train_threads": args.train_threads,
        "background_nice": args.nice,
        "train_iters": iters,
        "train_alone_s": med(alone),
        "train_overlapped_s": med(overlapped),
        "train_slowdown": med(overlapped) / med(alone) - 1,
        "runs": {"block": blocks, "memcpy": copies, "persist": persists, "alone": alone, "overlapped": overlapped},
    }
    print(f"state {size / GIB:.2f} GiB, format {args.format}, median of {args.repeats}, fsync on")
    print(
        f"save blocks      {res['block_s_per_gib']:.3f} s/GiB   (target <= 0.25)   "
        f"memcpy {res['memcpy_s_per_gib']:.3f} s/GiB   ratio {res['block_over_memcpy']:.2f}x"
    )
    print(f"first save       {first:.3f} s blocking (allocates staging), {first_persist:.2f} s to durable")
    print(
        f"background       {res['persist_s']:.2f} s per save incl. block ({res['persist_gb_s']:.2f} GB/s)   "
        f"staging RSS +{res['staging_rss_mib']:.0f} MiB"
    )
    print(
        f"training loop    alone {res['train_alone_s']:.2f} s, with persist {res['train_overlapped_s']:.2f} s: "
        f"slowdown {100 * res['train_slowdown']:.1f}% (target <= 25%, {args.train_threads} intra-op thread(s), "
        f"persist at nice +{args.nice})"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()

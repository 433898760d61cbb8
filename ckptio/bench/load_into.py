"""Loading into existing tensors (issue 14, goal 3): ``ckptio.load_into`` of a model-sized state of
``--mib`` MiB (4 MiB float32 tensors, already allocated and touched, as a model's are) against the
floor, a raw ``preadv`` of the same bytes into the same tensors, and against what users write today
(``ckptio.load`` then ``copy_``, ``torch.load`` then ``copy_``); extra peak RSS of each. Local files
in the page cache; with ``--s3`` also from moto (``--s3-mib``) against ``ckptio.load`` + ``copy_``.
Sides alternate per round; median [min-max] of ``--repeats``.

    python benchmarks/load_into_bench.py [--mib 1024] [--repeats 5] [--s3] [--s3-mib 256]

Targets: >= 0.9x the raw preadv; extra peak RSS <= 64 MiB for 1 GiB.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

import ckptio

from .measure import RSSPeak
from .servers import MOTO_S3_OPTIONS, MotoServer, make_s3_bucket


def _state(mib: int) -> dict[str, torch.Tensor]:
    return {f"layer{i}.weight": torch.full((1 << 20,), float(i)) for i in range(max(1, mib // 4))}


def _raw_file(path: str, state: dict[str, torch.Tensor]) -> None:
    with open(path, "wb") as f:
        for t in state.values():
            f.write(t.numpy().tobytes())


def _raw_preadv(path: str, target: dict[str, torch.Tensor]) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        off = 0
        for t in target.values():
            mv = memoryview(t.numpy()).cast("B")  # type: ignore[arg-type]  # numpy stubs: __buffer__ on 3.12+ only
            n = os.preadv(fd, [mv], off)
            assert n == len(mv)
            off += n
    finally:
        os.close(fd)


def _copy_in(loaded: Any, target: dict[str, torch.Tensor]) -> None:
    for k, v in loaded.items():
        target[k].copy_(v)


def _rounds(cases: dict[str, Callable[[], None]], repeats: int) -> dict[str, tuple[list[float], list[int]]]:
    out: dict[str, tuple[list[float], list[int]]] = {k: ([], []) for k in cases}
    names = list(cases)
    for r in range(repeats + 1):  # round 0 warms up
        for name in names if r % 2 else reversed(names):
            with RSSPeak() as rss:
                t0 = time.perf_counter()
                cases[name]()
                dt = time.perf_counter() - t0
            if r:
                out[name][0].append(dt)
                out[name][1].append(rss.extra)
    return out


def _report(title: str, res: dict[str, tuple[list[float], list[int]]], base: str, nbytes: int) -> None:
    print(f"\n== {title}: seconds median [min-max]; ratio = {base} time / time; extra peak RSS MiB ==")
    ref = statistics.median(res[base][0])
    for name, (ts, rss) in res.items():
        med = statistics.median(ts)
        print(
            f"  {name:28} {med:7.3f} [{min(ts):.3f}-{max(ts):.3f}]  {nbytes / med / 1e9:5.2f} GB/s  "
            f"ratio {ref / med:4.2f} [{ref / max(ts):.2f}-{ref / min(ts):.2f}]  RSS+ {max(rss) >> 20:5d}"
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--s3", action="store_true")
    p.add_argument("--s3-mib", type=int, default=256)
    a = p.parse_args(argv)
    print(f"load average {os.getloadavg()[0]:.2f}")
    with tempfile.TemporaryDirectory(prefix="ckptio-into-") as d:
        state = _state(a.mib)
        nbytes = sum(t.numel() * t.element_size() for t in state.values())
        fpk, pt, raw = (os.path.join(d, n) for n in ("s.fpk", "s.pt", "s.raw"))
        ckptio.dump(state, fpk)
        torch.save(state, pt)
        _raw_file(raw, state)
        del state
        target = _state(a.mib)  # allocated and touched, like a model's parameters
        cases = {
            "raw preadv into tensors": lambda: _raw_preadv(raw, target),
            "ckptio.load_into": lambda: ckptio.load_into(target, fpk),
            "ckptio.load_into verify=False": lambda: ckptio.load_into(target, fpk, verify=False),
            "ckptio.load + copy_": lambda: _copy_in(ckptio.load(fpk), target),
            "torch.load + copy_": lambda: _copy_in(torch.load(pt, weights_only=True), target),
        }
        _report(
            f"local, {nbytes >> 20} MiB in the page cache", _rounds(cases, a.repeats), "raw preadv into tensors", nbytes
        )
    if a.s3:
        with MotoServer() as s3:
            make_s3_bucket(s3.url, "into-bench")
            ckptio.configure(backends={"s3": {"endpoint_url": s3.url, **MOTO_S3_OPTIONS}})
            state = _state(a.s3_mib)
            nbytes = sum(t.numel() * t.element_size() for t in state.values())
            uri = "s3://into-bench/s.fpk"
            ckptio.dump(state, uri)
            target = _state(a.s3_mib)
            cases = {
                "ckptio.load + copy_": lambda: _copy_in(ckptio.load(uri), target),
                "ckptio.load_into": lambda: ckptio.load_into(target, uri),
            }
            _report(f"S3 (moto), {nbytes >> 20} MiB", _rounds(cases, a.repeats), "ckptio.load + copy_", nbytes)
    return 0

"""ckptio's safetensors format against the safetensors package, in one process, interleaved.

    python -m benchmarks.safetensors_bench                 # 256 MiB, 3 runs, local + S3 (moto)
    python -m benchmarks.safetensors_bench --size-mib 32 --runs 5 --no-s3

Local (a temporary directory, page cache hot): ``ckptio.load`` (a private mapping, as the package)
against ``safetensors.torch.load_file``, and ``ckptio.load(mmap=False)`` (reads into fresh memory);
every load is followed, inside the timed region, by a touch of every page of every tensor, so lazy
mappings pay for their reads. Saves: ``ckptio.dump`` (atomic, fsync) against ``save_file`` +
``fsync``, and ``ckptio.dump(durable=False)`` against plain ``save_file``.

S3: a moto server started here on loopback. ``ckptio.load`` (parallel ranged reads into the
tensors) against the way people read safetensors from S3 today, ``s3fs`` ``cat_file`` then
``safetensors.torch.load`` of the bytes, and against the package behind ckptio's transport
(``ckptio.get`` + ``safetensors.torch.load``); pages touched as above. Saves: ``ckptio.dump``
against ``safetensors.torch.save`` + ``s3fs.pipe``. moto is the limit on loopback (see
"What the figures can reach" in benchmarks/README.md): only ratios within one run mean anything.

Every case writes or reads a fresh path; a round runs every case of a table once, in a new shuffled
order each round, after ``gc`` + ``malloc_trim``. Reported: the median of ``--runs`` with the
min-max spread, GB/s of tensor bytes, and the ratio (baseline median / ckptio median; above 1:
ckptio is faster). The first load of each case is compared with the saved tensors.
A JSON document goes to ``ckptio-bench-results/safetensors-<time>.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import torch

os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

import ckptio
from ckptio.bench.heap import trim_heap
from ckptio.bench.workload import fsync_path, make_state, nbytes, touch

MiB = 1 << 20


def measure(cases: dict[str, Callable[[int], Any]], runs: int, check: dict[str, torch.Tensor] | None) -> dict:
    """``{case: [seconds per run]}``; ``fn(run)`` returns what it loaded (compared once) or None."""
    times: dict[str, list[float]] = {k: [] for k in cases}
    rng = random.Random(0)
    for r in range(runs):
        for name in rng.sample(list(cases), len(cases)):
            trim_heap()
            t0 = time.perf_counter()
            out = cases[name](r)
            if out is not None:
                touch(out)
            times[name].append(time.perf_counter() - t0)
            if r == 0 and check is not None and out is not None:
                bad = [k for k in check if not torch.equal(check[k], out[k])]
                if bad or set(out) != set(check):
                    raise AssertionError(f"{name}: loaded tensors differ from the saved ones ({bad[:3]})")
            del out
    return times


def report(title: str, size: int, times: dict[str, list[float]], pairs: list[tuple[str, str]]) -> dict:
    print(f"\n{title}  ({size / MiB:.0f} MiB of tensors, median of {len(next(iter(times.values())))} [min-max])")
    med = {k: statistics.median(v) for k, v in times.items()}
    for k, v in times.items():
        print(
            f"  {k:52s} {med[k] * 1000:8.1f} ms [{min(v) * 1000:.0f}-{max(v) * 1000:.0f}]  "
            f"{size / med[k] / 1e9:6.2f} GB/s"
        )
    ratios = []
    for ours, base in pairs:
        r = med[base] / med[ours]
        lo, hi = min(times[base]) / max(times[ours]), max(times[base]) / min(times[ours])
        ratios.append({"ckptio": ours, "baseline": base, "ratio": r, "min": lo, "max": hi})
        print(f"  ratio {ours} vs {base}: {r:.2f}x  (runs allow {lo:.2f}-{hi:.2f}x)")
    return {"title": title, "size_bytes": size, "seconds": times, "ratios": ratios}


def bench_local(sd: dict[str, torch.Tensor], runs: int, root: str) -> list[dict]:
    import safetensors.torch as st

    size = nbytes(sd)
    src = os.path.join(root, "model.safetensors")
    ckptio.dump(sd, src)
    loads = {
        "ckptio.load (mapped)": lambda r: ckptio.load(src),
        "ckptio.load(mmap=False)": lambda r: ckptio.load(src, mmap=False),
        "safetensors load_file": lambda r: st.load_file(src),
    }
    out = [
        report(
            "local load, page cache hot, every page touched",
            size,
            measure(loads, runs, sd),
            [("ckptio.load (mapped)", "safetensors load_file"), ("ckptio.load(mmap=False)", "safetensors load_file")],
        )
    ]

    def fresh(tag: str, r: int) -> str:
        return os.path.join(root, f"{tag}-{r}.safetensors")

    def save_file(r: int, sync: bool) -> None:
        st.save_file(sd, fresh(f"st{int(sync)}", r))
        if sync:
            fsync_path(fresh(f"st{int(sync)}", r))

    saves = {
        "ckptio.dump (atomic + fsync)": lambda r: ckptio.dump(sd, fresh("ck1", r)),
        "save_file + fsync": lambda r: save_file(r, True),
        "ckptio.dump(durable=False)": lambda r: ckptio.dump(sd, fresh("ck0", r), durable=False),
        "save_file": lambda r: save_file(r, False),
    }
    out.append(
        report(
            "local save",
            size,
            measure(saves, runs, None),
            [("ckptio.dump (atomic + fsync)", "save_file + fsync"), ("ckptio.dump(durable=False)", "save_file")],
        )
    )
    return out


@contextlib.contextmanager
def s3_bucket() -> Iterator[tuple[str, Any]]:
    from ckptio.bench.servers import MOTO_S3_OPTIONS, MotoServer, make_s3_bucket, moto_s3fs

    with MotoServer() as server:
        bucket = "bench-" + uuid.uuid4().hex[:8]
        make_s3_bucket(server.url, bucket)
        ckptio.configure(backends={"s3": {"endpoint_url": server.url, **MOTO_S3_OPTIONS}})
        fs = moto_s3fs(server.url)
        try:
            yield bucket, fs
        finally:
            ckptio.reset()


def bench_s3(sd: dict[str, torch.Tensor], runs: int) -> list[dict]:
    import safetensors.torch as st

    size = nbytes(sd)
    with s3_bucket() as (bucket, fs):
        uri = f"s3://{bucket}/model.safetensors"
        ckptio.dump(sd, uri)
        loads = {
            "ckptio.load s3://": lambda r: ckptio.load(uri),
            "s3fs cat_file + safetensors.torch.load": lambda r: st.load(fs.cat_file(f"{bucket}/model.safetensors")),
            "ckptio.get + safetensors.torch.load": lambda r: st.load(ckptio.get(uri)),
        }
        out = [
            report(
                "S3 load (moto on loopback), every page touched",
                size,
                measure(loads, runs, sd),
                [
                    ("ckptio.load s3://", "s3fs cat_file + safetensors.torch.load"),
                    ("ckptio.load s3://", "ckptio.get + safetensors.torch.load"),
                ],
            )
        ]
        saves = {
            "ckptio.dump s3://": lambda r: ckptio.dump(sd, f"s3://{bucket}/ck-{r}.safetensors"),
            "safetensors.torch.save + s3fs pipe": lambda r: fs.pipe(f"{bucket}/st-{r}.safetensors", st.save(sd)),
        }
        out.append(
            report(
                "S3 save (moto on loopback)",
                size,
                measure(saves, runs, None),
                [("ckptio.dump s3://", "safetensors.torch.save + s3fs pipe")],
            )
        )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-mib", type=int, default=256)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--no-local", action="store_true")
    p.add_argument("--no-s3", action="store_true")
    p.add_argument("--dir", default=None, help="local directory to write under (default: a temporary one)")
    p.add_argument("--out", default="ckptio-bench-results")
    args = p.parse_args(argv)
    import safetensors

    sd = make_state(args.size_mib * MiB)
    print(
        f"{len(sd)} fp32 tensors, {nbytes(sd) / MiB:.0f} MiB; torch {torch.__version__}, safetensors "
        f"{safetensors.__version__}, {os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.1f}"
    )
    results: list[dict] = []
    root = tempfile.mkdtemp(prefix="ckptio-stbench-", dir=args.dir)
    try:
        if not args.no_local:
            results += bench_local(sd, args.runs, root)
        if not args.no_s3:
            results += bench_s3(sd, args.runs)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"safetensors-{time.strftime('%Y%m%d-%H%M%S')}.json")
    doc = {
        "settings": vars(args),
        "tensors": len(sd),
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "loadavg": os.getloadavg(),
            "torch": torch.__version__,
            "safetensors": safetensors.__version__,
        },
        "results": results,
    }
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

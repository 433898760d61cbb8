"""The node-local cache and ckptio.distributed, against the loads they replace, in one run.

    python -m benchmarks.cache_bench                      # 1 GiB warm-cache, 256 MiB x 4 ranks from S3 (moto)
    python -m benchmarks.cache_bench --size-mib 256 --dist-size-mib 64 --reps 3   # quicker

1. Warm cache: ``ckptio.load(s3_uri, cache=dir)`` with the entry already cached, against
   ``ckptio.load(local_path)`` of the same ``.fpk`` bytes (both touch every byte and verify
   checksums; the cached load also HEADs the object to check its version). Target >= 0.8x.
2. Cold, 4 ranks on one node (gloo, spawned): ``ckptio.distributed.load(s3_uri, cache=fresh_dir)``
   (one rank downloads, all read the node cache) against one rank alone running a plain
   ``ckptio.load(s3_uri)``, and against 4 ranks each running the plain load. Wall time is from a
   barrier before to a barrier after. Target <= 1.3x one rank alone.

Runs alternate (A B A B), medians of ``--reps``; the S3 API server (moto) runs on loopback and is
the bottleneck for remote reads (see benchmarks/README.md). Peak RSS is reported for the parent process.
Writes ``ckptio-bench-results/cache_bench.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import resource
import shutil
import statistics
import tempfile
import time
import uuid

os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")

from typing import Any

import torch

import ckptio

S3_CREDS = {"access_key_id": "testing", "secret_access_key": "testing", "region": "us-east-1"}


def _state(nbytes: int) -> dict[str, torch.Tensor]:
    n = 16
    per = nbytes // 4 // n
    g = torch.Generator().manual_seed(0)
    return {f"layer{i}.weight": torch.randn(per, generator=g) for i in range(n)}


def _timed(fn) -> float:
    t = time.perf_counter()
    out = fn()
    dt = time.perf_counter() - t
    del out
    return dt


def warm(uri: str, local: str, cache_dir: str, size: int, reps: int) -> dict:
    ckptio.load(uri, cache=cache_dir)  # fill
    ckptio.load(local)  # page cache equally hot for both
    plain, cached = [], []
    for _ in range(reps):
        plain.append(_timed(lambda: ckptio.load(local)))
        cached.append(_timed(lambda: ckptio.load(uri, cache=cache_dir)))
    backend: Any = ckptio.resolve(uri, cache=cache_dir)[0]  # CachedBackend: its stats are reported
    p, c = statistics.median(plain), statistics.median(cached)
    return {
        "bytes": size,
        "plain_local_s": plain,
        "warm_cache_s": cached,
        "plain_local_gbps": size / p / 1e9,
        "warm_cache_gbps": size / c / 1e9,
        "ratio_warm_vs_local": p / c,
        "cache_stats": backend.stats(),
    }


def rank_main(rank: int, world: int, port: int, endpoint: str, uri: str, base: str, reps: int, out: str) -> None:
    import torch.distributed as dist

    import ckptio.distributed as D

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=600),
    )
    ckptio.configure(backends={"s3": {"endpoint_url": endpoint, **S3_CREDS}})
    times: dict[str, list[float]] = {"one_rank_plain": [], "ranks_filesystem": [], "ranks_plain": []}

    def run(name: str, fn, only_rank0: bool = False) -> None:
        dist.barrier()
        t = time.perf_counter()
        if rank == 0 or not only_rank0:
            fn()
        dist.barrier()
        times[name].append(time.perf_counter() - t)

    ckptio.stat(uri)  # connect outside the timed runs
    for i in range(reps):
        cache = os.path.join(base, f"cache{i}")
        run("one_rank_plain", lambda: ckptio.load(uri), only_rank0=True)
        run("ranks_filesystem", functools.partial(D.load, uri, cache=cache, timeout=600))
        run("ranks_plain", lambda: ckptio.load(uri))
        dist.barrier()
        if rank == 0:
            shutil.rmtree(cache, ignore_errors=True)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(times, f)
    dist.barrier()
    dist.destroy_process_group()


def distributed(endpoint: str, uri: str, size: int, ranks: int, reps: int, base: str) -> dict:
    import torch.multiprocessing as mp

    from ckptio.bench.servers import free_port

    out = os.path.join(base, "times.json")
    mp.start_processes(
        rank_main,
        args=(ranks, free_port(), endpoint, uri, base, reps, out),
        nprocs=ranks,
        join=True,
        start_method="spawn",
    )
    times = json.load(open(out))
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "bytes": size,
        "ranks": ranks,
        "seconds": times,
        "median_s": med,
        "ratio_filesystem_vs_one_rank": med["ranks_filesystem"] / med["one_rank_plain"],
        "ratio_plain_vs_one_rank": med["ranks_plain"] / med["one_rank_plain"],
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mib", type=int, default=1024, help="warm-cache object size")
    ap.add_argument("--dist-size-mib", type=int, default=256, help="object size for the 4-rank cold load")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=os.path.join("ckptio-bench-results", "cache_bench.json"))
    args = ap.parse_args(argv)
    from ckptio.bench.servers import MotoServer, make_s3_bucket

    base = tempfile.mkdtemp(prefix="ckptio-cache-bench-")
    doc: dict = {"args": vars(args), "format": ".fpk"}
    try:
        with MotoServer() as srv:
            bucket = f"bench-{uuid.uuid4().hex[:8]}"
            make_s3_bucket(srv.url, bucket)
            ckptio.configure(backends={"s3": {"endpoint_url": srv.url, **S3_CREDS}})

            size = args.size_mib << 20
            state = _state(size)
            local, uri = os.path.join(base, "plain.fpk"), f"s3://{bucket}/warm.fpk"
            ckptio.dump(state, local)
            ckptio.dump(state, uri)
            del state
            doc["warm"] = warm(uri, local, os.path.join(base, "warm-cache"), os.path.getsize(local), args.reps)
            shutil.rmtree(os.path.join(base, "warm-cache"), ignore_errors=True)
            os.unlink(local)
            ckptio.remove(uri)
            w = doc["warm"]
            print(
                f"warm cache, {w['bytes'] / 2**30:.2f} GiB .fpk: plain local {w['plain_local_gbps']:.2f} GB/s, "
                f"warm cache {w['warm_cache_gbps']:.2f} GB/s, ratio {w['ratio_warm_vs_local']:.2f}x "
                f"(target >= 0.8x)",
                flush=True,
            )

            dsize = args.dist_size_mib << 20
            duri = f"s3://{bucket}/dist.fpk"
            ckptio.dump(_state(dsize), duri)
            dsize = ckptio.stat(duri).size
            d = doc["distributed"] = distributed(srv.url, duri, dsize, args.ranks, args.reps, base)
            m = d["median_s"]
            print(
                f"{args.ranks} ranks, cold, {dsize / 2**20:.0f} MiB .fpk from S3 (moto): one rank alone "
                f"{m['one_rank_plain']:.2f} s; {args.ranks} ranks via node cache {m['ranks_filesystem']:.2f} s "
                f"= {d['ratio_filesystem_vs_one_rank']:.2f}x (target <= 1.3x); {args.ranks} ranks each "
                f"downloading {m['ranks_plain']:.2f} s = {d['ratio_plain_vs_one_rank']:.2f}x",
                flush=True,
            )
    finally:
        shutil.rmtree(base, ignore_errors=True)
    doc["peak_rss_bytes_parent"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=2)
    print(f"results: {args.out}")
    return doc


if __name__ == "__main__":
    main()

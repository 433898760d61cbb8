"""fastpickle against torch.save/load, safetensors and raw I/O, in one process, interleaved.

    python -m benchmarks.fastpickle_bench            # 1 GiB workloads, 3 runs each
    python -m benchmarks.fastpickle_bench --quick    # 64 MiB, for a smoke run
    python -m benchmarks.fastpickle_bench --size 256 --runs 5 --only w1,s3

Workloads: W1 = fp32 transformer-shaped tensors (~128), W2 = tensors of 100 KiB (10,000 at 1 GiB),
W3 = model + Adam state + nested Python values. Every case writes a fresh file under --dir (page
cache, no fsync unless the name says so) and deletes it afterwards; loads read a file that was just
written (page cache hot) and touch every byte (sum of every tensor) unless marked lazy. Checksums
are on in every fastpickle figure. Each number is the median of --runs runs, the cases of a table
interleaved run by run in a shuffled (seeded) order, each case starting after gc and malloc_trim.
Peak RSS of a W3 load is measured in a fresh subprocess; extra memory during saves (local and S3)
by sampling RSS. S3 runs against moto on loopback, so the server is the limit:
fastpickle is compared with the raw clients (s3fs pipe/cat, boto3's TransferManager) and with
ckptio's own put/readinto, all on the same server in the same run.
"""

from __future__ import annotations

import argparse
import collections
import functools
import io
import math
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

from ckptio import fastpickle as fp
from ckptio.bench.heap import trim_heap
from ckptio.bench.workload import SOURCE_ROOT, u8

MiB = 1 << 20


# ---- workloads ----------------------------------------------------------------------------------


def transformer(nbytes: int, layers: int = 16) -> collections.OrderedDict[str, torch.Tensor]:
    """fp32 tensors shaped like a transformer's: 8 per layer (q, k, v, o, up, down, 2 norms)."""
    d = max(32, int(math.sqrt(nbytes / 4 / (12 * layers)) // 32 * 32))
    sd: collections.OrderedDict[str, torch.Tensor] = collections.OrderedDict()
    for i in range(layers):
        p = f"layers.{i}."
        for n in ("q", "k", "v", "o"):
            sd[p + f"attn.{n}.weight"] = torch.randn(d, d)
        sd[p + "mlp.up.weight"] = torch.randn(4 * d, d)
        sd[p + "mlp.down.weight"] = torch.randn(d, 4 * d)
        sd[p + "norm1.weight"] = torch.randn(d)
        sd[p + "norm2.weight"] = torch.randn(d)
    return sd


def small_tensors(nbytes: int) -> dict[str, torch.Tensor]:
    n = max(1, min(10_000, nbytes // (100 * 1024)))
    return {f"t{i}": torch.randn(25_600) for i in range(n)}


def train_state(nbytes: int) -> dict[str, Any]:
    model = transformer(nbytes // 3)
    state = {
        i: {"step": torch.tensor(1000.0), "exp_avg": torch.randn_like(t), "exp_avg_sq": torch.rand_like(t)}
        for i, t in enumerate(model.values())
    }
    return {
        "model": model,
        "optimizer": {
            "state": state,
            "param_groups": [
                {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, "params": list(range(len(model)))}
            ],
        },
        "scheduler": {"last_epoch": 1000, "base_lrs": [3e-4], "_step_count": 1001},
        "step": 1000,
        "rng": torch.get_rng_state(),
        "config": {"name": "w3", "dims": (1, 2, 3), "tags": {"a", "b"}},
        "history": [float(i) / 7 for i in range(1000)],
    }


def tensors_of(obj: Any) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    stack = [obj]
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
    return out


def payload_bytes(obj: Any) -> int:
    return sum(
        t.untyped_storage().nbytes() for t in {t.untyped_storage().data_ptr(): t for t in tensors_of(obj)}.values()
    )


def touch(obj: Any) -> None:
    for t in tensors_of(obj):
        if t.numel() and t.dtype.is_floating_point:
            t.sum()
        elif t.numel():
            t.view(torch.uint8).sum() if t.dtype.itemsize == 1 else t.sum()


# ---- timing -------------------------------------------------------------------------------------


class Bench:
    def __init__(self, root: str, runs: int, verbose: bool = False) -> None:
        self.root, self.runs, self.n, self.verbose = root, runs, 0, verbose

    def path(self, ext: str) -> str:
        self.n += 1
        return os.path.join(self.root, f"f{self.n}{ext}")

    def table(self, title: str, nbytes: int, cases: dict[str, Callable[[], float]]) -> dict[str, float]:
        times: dict[str, list[float]] = {k: [] for k in cases}
        rng = random.Random(0)
        for _ in range(self.runs):
            # a new order every run: on this kind of VM, how fast fresh page cache comes depends on what the
            # previous case freed (small or large folios), so a fixed order would favour some cases every time
            for k in rng.sample(list(cases), len(cases)):
                trim_heap()
                times[k].append(cases[k]())
        med = {k: statistics.median(v) for k, v in times.items()}
        print(f"\n{title}  ({nbytes / MiB:.0f} MiB, median of {self.runs})")
        for k, s in med.items():
            runs = "  [" + " ".join(f"{t * 1000:.0f}" for t in times[k]) + "]" if self.verbose else ""
            print(f"  {k:44s} {s * 1000:9.1f} ms  {nbytes / s / 1e9:7.2f} GB/s{runs}")
        return med


def ratio(med: dict[str, float], ours: str, base: str, target: float | None = None) -> None:
    r = med[base] / med[ours]
    verdict = "" if target is None else ("  ok" if r >= target else f"  BELOW target {target}x")
    print(f"  ratio {ours} vs {base}: {r:.2f}x{verdict}")


def timed(fn: Callable[[], Any]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def raw_write(tensors: list[torch.Tensor], path: str, fsync: bool) -> None:
    with open(path, "wb", buffering=0) as f:
        for t in tensors:
            mv = u8(t)
            for i in range(0, len(mv), 64 * MiB):
                f.write(mv[i : i + 64 * MiB])
        if fsync:
            os.fsync(f.fileno())


def save_case(b: Bench, ext: str, save: Callable[[str], Any]) -> Callable[[], float]:
    def run() -> float:
        p = b.path(ext)
        try:
            return timed(lambda: save(p))
        finally:
            os.unlink(p)

    return run


def load_case(
    b: Bench, ext: str, save: Callable[[str], Any], load: Callable[[str], Any], lazy: bool = False
) -> Callable[[], float]:
    def run() -> float:
        p = b.path(ext)
        save(p)
        try:

            def go() -> None:
                out = load(p)
                if not lazy:
                    touch(out)

            return timed(go)
        finally:
            os.unlink(p)

    return run


# ---- the workloads' tables ----------------------------------------------------------------------


def bench_flat(b: Bench, name: str, sd: dict[str, torch.Tensor], targets: dict[str, float]) -> None:
    from safetensors.torch import load_file, save_file

    n = payload_bytes(sd)
    ts = list(sd.values())
    med = b.table(
        f"{name} save",
        n,
        {
            "fastpickle save (durable=False)": save_case(b, ".fpk", lambda p: fp.save(sd, p, durable=False)),
            "torch.save": save_case(b, ".pt", lambda p: torch.save(sd, p)),
            "safetensors save_file": save_case(b, ".st", lambda p: save_file(sd, p)),
            "raw sequential write": save_case(b, ".raw", lambda p: raw_write(ts, p, False)),
        },
    )
    ratio(med, "fastpickle save (durable=False)", "torch.save", targets.get("save_torch"))
    ratio(med, "fastpickle save (durable=False)", "safetensors save_file", targets.get("save_st"))
    ratio(med, "fastpickle save (durable=False)", "raw sequential write", targets.get("save_raw"))
    if "save_raw_fsync" in targets:
        med = b.table(
            f"{name} save + fsync",
            n,
            {
                "fastpickle save (durable=True)": save_case(b, ".fpk", lambda p: fp.save(sd, p)),
                "raw sequential write + fsync": save_case(b, ".raw", lambda p: raw_write(ts, p, True)),
            },
        )
        ratio(med, "fastpickle save (durable=True)", "raw sequential write + fsync", targets["save_raw_fsync"])
    fsave = lambda p: fp.save(sd, p, durable=False)  # noqa: E731
    med = b.table(
        f"{name} load, every byte touched (page cache hot)",
        n,
        {
            "fastpickle load": load_case(b, ".fpk", fsave, fp.load),
            "fastpickle load mmap=True (+touch)": load_case(b, ".fpk", fsave, lambda p: fp.load(p, mmap=True)),
            "fastpickle load mmap=False": load_case(b, ".fpk", fsave, lambda p: fp.load(p, mmap=False)),
            "torch.load(weights_only=True)": load_case(
                b, ".pt", lambda p: torch.save(sd, p), lambda p: torch.load(p, weights_only=True)
            ),
            "safetensors load_file": load_case(b, ".st", lambda p: save_file(sd, p), load_file),
        },
    )
    ratio(med, "fastpickle load", "torch.load(weights_only=True)", targets.get("load_torch"))
    ratio(med, "fastpickle load", "safetensors load_file", targets.get("load_st"))
    ratio(med, "fastpickle load mmap=True (+touch)", "safetensors load_file", targets.get("load_st"))
    ratio(med, "fastpickle load mmap=False", "safetensors load_file", targets.get("load_st"))


def bench_mmap_lazy(b: Bench, nbytes: int) -> None:
    from safetensors.torch import load_file, save_file

    print("\nmmap laziness: load time without touching, full size vs 1/16 of it")
    for size in (nbytes, nbytes // 16):
        sd = transformer(size)
        n = payload_bytes(sd)
        med = b.table(
            f"  lazy loads of {n / MiB:.0f} MiB",
            n,
            {
                "fastpickle load mmap=True (lazy)": load_case(
                    b, ".fpk", functools.partial(fp.save, sd, durable=False), lambda p: fp.load(p, mmap=True), lazy=True
                ),
                "safetensors load_file (lazy)": load_case(
                    b, ".st", functools.partial(save_file, sd), load_file, lazy=True
                ),
            },
        )
        del sd, med


def bench_w3(b: Bench, nbytes: int) -> None:
    state = train_state(nbytes)
    n = payload_bytes(state)
    med = b.table(
        "W3 (model + Adam + nested values) save",
        n,
        {
            "fastpickle save (durable=False)": save_case(b, ".fpk", lambda p: fp.save(state, p, durable=False)),
            "torch.save": save_case(b, ".pt", lambda p: torch.save(state, p)),
        },
    )
    ratio(med, "fastpickle save (durable=False)", "torch.save")
    med = b.table(
        "W3 load, every byte touched",
        n,
        {
            "fastpickle load": load_case(b, ".fpk", lambda p: fp.save(state, p, durable=False), fp.load),
            "torch.load(weights_only=True)": load_case(
                b, ".pt", lambda p: torch.save(state, p), lambda p: torch.load(p, weights_only=True)
            ),
        },
    )
    ratio(med, "fastpickle load", "torch.load(weights_only=True)")


def check_w3_roundtrip(b: Bench, state: Any) -> bool:
    p = b.path(".fpk")
    fp.save(state, p, durable=False)
    try:
        out = fp.load(p)
    finally:
        os.unlink(p)
    return _equal(state, out)


def _equal(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride() and torch.equal(a, b)
    if isinstance(a, dict):
        return list(a) == list(b) and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return a == b


RSS_CHILD = r"""
import os, sys
sys.path.insert(0, sys.argv[3])
import torch, psutil
from ckptio import fastpickle as fp
kind, path = sys.argv[1], sys.argv[2]
proc = psutil.Process()
before = proc.memory_info().rss
import time
t = time.perf_counter()
if kind == "fastpickle":
    out = fp.load(path)
else:
    out = torch.load(path, weights_only=True)
elapsed = time.perf_counter() - t
# VmHWM, not ru_maxrss: ru_maxrss survives exec, so it would report the (large) parent's peak
peak = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM:"))
print(before, peak, elapsed)
"""


def bench_rss(b: Bench, nbytes: int) -> None:
    state = train_state(nbytes)
    n = payload_bytes(state)
    print(f"\nW3 round-trips exactly: {check_w3_roundtrip(b, state)}")
    print(f"peak RSS of a W3 load in a fresh process (payload {n / MiB:.0f} MiB; 'extra' = peak - RSS after imports)")
    for kind, ext, save in (
        ("fastpickle", ".fpk", lambda p: fp.save(state, p, durable=False)),
        ("torch.load", ".pt", lambda p: torch.save(state, p)),
    ):
        p = b.path(ext)
        save(p)
        try:
            out = subprocess.run(
                [sys.executable, "-c", RSS_CHILD, kind, p, SOURCE_ROOT],
                capture_output=True,
                text=True,
                check=True,
            ).stdout.split()
        finally:
            os.unlink(p)
        before, peak, elapsed = int(out[0]), int(out[1]), float(out[2])
        extra = peak - before
        print(
            f"  {kind:12s} peak {peak / MiB:7.0f} MiB, extra {extra / MiB:7.0f} MiB = {extra / n:.3f}x payload"
            f"{'  (target <= 1.15x)' if kind == 'fastpickle' else '            '}  load {elapsed * 1000:6.0f} ms "
            f"into fresh memory (no touch)"
        )


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def report_save_memory(what: str, n: int, save: Callable[[], Any]) -> None:
    """Peak RSS during ``save`` above the RSS before it. Free heap memory is returned to the system first
    (malloc_trim) and the high-water mark reset (/proc/self/clear_refs), so reused memory cannot hide growth."""
    trim_heap()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = _status_kib("VmRSS")
    save()
    extra = (_status_kib("VmHWM") - base) * 1024
    limit = max(64 * MiB, n // 20)
    print(
        f"  extra memory during {what}: {extra / MiB:.1f} MiB (limit max(64 MiB, 5% of payload) = "
        f"{limit / MiB:.0f} MiB){'  ok' if extra <= limit else '  ABOVE limit'}"
    )


def bench_save_memory(b: Bench, nbytes: int) -> None:
    sd = transformer(nbytes)
    n = payload_bytes(sd)
    print(f"\nextra memory during save ({n / MiB:.0f} MiB payload; peak RSS above the RSS before)")
    for name, durable in (("local save, durable=False", False), ("local save, durable=True", True)):
        p = b.path(".fpk")
        report_save_memory(name, n, functools.partial(fp.save, sd, p, durable=durable))
        os.unlink(p)


def bench_s3(b: Bench, nbytes: int) -> None:
    try:
        import boto3
        import s3fs
        from boto3.s3.transfer import TransferConfig

        import ckptio.backends.s3
    except ImportError as e:
        print(f"\nS3: skipped, the S3 backend or a baseline client is not available ({e})")
        return
    import ckptio
    from ckptio.bench.servers import MOTO_S3_OPTIONS, MotoServer, make_s3_bucket

    creds = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    for k, v in creds.items():
        os.environ.setdefault(k, v)
    with MotoServer() as server:
        make_s3_bucket(server.url, "bench")
        ckptio.configure(backends={"s3": {"endpoint_url": server.url, **MOTO_S3_OPTIONS}})
        sd = transformer(nbytes)
        n = payload_bytes(sd)
        blob = bytearray(os.urandom(1024)) * (n // 1024)
        blob_bytes = bytes(blob)  # s3fs wants bytes
        backend, _ = ckptio.resolve("s3://bench/x")
        fs = s3fs.S3FileSystem(
            key="testing", secret="testing", client_kwargs={"endpoint_url": server.url, "region_name": "us-east-1"}
        )
        boto = boto3.client(
            "s3",
            endpoint_url=server.url,
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
            region_name="us-east-1",
        )
        tconf = TransferConfig()  # boto3's defaults: 8 MiB parts, 10 threads
        counter = iter(range(10**6))

        def key() -> str:
            return f"o{next(counter)}.fpk"

        def put_case(save: Callable[[str], Any]) -> Callable[[], float]:
            def run() -> float:
                k = key()
                t = timed(lambda: save(k))
                boto.delete_object(Bucket="bench", Key=k)
                return t

            return run

        def get_case(save: Callable[[str], Any], load: Callable[[str], Any]) -> Callable[[], float]:
            def run() -> float:
                k = key()
                save(k)
                t = timed(lambda: load(k))
                boto.delete_object(Bucket="bench", Key=k)
                return t

            return run

        def ckptio_readinto(k: str) -> None:
            buf = bytearray(len(blob))
            ckptio.readinto(f"s3://bench/{k}", buf)

        def boto_download(k: str) -> None:
            boto.download_fileobj("bench", k, io.BytesIO(), Config=tconf)

        def boto_upload(k: str) -> None:
            boto.upload_fileobj(io.BytesIO(blob), "bench", k, Config=tconf)

        ours = "fastpickle ckptio.dump .fpk"
        med = b.table(
            "S3 (moto on loopback) dump; baselines write the same number of bytes",
            n,
            {
                ours: put_case(lambda k: ckptio.dump(sd, f"s3://bench/{k}")),
                "s3fs pipe": put_case(lambda k: fs.pipe(f"bench/{k}", blob_bytes)),
                "boto3 upload_fileobj (TransferManager)": put_case(boto_upload),
                "ckptio.put (same backend)": put_case(lambda k: ckptio.put(blob, f"s3://bench/{k}")),
            },
        )
        for base in ("s3fs pipe", "boto3 upload_fileobj (TransferManager)", "ckptio.put (same backend)"):
            ratio(med, ours, base, 0.9)
        ours = "fastpickle ckptio.load .fpk (+touch)"
        med = b.table(
            "S3 (moto on loopback) load; fastpickle touches every byte",
            n,
            {
                ours: get_case(
                    lambda k: ckptio.dump(sd, f"s3://bench/{k}"), lambda k: touch(ckptio.load(f"s3://bench/{k}"))
                ),
                "s3fs cat": get_case(lambda k: backend.write(f"s3://bench/{k}", blob), lambda k: fs.cat(f"bench/{k}")),
                "boto3 download_fileobj (TransferManager)": get_case(
                    lambda k: backend.write(f"s3://bench/{k}", blob), boto_download
                ),
                "ckptio.readinto (same backend)": get_case(
                    lambda k: backend.write(f"s3://bench/{k}", blob), ckptio_readinto
                ),
            },
        )
        for base in ("s3fs cat", "boto3 download_fileobj (TransferManager)", "ckptio.readinto (same backend)"):
            ratio(med, ours, base, 0.9)
        views = [u8(t) for t in sd.values()]

        def stream(u: str) -> None:
            with backend.open_writer(u) as w:
                for v in views:
                    w.write(v)

        # after the tables, so client start-up is not counted; the same bytes through the same streaming writer,
        # without fastpickle, show what the writer itself holds
        report_save_memory("S3 dump", n, lambda: ckptio.dump(sd, f"s3://bench/{key()}"))
        report_save_memory(
            "S3 streaming writer alone, same tensors (reference)", n, lambda: stream(f"s3://bench/{key()}")
        )
        ckptio.reset()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=int, default=1024, help="workload size in MiB (default 1024)")
    ap.add_argument("--s3-size", type=int, default=256, help="S3 workload size in MiB (default 256)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="64 MiB workloads, 32 MiB on S3")
    ap.add_argument("--only", default="w1,mem,w2,w3,rss,mmap,s3", help="comma-separated subset")
    ap.add_argument("--verbose", action="store_true", help="also print every run's time (ms, in run order)")
    ap.add_argument("--dir", default=None, help="where files go (default: a temporary directory)")
    args = ap.parse_args(argv)
    if args.quick:
        args.size, args.s3_size = 64, 32
    only = set(args.only.split(","))
    root = tempfile.mkdtemp(prefix="fpk-bench-", dir=args.dir)
    b = Bench(root, max(1, args.runs), args.verbose)
    nbytes = args.size * MiB
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, files in {root}")
    try:
        if "w1" in only:
            bench_flat(
                b,
                "W1 (fp32 transformer tensors)",
                transformer(nbytes),
                {
                    "save_torch": 1.8,
                    "save_st": 1.0,
                    "save_raw": 0.8,
                    "save_raw_fsync": 0.9,
                    "load_torch": 4.0,
                    "load_st": 0.8,
                },
            )
        if "mmap" in only:
            bench_mmap_lazy(b, nbytes)
        if "mem" in only:
            bench_save_memory(b, nbytes)
        if "w2" in only:
            bench_flat(b, "W2 (100 KiB tensors)", small_tensors(nbytes), {"save_torch": 2.0, "load_torch": 2.0})
        if "w3" in only:
            bench_w3(b, nbytes)
        if "rss" in only:
            bench_rss(b, nbytes)
        if "s3" in only:
            bench_s3(b, args.s3_size * MiB)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()

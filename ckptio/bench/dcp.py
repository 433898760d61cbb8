"""ckptio.dcp vs torch's DCP storage layers, in one process, interleaved, median of N.

Local (default 1 GiB, fsync on both sides): ckptio StorageWriter/Reader vs torch FileSystemWriter/
Reader at the same thread count. Loads go into preallocated, already-touched tensors (every byte
is written). Also: peak RSS above the state dict during a ckptio save (sampled every 2 ms).

S3 (default 256 MiB, moto on loopback, started here): ckptio vs FsspecWriter/FsspecReader at
their defaults (thread_count=1) and at equal thread counts, and vs the raw boto3 transfer manager
(same part size and concurrency) on the same server.

    python -m benchmarks.dcp_bench [--local-mib 1024] [--s3-mib 256] [--repeats 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import gc
import io
import os
import shutil
import statistics
import tempfile
import threading
import time
import uuid
import warnings
from typing import Any

import psutil
import torch
import torch.distributed.checkpoint as dcp

import ckptio.dcp as cd
from ckptio.bench.workload import u8

GB = 1e9


def make_state(mib: int, n: int = 16) -> dict[str, torch.Tensor]:
    per = mib * (1 << 20) // n // 4
    return {f"layer{i}.weight": torch.randn(per) for i in range(n)}


def zeros_like(sd):
    return {k: torch.zeros_like(v) for k, v in sd.items()}  # zeros_like touches every page


def nbytes(sd) -> int:
    return sum(v.numel() * v.element_size() for v in sd.values())


class PeakRSS:
    """Peak RSS above the RSS at entry, sampled in a thread."""

    def __init__(self, interval: float = 0.002) -> None:
        self.proc, self.interval, self.peak = psutil.Process(), interval, 0

    def __enter__(self):
        self.base = self.proc.memory_info().rss
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss - self.base)
            time.sleep(self.interval)

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, self.proc.memory_info().rss - self.base)


def timed(fn) -> float:
    gc.collect()
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def interleave(cases: dict, repeats: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(repeats):
        for name, fn in cases.items():
            out[name].append(fn())
    return out


def report(title: str, size: int, times: dict[str, list[float]], ours: str) -> dict[str, float]:
    print(f"\n{title} ({size / (1 << 20):.0f} MiB, median of {len(next(iter(times.values())))})")
    med = {k: statistics.median(v) for k, v in times.items()}
    for k, t in med.items():
        ratio = med[ours] and t / med[ours]
        print(f"  {k:44s} {size / t / GB:6.2f} GB/s   {t:6.2f} s   ckptio speedup {ratio:5.2f}x")
    return med


# ---- local -------------------------------------------------------------------------------------


def bench_local(mib: int, repeats: int, threads: int) -> None:
    sd = make_state(mib)
    size = nbytes(sd)
    base = tempfile.mkdtemp(prefix="dcp-bench-", dir=os.environ.get("BENCH_DIR"))
    try:
        ref_torch, ref_ours = os.path.join(base, "ref-torch"), os.path.join(base, "ref-ours")
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(ref_torch, thread_count=threads))
        cd.save(sd, ref_ours, thread_count=threads)

        def save_torch():
            p = os.path.join(base, uuid.uuid4().hex)
            t = timed(
                lambda: dcp.save(sd, storage_writer=dcp.FileSystemWriter(p, thread_count=threads, sync_files=True))
            )
            shutil.rmtree(p)
            return t

        def save_ours():
            p = os.path.join(base, uuid.uuid4().hex)
            t = timed(lambda: cd.save(sd, p, thread_count=threads))
            shutil.rmtree(p)
            return t

        dest = zeros_like(sd)

        def load_torch():
            return timed(lambda: dcp.load(dest, storage_reader=dcp.FileSystemReader(ref_torch)))

        def load_ours():
            return timed(lambda: cd.load(dest, ref_ours, thread_count=threads))

        def load_ours_noverify():
            return timed(lambda: cd.load(dest, ref_ours, thread_count=threads, verify=False))

        saves = interleave(
            {
                f"torch FileSystemWriter thread_count={threads}": save_torch,
                f"ckptio StorageWriter thread_count={threads}": save_ours,
            },
            repeats,
        )
        report("local save, fsync included", size, saves, f"ckptio StorageWriter thread_count={threads}")
        loads = interleave(
            {
                "torch FileSystemReader": load_torch,
                f"ckptio StorageReader thread_count={threads}": load_ours,
                "ckptio StorageReader verify=False": load_ours_noverify,
            },
            repeats,
        )
        report(
            "local load, page cache hot, into touched tensors",
            size,
            loads,
            f"ckptio StorageReader thread_count={threads}",
        )
        assert all(torch.equal(dest[k], sd[k]) for k in sd)

        p = os.path.join(base, "mem")
        with PeakRSS() as m:
            cd.save(sd, p, thread_count=threads)
        limit = max(64 << 20, size // 10)
        print(
            f"\n  peak RSS above the state dict during ckptio save: {m.peak / (1 << 20):.1f} MiB "
            f"(limit max(64 MiB, 10% of payload) = {limit / (1 << 20):.0f} MiB)"
        )
        shutil.rmtree(p)
        p = os.path.join(base, "mem-torch")
        with PeakRSS() as m:
            dcp.save(sd, storage_writer=dcp.FileSystemWriter(p, thread_count=threads))
        print(f"  peak RSS above the state dict during torch FileSystemWriter save: {m.peak / (1 << 20):.1f} MiB")
    finally:
        shutil.rmtree(base, ignore_errors=True)


# ---- S3 ----------------------------------------------------------------------------------------


def bench_s3(mib: int, repeats: int, threads: int) -> None:
    try:
        import ckptio.backends.s3
        from ckptio.bench.servers import MotoServer, make_s3_bucket, s3_client
        from ckptio.torch_internals import FsspecReader, FsspecWriter
    except ImportError as e:
        print(f"\nS3: skipped ({e})")
        return
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    sd = make_state(mib, n=8)
    size = nbytes(sd)
    part = 16 << 20
    our_part = None  # the backend defaults: its writers bound their own buffers (max_buffer_bytes)
    with MotoServer() as server:
        ep = server.url
        ckptio.configure(
            backends={"s3": {"endpoint_url": ep, "access_key_id": "testing", "secret_access_key": "testing"}}
        )
        fs_opts: dict[str, Any] = {
            "key": "testing",
            "secret": "testing",
            "client_kwargs": {"endpoint_url": ep, "region_name": "us-east-1"},
        }
        bucket = "bench"
        make_s3_bucket(ep, bucket)
        ref_torch, ref_ours = f"s3://{bucket}/ref-torch", f"s3://{bucket}/ref-ours"
        dcp.save(sd, storage_writer=FsspecWriter(ref_torch, thread_count=threads, **fs_opts))
        cd.save(sd, ref_ours, thread_count=threads, part_size=part)
        client = s3_client(ep)
        from boto3.s3.transfer import TransferConfig

        tc = TransferConfig(multipart_threshold=part, multipart_chunksize=part, max_concurrency=threads * 4)
        raw = u8(torch.cat([v.view(-1) for v in sd.values()]))
        client.upload_fileobj(io.BytesIO(raw), bucket, "ref-raw", Config=tc)
        scratch: list[str] = []

        def fresh() -> str:
            key = f"run-{uuid.uuid4().hex}"
            scratch.append(key)
            return key

        def cleanup():
            for key in scratch:
                for o in client.list_objects_v2(Bucket=bucket, Prefix=key).get("Contents", []):
                    client.delete_object(Bucket=bucket, Key=o["Key"])
            scratch.clear()

        def fs_save(tc_: int):
            return lambda: timed(
                lambda: dcp.save(
                    sd, storage_writer=FsspecWriter(f"s3://{bucket}/{fresh()}", thread_count=tc_, **fs_opts)
                )
            )

        def our_save():
            return timed(lambda: cd.save(sd, f"s3://{bucket}/{fresh()}", thread_count=threads, part_size=our_part))

        def raw_put():
            return timed(lambda: client.upload_fileobj(io.BytesIO(raw), bucket, fresh(), Config=tc))

        dest = zeros_like(sd)

        def fs_load():
            return timed(lambda: dcp.load(dest, storage_reader=FsspecReader(ref_torch, **fs_opts)))

        def our_load():  # default thread_count: the backend's concurrency (8 ranged GETs in flight)
            return timed(lambda: cd.load(dest, ref_ours, part_size=part))

        rawbuf = bytearray(size)

        def raw_get():
            return timed(lambda: client.download_fileobj(bucket, "ref-raw", io.BytesIO(rawbuf), Config=tc))

        def with_cleanup(fn):
            def run():
                t = fn()
                cleanup()
                return t

            return run

        saves = interleave(
            {
                "torch FsspecWriter default (thread_count=1)": with_cleanup(fs_save(1)),
                f"torch FsspecWriter thread_count={threads}": with_cleanup(fs_save(threads)),
                f"raw boto3 upload_fileobj, {threads * 4} threads": with_cleanup(raw_put),
                f"ckptio StorageWriter thread_count={threads}": with_cleanup(our_save),
            },
            repeats,
        )
        report(
            f"S3 (moto) save, part {part >> 20} MiB (ckptio: backend defaults)",
            size,
            saves,
            f"ckptio StorageWriter thread_count={threads}",
        )
        loads = interleave(
            {
                "torch FsspecReader (default)": fs_load,
                f"raw boto3 download_fileobj, {threads * 4} threads": raw_get,
                "ckptio StorageReader (default, 8 in flight)": our_load,
            },
            repeats,
        )
        report("S3 (moto) load", size, loads, "ckptio StorageReader (default, 8 in flight)")
        assert all(torch.equal(dest[k], sd[k]) for k in sd)
        print("  (FsspecReader has no thread option: its default is its only setting)")
        with PeakRSS() as m:
            cd.save(sd, f"s3://{bucket}/{fresh()}", thread_count=threads, part_size=our_part)
        print(
            f"\n  peak RSS above the state dict during ckptio S3 save: {m.peak / (1 << 20):.1f} MiB "
            f"(limit max(64 MiB, 10% of payload) = {max(64 << 20, size // 10) / (1 << 20):.0f} MiB)"
        )
        cleanup()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--local-mib", type=int, default=1024)
    ap.add_argument("--s3-mib", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", choices=["local", "s3"], default=None)
    a = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs")
    if a.only in (None, "local"):
        bench_local(a.local_mib, a.repeats, a.threads)
    if a.only in (None, "s3"):
        bench_s3(a.s3_mib, a.repeats, a.threads)


if __name__ == "__main__":
    main()

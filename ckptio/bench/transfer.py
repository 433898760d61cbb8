"""Put/get throughput of ckptio backends against the best raw client on the same server, same run.

    python -m benchmarks.transfer [--size-mib 256] [--repeats 3] [--gcs] [--no-s3] [--no-local]
        [--tls]

S3: a moto server on loopback started here (``--tls``: over https, with a self-signed certificate);
ckptio's ``write``/``readinto`` against s3fs ``pipe``/``cat`` and boto3's TransferManager
``upload_fileobj``/``download_fileobj``. Local: ckptio
against ``open().write()`` and ``readinto`` into the same preallocated buffer, with and without
fsync (stated per row). Runs are interleaved (A B C A B C ...), each to a fresh key/path; the
median is reported with the ratio to the best baseline. Streaming uploads (``open_writer``
in 1 MiB, 16 MiB and whole-object writes) also report their extra peak RSS (VmHWM, fresh process).
Loads touch every byte (they fill a preallocated buffer that is reused across runs, so page faults
are not measured). The server is the bottleneck on loopback (see benchmarks/README.md), which is why only
same-run ratios mean anything.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import resource
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
import ckptio
from ckptio.bench.servers import GCSEmulator, MotoServer, TLSMotoServer, make_gcs_bucket, moto_s3fs
from ckptio.bench.workload import SOURCE_ROOT

MiB = 1024 * 1024
TUNING: dict = {}  # backend options from --part-size-mib / --concurrency
RSS = True  # also measure the peak RSS of streaming uploads (--no-rss: skip)
VERBOSE = False  # print every run's time (--verbose)
TLS = False  # S3 over https (--tls)


def measure(cases: Mapping[str, Callable[[int], Any]], repeats: int) -> dict[str, list[float]]:
    """Interleaved runs: every case once per round; ``fn(round)`` must use a fresh destination."""
    times: dict[str, list[float]] = {k: [] for k in cases}
    for r in range(repeats):
        for name, fn in cases.items():
            t0 = time.perf_counter()
            fn(r)
            times[name].append(time.perf_counter() - t0)
            if VERBOSE:
                print(f"    round {r + 1}: {name} {times[name][-1]:.3f} s", flush=True)
    return times


def report(title: str, size: int, times: dict[str, list[float]], ours: list[str], baselines: list[str]) -> dict:
    gbps = {k: size / statistics.median(v) / 1e9 for k, v in times.items()}
    best = max(baselines, key=lambda k: gbps[k])
    print(f"\n{title}")
    for k in times:
        extra = f"  ratio to best baseline ({best}): {gbps[k] / gbps[best]:.2f}x" if k in ours else ""
        print(f"  {k:44s} {gbps[k]:7.3f} GB/s  (median of {len(times[k])}){extra}")
    return {"gbps": gbps, "best_baseline": best, "ratios": {k: gbps[k] / gbps[best] for k in ours}}


def bench_s3(size: int, repeats: int, data: bytes, buf: bytearray) -> dict:
    import boto3
    from boto3.s3.transfer import TransferConfig

    out = {}
    tls_dir = tempfile.TemporaryDirectory() if TLS else None
    server: MotoServer = MotoServer()
    if tls_dir:
        server = tls = TLSMotoServer(tls_dir.name)
        os.environ["AWS_CA_BUNDLE"] = tls.ca_file  # every client here (and the RSS child) trusts it
    with server, tls_dir or contextlib.nullcontext():
        bucket = "bench-" + uuid.uuid4().hex[:8]
        creds = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing", "region_name": "us-east-1"}
        boto3.client("s3", endpoint_url=server.url, **creds).create_bucket(Bucket=bucket)
        ckptio.configure(
            backends={
                "s3": {"endpoint_url": server.url, "access_key_id": "testing", "secret_access_key": "testing", **TUNING}
            }
        )
        backend: Any = ckptio.resolve(f"s3://{bucket}/x")[0]  # S3Backend: its part size is reported
        fs = moto_s3fs(server.url)
        client = boto3.client("s3", endpoint_url=server.url, **creds)
        tc = TransferConfig()
        put = {
            "ckptio write": lambda r: backend.write(f"s3://{bucket}/ck-{r}", data),
            "s3fs pipe": lambda r: fs.pipe(f"{bucket}/fs-{r}", data),
            "boto3 upload_fileobj": lambda r: client.upload_fileobj(io.BytesIO(data), bucket, f"bo-{r}", Config=tc),
        }
        out["s3_put"] = report(
            f"S3 put {size // MiB} MiB (moto on loopback{' over TLS' if TLS else ''}; "
            f"upload parts {backend.upload_part_size // MiB} MiB, concurrency={backend.concurrency})",
            size,
            measure(put, repeats),
            ["ckptio write"],
            ["s3fs pipe", "boto3 upload_fileobj"],
        )

        def boto_get(r: int) -> None:
            f = io.BytesIO(buf)  # a preallocated destination, as for the others
            f.seek(0)
            client.download_fileobj(bucket, "bo-0", f, Config=tc)

        get = {
            "ckptio readinto": lambda r: backend.readinto(f"s3://{bucket}/ck-0", buf),
            "s3fs cat": lambda r: fs.cat(f"{bucket}/fs-0"),
            "boto3 download_fileobj": boto_get,
        }
        out["s3_get"] = report(
            f"S3 get {size // MiB} MiB",
            size,
            measure(get, repeats),
            ["ckptio readinto"],
            ["s3fs cat", "boto3 download_fileobj"],
        )
        if RSS:
            out["s3_stream_rss"] = bench_stream_rss("s3", server.url, bucket, size)
        ckptio.reset()
    return out


def bench_gcs(size: int, repeats: int, data: bytes, buf: bytearray) -> dict:
    import gcsfs

    out = {}
    with GCSEmulator() as server:
        bucket = "bench-" + uuid.uuid4().hex[:8]
        make_gcs_bucket(server.url, bucket)
        ckptio.configure(backends={"gcs": {"endpoint_url": server.url, "anon": True, **TUNING}})
        backend, _ = ckptio.resolve(f"gs://{bucket}/x")
        fs = gcsfs.GCSFileSystem(endpoint_url=server.url, token="anon", skip_instance_cache=True)
        put = {
            "ckptio write": lambda r: backend.write(f"gs://{bucket}/ck-{r}", data),
            "gcsfs pipe": lambda r: fs.pipe(f"{bucket}/fs-{r}", data),
        }
        out["gcs_put"] = report(
            f"GCS put {size // MiB} MiB (gcp-storage-emulator)",
            size,
            measure(put, repeats),
            ["ckptio write"],
            ["gcsfs pipe"],
        )
        get = {
            "ckptio readinto": lambda r: backend.readinto(f"gs://{bucket}/ck-0", buf),
            "gcsfs cat": lambda r: fs.cat(f"{bucket}/fs-0"),
        }
        out["gcs_get"] = report(
            f"GCS get {size // MiB} MiB", size, measure(get, repeats), ["ckptio readinto"], ["gcsfs cat"]
        )
        if RSS:
            out["gcs_stream_rss"] = bench_stream_rss("gcs", server.url, bucket, size)
        ckptio.reset()
    return out


_RSS_CHILD = r"""
import os, sys, time
sys.path.insert(0, sys.argv[1])
import ckptio
scheme, url, uri, size, chunk = sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), int(sys.argv[6])
opts = ({"endpoint_url": url, "access_key_id": "testing", "secret_access_key": "testing"} if scheme == "s3"
        else {"endpoint_url": url, "anon": True})
ckptio.configure(backends={scheme: opts})
backend, u = ckptio.resolve(uri)
backend.write(u + ".warm", b"x" * (6 << 20))  # clients, pools, imports
data = bytearray(size)
data[:] = os.urandom(1 << 20) * (size >> 20)

def hwm():
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM")) / 1024

with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset the peak to the current RSS
base = hwm()
mv = memoryview(data)
t0 = time.perf_counter()
with backend.open_writer(u) as w:
    for i in range(0, size, chunk):
        w.write(mv[i: i + chunk])
print(f"{hwm() - base:.1f} {time.perf_counter() - t0:.3f}")
"""


def bench_stream_rss(scheme: str, url: str, bucket: str, size: int) -> dict:
    """Extra peak RSS (VmHWM) of a streaming upload through ``open_writer``, in a fresh process."""
    import subprocess

    root = SOURCE_ROOT
    out = {}
    for chunk in (MiB, 16 * MiB, size):
        r = subprocess.run(
            [
                sys.executable,
                "-c",
                _RSS_CHILD,
                root,
                scheme,
                url,
                f"{'s3' if scheme == 's3' else 'gs'}://{bucket}/rss-{chunk}",
                str(size),
                str(chunk),
            ],
            check=True,
            capture_output=True,
            text=True,
        )
        extra, secs = map(float, r.stdout.split())
        out[f"chunks_{chunk // MiB}MiB"] = {"extra_rss_mib": extra, "gbps": size / secs / 1e9}
        print(
            f"  streaming {scheme} upload of {size // MiB} MiB in {chunk // MiB} MiB writes: extra peak RSS "
            f"{extra:.0f} MiB ({extra * MiB / size:.1%} of the payload), {size / secs / 1e9:.3f} GB/s"
        )
    return out


def bench_local(size: int, repeats: int, data: bytes, buf: bytearray) -> dict:
    out = {}
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as d:
        backend, _ = ckptio.resolve(d)

        def plain_write(path: str, fsync: bool) -> None:
            with open(path, "wb") as f:
                f.write(data)
                if fsync:
                    f.flush()
                    os.fsync(f.fileno())

        for fsync in (False, True):
            tag = "with fsync" if fsync else "no fsync"
            put = {
                f"ckptio write ({tag})": lambda r, s=fsync: backend.write(
                    os.path.join(d, f"ck-{s}-{r}"), data, durable=s
                ),
                f"open().write() ({tag})": lambda r, s=fsync: plain_write(os.path.join(d, f"pl-{s}-{r}"), s),
            }
            out[f"local_put_{'fsync' if fsync else 'nofsync'}"] = report(
                f"local put {size // MiB} MiB ({tag}; ckptio also renames atomically)",
                size,
                measure(put, repeats),
                [f"ckptio write ({tag})"],
                [f"open().write() ({tag})"],
            )

        def plain_readinto(path: str) -> None:
            with open(path, "rb", buffering=0) as f:
                f.readinto(buf)

        get = {
            "ckptio readinto": lambda r: backend.readinto(os.path.join(d, "ck-False-0"), buf),
            "open().readinto()": lambda r: plain_readinto(os.path.join(d, "pl-False-0")),
        }
        out["local_get"] = report(
            f"local get {size // MiB} MiB (page cache warm, preallocated buffer)",
            size,
            measure(get, repeats),
            ["ckptio readinto"],
            ["open().readinto()"],
        )
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mib", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--gcs", action="store_true", help="also run against gcp-storage-emulator")
    p.add_argument("--no-s3", action="store_true")
    p.add_argument("--no-local", action="store_true")
    p.add_argument("--part-size-mib", type=int, default=None, help="override the backends' part_size")
    p.add_argument("--concurrency", type=int, default=None, help="override the backends' concurrency")
    p.add_argument("--no-rss", action="store_true", help="skip the streaming-upload peak RSS measurement")
    p.add_argument("--tls", action="store_true", help="S3 over https (moto with a self-signed certificate)")
    p.add_argument("--verbose", action="store_true", help="print every run's time, not only the medians")
    p.add_argument("--json", default="ckptio-bench-results/transfer.json")
    args = p.parse_args(argv)
    global RSS, VERBOSE, TLS
    RSS, VERBOSE, TLS = not args.no_rss, args.verbose, args.tls
    size = args.size_mib * MiB
    if args.part_size_mib:
        TUNING["part_size"] = args.part_size_mib * MiB
    if args.concurrency:
        TUNING["concurrency"] = args.concurrency
    data = os.urandom(size)
    buf = bytearray(size)
    buf[:] = data  # pre-touch the destination so page faults are not measured
    results: dict = {"size_bytes": size, "repeats": args.repeats}
    if not args.no_local:
        results.update(bench_local(size, args.repeats, data, buf))
    if not args.no_s3:
        results.update(bench_s3(size, args.repeats, data, buf))
    if args.gcs:
        results.update(bench_gcs(size, args.repeats, data, buf))
    results["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(
        f"\npeak RSS: {results['peak_rss_mib']:.0f} MiB (includes the {size // MiB} MiB source and "
        f"{size // MiB} MiB destination buffers)"
    )
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()

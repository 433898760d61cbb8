"""The ceiling of the benchmark's S3 server: what a client that does no work at all can move through it.

Every S3 cell of ``ckptio bench`` shares two cores with the server (moto, Python) and, in the realistic
profile, the loopback proxy. Then a ratio between two clients is bounded by how close the slower one
already is to what the server and proxy can move: when a peer reaches 70% of that, no client can be
1.5x faster than it. This script measures that bound in the same run as ckptio and the peers:

  raw PUT                 one unsigned PUT from a bytes object (http.client: no hashing, no signing)
  raw multipart 8 MiB x8  the same as 8 MiB parts over 8 connections (the part size ckptio uploads in)
  raw GET x1              one GET read into a reused buffer
  raw GET 16 MiB x8, x16  16 MiB ranges (ckptio's S3 read part) over 8 / 16 connections, into a reused
                          buffer (no allocation, no page faults, no verification)
  ... x8, fresh memory    the same into new anonymous memory, faulted in as it is written: the
                          ceiling for a load that returns new tensors
  ckptio .fpk, ckptio DCP, s3torchconnector S3Checkpoint and DCP, s3fs single PUT: as in ``ckptio bench``

interleaved, ``--repeats`` rounds (the first is a warm-up), median [min-max]. For each one it also
reports the server's CPU seconds per GB moved (from /proc), which shows when the server is the limit:
moto spends about 6 s of CPU per GB a PUT brings (MD5 for the ETag and reading the body in Python)
whoever sends it.

    python -m benchmarks.ceiling [--sizes 32MiB,256MiB] [--profile loopback|realistic] [--repeats 6]
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import os
import re
import statistics
import sys
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import ckptio
from ckptio.osio import anonymous
from ckptio.values import parse_size

from .impls import Impl, ckptio_impls
from .peers import s3_peers, s3fs_put_baseline
from .proxy import DEFAULT_BANDWIDTH, DEFAULT_LATENCY
from .servers import MOTO_S3_OPTIONS, MotoServer, ProxyServer, make_s3_bucket, moto_s3fs
from .workload import make_state, nbytes, touch

# moto checks no signature, but it answers 403 to a multipart request without an Authorization header
_AUTH = {
    "Authorization": "AWS4-HMAC-SHA256 Credential=testing/20260101/us-east-1/s3/aws4_request, "
    "SignedHeaders=host, Signature=0",
    "x-amz-content-sha256": "UNSIGNED-PAYLOAD",
}
_UPLOAD_PART = 8 << 20
_READ_PART = 16 << 20


class RawClient:
    """Unsigned HTTP requests to an S3 endpoint with nothing else done: the no-work client."""

    def __init__(self, endpoint: str) -> None:
        host, port = endpoint.removeprefix("http://").rsplit(":", 1)
        self.host, self.port = host, int(port)

    def _request(self, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None) -> Any:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=600)
        conn.request(method, path, body=body, headers={**_AUTH, **(headers or {})})
        return conn, conn.getresponse()

    def _call(self, method: str, path: str, body: Any = None) -> tuple[bytes, Any]:
        conn, r = self._request(method, path, body, {"Content-Length": str(len(body) if body is not None else 0)})
        data = r.read()
        conn.close()
        if r.status != 200:
            raise RuntimeError(f"{method} {path}: HTTP {r.status} {data[:200]!r}")
        return data, r

    def put(self, path: str, body: memoryview) -> None:
        self._call("PUT", path, body)

    def multipart(self, path: str, body: memoryview, part: int, conns: int) -> None:
        data, _ = self._call("POST", path + "?uploads")
        m = re.search(rb"<UploadId>(.*?)</UploadId>", data)
        if m is None:
            raise RuntimeError(f"no UploadId in {data[:200]!r}")
        upload = m[1].decode()

        def one(i: int) -> str:
            _, r = self._call("PUT", f"{path}?partNumber={i + 1}&uploadId={upload}", body[i * part : (i + 1) * part])
            return r.getheader("ETag")

        with ThreadPoolExecutor(conns) as ex:
            etags = list(ex.map(one, range(-(-len(body) // part))))
        xml = "".join(f"<Part><PartNumber>{n}</PartNumber><ETag>{e}</ETag></Part>" for n, e in enumerate(etags, 1))
        self._call("POST", f"{path}?uploadId={upload}", f"<CompleteMultipartUpload>{xml}</CompleteMultipartUpload>")

    def get_into(self, path: str, view: memoryview, first: int) -> None:
        conn, r = self._request("GET", path, headers={"Range": f"bytes={first}-{first + len(view) - 1}"})
        if r.status not in (200, 206):
            raise RuntimeError(f"GET {path}: HTTP {r.status}")
        n = 0
        while n < len(view):
            k = r.readinto(view[n:])
            if not k:
                raise RuntimeError(f"GET {path}: the body ended at {first + n}")
            n += k
        conn.close()

    def ranged(self, path: str, buf: memoryview, part: int, conns: int) -> None:
        with ThreadPoolExecutor(conns) as ex:
            list(ex.map(lambda i: self.get_into(path, buf[i : i + part], i), range(0, len(buf), part)))


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def raw_impls(client: RawClient, size: int) -> list[Impl]:
    """The no-work client as save/load pairs on a bytes object of ``size`` (the state is ignored)."""
    body = memoryview(os.urandom(size))
    buf = memoryview(bytearray(size))  # reused: no allocation or page fault in what is timed

    def path(u: str) -> str:
        return "/" + u.removeprefix("s3://")

    def get(part: int, conns: int, fresh: bool = False) -> Callable[[dict, str], None]:
        # fresh: into new anonymous memory, faulted in as the reads write it (what a load that returns
        # new tensors pays); otherwise into the reused buffer
        return lambda r, u: client.ranged(path(u), anonymous(size) if fresh else buf, min(part, size), conns)

    return [
        Impl("raw PUT / GET x1", True, ".bin", lambda s, u: client.put(path(u), body), get(size, 1)),
        Impl(
            "raw multipart 8 MiB x8 / GET 16 MiB x8",
            True,
            ".bin",
            lambda s, u: client.multipart(path(u), body, _UPLOAD_PART, 8),
            get(_READ_PART, 8),
        ),
        # its save only puts the object there (one PUT, not reported)
        Impl("raw GET 16 MiB x16", True, ".bin", lambda s, u: client.put(path(u), body), get(_READ_PART, 16)),
        Impl(
            "raw GET 16 MiB x8, fresh memory",
            True,
            ".bin",
            lambda s, u: client.put(path(u), body),
            get(_READ_PART, 8, True),
        ),
    ]


@contextlib.contextmanager
def s3_setup(profile: str, latency: float, bandwidth: float) -> Iterator[tuple[str, str, int, list[Impl]]]:
    """(bucket URI, endpoint, server pid, the clients other than the raw one) for the embedded S3 server,
    through a latency proxy for the realistic profile."""
    with MotoServer(ranged_reads=True) as srv, contextlib.ExitStack() as stack:
        url = srv.url
        if profile == "realistic":
            url = stack.enter_context(ProxyServer(srv.url, latency, bandwidth)).url
        bucket = f"ceiling-{uuid.uuid4().hex[:8]}"
        make_s3_bucket(srv.url, bucket)
        ckptio.configure(backends={"s3": {"endpoint_url": url, **MOTO_S3_OPTIONS}})
        mine = [i for i in ckptio_impls(True, True) if i.name != "ckptio .pt"]
        peers, notes = s3_peers(url, MOTO_S3_OPTIONS["access_key_id"], MOTO_S3_OPTIONS["secret_access_key"])
        for n in notes:
            print(f"note: {n['impl']}: {n['reason']}")
        yield f"s3://{bucket}", url, srv.proc.pid if srv.proc else 0, mine + peers + [s3fs_put_baseline(moto_s3fs(url))]


def measure(impls: list[Impl], uri: str, state: dict, pid: int, repeats: int) -> dict[str, list[tuple[float, float]]]:
    """(seconds, server CPU seconds) per op, per round after the first, rounds interleaved and rotated."""
    size = nbytes(state)
    out: dict[str, list[tuple[float, float]]] = {}
    for r in range(repeats):
        order = impls[r % len(impls) :] + impls[: r % len(impls)]
        for impl in order:
            target = f"{uri}/{size}/{re.sub('[^a-z0-9]+', '-', impl.name.lower())}-{r}{impl.suffix}"
            for op in ("save", "load"):
                c0, t = _cpu_seconds(pid), time.perf_counter()
                if op == "save":
                    impl.save(state, target)
                elif isinstance(res := impl.load(state, target), dict):
                    touch(res)  # every page of what a load returns, as ckptio bench does
                    del res
                dt, cpu = time.perf_counter() - t, _cpu_seconds(pid) - c0
                if r and not (op == "save" and impl.name.startswith("raw GET")):
                    out.setdefault(f"{op} {impl.name}", []).append((dt, cpu))
    return out


def report(times: dict[str, list[tuple[float, float]]], size: int) -> None:
    rates = {k: [size / t / 1e9 for t, _ in v] for k, v in times.items()}
    for op in ("save", "load"):
        rows = {k.split(" ", 1)[1]: v for k, v in rates.items() if k.startswith(op)}
        best_raw = max(statistics.median(v) for k, v in rows.items() if k.startswith("raw"))
        for name, v in rows.items():
            cpu = statistics.median(c for _, c in times[f"{op} {name}"]) / (size / 1e9)
            print(
                f"  {op:4s} {name:40s} {statistics.median(v):6.3f} GB/s [{min(v):.3f}-{max(v):.3f}]"
                f"  {statistics.median(v) / best_raw:5.0%} of the ceiling  server CPU {cpu:5.2f} s/GB"
            )
        peers = {k: statistics.median(v) for k, v in rows.items() if k.startswith("s3torchconnector")}
        for name, rate in sorted(peers.items(), key=lambda kv: -kv[1]):
            print(f"  {op}: the most any client could be faster than {name} here: {best_raw / rate:.2f}x")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="32MiB,256MiB")
    ap.add_argument("--repeats", type=int, default=6, help="rounds; the first is a warm-up (default 6)")
    ap.add_argument("--profile", choices=("loopback", "realistic"), default="realistic")
    ap.add_argument("--latency-ms", type=float, default=DEFAULT_LATENCY * 1e3)
    ap.add_argument("--stream-mbps", type=float, default=DEFAULT_BANDWIDTH / 1e6)
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    with s3_setup(args.profile, args.latency_ms / 1e3, args.stream_mbps * 1e6) as (uri, url, pid, clients):
        for size in (parse_size(s) for s in args.sizes.split(",")):
            state = make_state(size)
            size = nbytes(state)
            impls = raw_impls(RawClient(url), size) + clients
            print(f"== S3 ({args.profile}), {size / 2**20:.1f} MiB: GB/s, median [min-max] of {args.repeats - 1} ==")
            report(measure(impls, uri, state, pid, args.repeats), size)
            sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A tiny run of the throughput benchmark (ckptio.bench, through benchmarks/throughput.py and `ckptio bench`):
the JSON and PNG it writes are complete and sane (no timing checks); missing extras are named, not fatal.
tests/test_bench_wheel.py runs it from an installed wheel."""

from __future__ import annotations

import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks import throughput  # noqa: E402


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_tiny_benchmark_writes_json_and_png(tmp_path, s3_uri, gcs_uri, capsys, monkeypatch):
    pytest.importorskip("matplotlib")
    from ckptio.bench import measure

    # no full collection before each case: in the test process (every earlier test's objects) it took
    # most of this test's 34 s; this run checks the JSON and PNG, not timings
    monkeypatch.setattr(measure, "trim_heap", lambda: None)
    code = throughput.main(
        [
            "--sizes",
            "256KiB",
            "--repeats",
            "2",
            "--backends",
            "local,memory",
            "--uri",
            f"{s3_uri}/b",
            "--uri",
            f"{gcs_uri}/b",
            "--out",
            str(tmp_path),
            "--name",
            "smoke",
            "--quiet",
        ]
    )
    assert code == 0
    out = capsys.readouterr().out
    assert "ckptio .pt" in out and "smoke.json" in out and "smoke.png" in out

    doc = json.loads((tmp_path / "smoke.json").read_text())
    m = doc["machine"]
    assert m["cpu_count"] >= 1 and m["versions"]["torch"] and m["python"]
    assert doc["settings"]["repeats"] == 2 and doc["settings"]["sizes"] == [256 * 1024]
    backends = {r["backend"] for r in doc["results"]}
    assert backends == {"local", "memory", f"{s3_uri}/b", f"{gcs_uri}/b"}
    impls = {(r["backend"], r["impl"]) for r in doc["results"]}
    for b in backends:
        assert (b, "ckptio .pt") in impls and any(r["baseline"] for r in doc["results"] if r["backend"] == b)
    assert ("local", "torch.save/load") in impls and ("local", "raw write/read") in impls
    for r in doc["results"]:
        assert r["size_bytes"] > 0 and len(r["seconds"]) == 2 and all(s > 0 for s in r["seconds"])
        assert r["gb_per_s"] > 0 and r["median_rss_extra_bytes"] >= 0
        assert r["op"] in ("save", "load", "load_cold")
    assert {r["op"] for r in doc["results"] if r["backend"] == "local"} >= {"save", "load"}
    assert {r["op"] for r in doc["results"] if r["backend"] == "memory"} == {"save", "load"}
    assert doc["ratios"] and all(x["ratio"] > 0 for x in doc["ratios"])
    # the table ends with ckptio's best vs the best baseline, one line per storage (save and load)
    assert "== ckptio's best vs the best baseline" in out
    assert {(x["backend"], x["op"]) for x in doc["summary"]} == {(b, op) for b in backends for op in ("save", "load")}
    for x in doc["summary"]:
        assert not x["impl"].startswith(("raw", "torch", "safetensors")) and x["ratio"] > 0
    assert not [s for s in doc["skipped"] if s["impl"] == "ckptio .pt"]
    text = (tmp_path / "smoke.json").read_text()
    assert "secret_access_key" not in text and "AWS_SECRET" not in text

    png = (tmp_path / "smoke.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    assert doc["outputs"]["png"] == str(tmp_path / "smoke.png")

    # nothing left behind in the user's storage
    import ckptio

    assert not ckptio.exists(f"{s3_uri}/b") or not ckptio.ls(f"{s3_uri}/b", recursive=True)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_ckptio_bench_command(tmp_path, capsys, monkeypatch):
    from ckptio import cli
    from ckptio.bench import measure

    monkeypatch.setattr(measure, "trim_heap", lambda: None)  # a full collection per case: see above

    code = cli.main(
        [
            "--json",
            "bench",
            "--sizes",
            "64KiB,128KiB",
            "--repeats",
            "1",
            "--backends",
            "memory",
            "--out",
            str(tmp_path),
            "--name",
            "cmd",
            "--no-chart",
        ]
    )
    assert code == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["outputs"]["json"] == str(tmp_path / "cmd.json") and doc["outputs"]["png"] is None
    assert {r["backend"] for r in doc["results"]} == {"memory"}
    sizes = {r["size_bytes"] for r in doc["results"]}
    assert len(sizes) == 2  # both sizes in one run, each with its summary line (save and load)
    assert {(x["size_bytes"], x["op"]) for x in doc["summary"]} == {(s, op) for s in sizes for op in ("save", "load")}


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_missing_bench_extras_are_named_and_skipped(tmp_path, monkeypatch, capsys):
    from ckptio.bench import measure
    from ckptio.bench import throughput as bench

    monkeypatch.setattr(measure, "trim_heap", lambda: None)  # a full collection per case: see above

    for mod in ("moto", "matplotlib", "safetensors"):  # as if not installed
        monkeypatch.setitem(sys.modules, mod, None)
    code = bench.main(
        [
            "--sizes",
            "64KiB",
            "--repeats",
            "1",
            "--backends",
            "local,s3",
            "--out",
            str(tmp_path),
            "--name",
            "bare",
            "--quiet",
        ]
    )
    assert code == 0
    out = capsys.readouterr().out
    hint = "pip install 'ckptio[bench]'"
    assert f"s3 *: moto_server needs the Python module(s) moto, which are not installed: {hint}" in out
    assert "local safetensors: baseline left out: the safetensors package is not installed" in out
    assert f"chart:   (not written: matplotlib is not installed: {hint})" in out
    doc = json.loads((tmp_path / "bare.json").read_text())
    assert {r["backend"] for r in doc["results"]} == {"local"} and doc["outputs"]["png"] is None
    assert not [r for r in doc["results"] if r["impl"] == "safetensors"]


def test_load_into_benchmark_runs(capsys):
    from ckptio.bench import load_into

    assert load_into.main(["--mib", "8", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "ckptio.load_into" in out and "raw preadv into tensors" in out


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_s3_peers_are_baselines_on_the_same_server(tmp_path, capsys, monkeypatch):
    """s3torchconnector's S3Checkpoint and DCP writer/reader and s3fs's single PUT run as baselines on
    the embedded S3 server, here behind the realistic profile's proxy; the first screen is the summary
    naming the best baseline, sizes are exact."""
    pytest.importorskip("s3torchconnector.dcp")
    from ckptio.bench import measure, targets
    from ckptio.bench import throughput as bench

    monkeypatch.setattr(measure, "trim_heap", lambda: None)  # a full collection per case: see above
    proxies = []  # and everything goes through the latency proxy of --profile realistic
    real_configure = targets.ckptio.configure

    class Proxy(targets.ProxyServer):
        def start(self, timeout: float = 30.0):
            proxies.append(self)
            return super().start(timeout)

    endpoints = []

    def configure(**kw):
        endpoints.append(kw["backends"]["s3"]["endpoint_url"])
        return real_configure(**kw)

    monkeypatch.setattr(targets, "ProxyServer", Proxy)
    monkeypatch.setattr(targets.ckptio, "configure", configure)
    code = bench.main(
        ["--sizes", "64KiB", "--repeats", "2", "--backends", "s3", "--out", str(tmp_path), "--name", "peers"]
        + ["--no-chart", "--quiet", "--profile", "realistic", "--latency-ms", "5", "--stream-mbps", "500"]
    )
    assert code == 0
    out = capsys.readouterr().out
    assert [(p.latency, p.bandwidth) for p in proxies] == [(0.005, 500e6)] and endpoints == [proxies[0].url]
    assert "--profile realistic: S3 and GCS through a loopback proxy: 5 ms" in out
    doc = json.loads((tmp_path / "peers.json").read_text())
    peers = ("s3torchconnector S3Checkpoint", "s3torchconnector DCP", "s3fs pipe_file(torch.save)")
    assert not [s for s in doc["skipped"] if s["impl"] in peers]
    for peer in peers:
        ops = {r["op"] for r in doc["results"] if r["impl"] == peer and r["baseline"] and len(r["seconds"]) == 2}
        assert ops == {"save", "load"}, peer
        rs = [x for x in doc["ratios"] if x["baseline"] == peer]
        assert {x["impl"] for x in rs} >= {"ckptio .fpk", "ckptio .pt"}
        assert all(0 < x["ratio_min"] <= x["ratio_max"] for x in rs)
    assert out.startswith("== ckptio's best vs the best baseline")
    first = out.splitlines()[1]
    assert first.startswith("64 KiB  s3  save") and any(x["baseline"] in first for x in doc["summary"])
    assert "== 64 KiB of fp32 tensors" in out and all(r["size_bytes"] == 64 * 1024 for r in doc["results"])
    assert "s3torchconnector" in doc["machine"]["versions"]


def test_missing_peers_are_named(monkeypatch):
    from ckptio.bench import peers

    monkeypatch.setitem(sys.modules, "s3torchconnector", None)  # as if not installed
    impls, notes = peers.s3_peers("http://127.0.0.1:1", "k", "s")
    assert impls == [] and notes == [
        {
            "impl": "s3torchconnector",
            "reason": "baseline left out: the s3torchconnector package is not installed (pip install 'ckptio[peers]')",
        }
    ]


def test_chart_axes_fit_the_data_and_sizes_are_exact():
    from ckptio.bench.chart import log_limits
    from ckptio.bench.report import size_label
    from ckptio.bench.workload import make_state, nbytes

    lo, hi = log_limits([0.004, 0.2, 5.1])
    assert 0.001 <= lo <= 0.004 and 5.1 < hi <= 11  # not 50-100 GB/s for bars that stop near 5
    assert nbytes(make_state(8 * 2**20)) == 8 * 2**20 and size_label(8 * 2**20) == "8 MiB"
    assert size_label(3 * 2**30) == "3 GiB" and size_label(1536) == "1.5 KiB"


@pytest.mark.parametrize("own_process", [False, True])
def test_latency_proxy_adds_first_byte_latency_and_caps_bandwidth(own_process):
    """Coarse on purpose (a busy machine only adds time): 20 ms asked -> >= 15 ms per round trip on a
    kept-alive connection; 4 MB/s asked -> 1 MB each way takes >= 0.2 s, and the bytes arrive intact.
    In this process (LatencyProxy) and in its own (ProxyServer, what the benchmark runs)."""
    import http.client
    import threading
    import time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from ckptio.bench.proxy import LatencyProxy
    from ckptio.bench.servers import ProxyServer

    body = bytes(range(256)) * 4096  # 1 MiB

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):
            pass

        def do_GET(self):
            data = b"ok" if self.path == "/small" else body
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_PUT(self):
            n = len(self.rfile.read(int(self.headers["Content-Length"])))
            self.send_response(200)
            self.send_header("Content-Length", str(len(str(n))))
            self.end_headers()
            self.wfile.write(str(n).encode())

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        upstream = f"http://127.0.0.1:{server.server_address[1]}"
        proxy = (ProxyServer if own_process else LatencyProxy)(upstream, 0.020, 4e6)
        with proxy as p:
            conn = http.client.HTTPConnection("127.0.0.1", int(p.url.rsplit(":", 1)[1]), timeout=30)
            conn.request("GET", "/small")
            conn.getresponse().read()  # connected
            t = time.perf_counter()
            for _ in range(5):  # same connection: each turn pays the latency
                conn.request("GET", "/small")
                assert conn.getresponse().read() == b"ok"
            assert (time.perf_counter() - t) / 5 >= 0.015
            t = time.perf_counter()
            conn.request("GET", "/big")
            assert conn.getresponse().read() == body
            assert time.perf_counter() - t >= 0.2  # 1 MiB at 4 MB/s: 0.26 s
            t = time.perf_counter()
            conn.request("PUT", "/up", body=body)
            assert conn.getresponse().read() == str(len(body)).encode()
            assert time.perf_counter() - t >= 0.2
            conn.close()
    finally:
        server.shutdown()
        server.server_close()


ENTRY_POINTS = sorted(
    f[:-3] for f in os.listdir(os.path.join(ROOT, "benchmarks")) if f.endswith(".py") and not f.startswith("_")
)


@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_every_entry_point_is_thin_and_starts(name, capsys):
    """benchmarks/ holds entry points only (the code is in ckptio.bench, which imports nothing from
    tests/ or benchmarks/); each one imports and answers --help."""
    import importlib

    with open(os.path.join(ROOT, "benchmarks", name + ".py")) as f:
        assert len(f.read().splitlines()) <= 25, f"benchmarks/{name}.py: move its code into ckptio/bench/"
    mod = importlib.import_module(f"benchmarks.{name}")
    with pytest.raises(SystemExit) as e:
        mod.main(["--help"])
    assert e.value.code == 0 and "usage:" in capsys.readouterr().out


def test_the_bench_package_stands_alone():
    """No module of ckptio.bench reaches into tests/, benchmarks/ or a path outside the project."""
    bench = os.path.join(ROOT, "ckptio", "bench")
    for f in sorted(os.listdir(bench)):
        if f.endswith(".py"):
            with open(os.path.join(bench, f)) as fh:
                text = fh.read()
            assert "from servers import" not in text and '"tests"' not in text, f
            assert "/work/" not in text and "PERF.md" not in text and "shared/tools" not in text, f
            assert len(text.splitlines()) <= 600, f
    with open(os.path.join(ROOT, "benchmarks", "README.md")) as fh:
        readme = fh.read()
    assert "/work/" not in readme and "PERF.md" not in readme


def test_peer_credentials_are_set_only_during_a_peer_call(monkeypatch):
    """The CRT client reads credentials from the environment: the embedded server's test ones are set
    for each peer call only, so a --uri of the user's own bucket in the same run keeps the user's."""
    from ckptio.bench import peers

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "users-own")
    monkeypatch.setenv("AWS_SESSION_TOKEN", "users-token")
    seen = []
    call = peers._with_credentials(lambda s, u: seen.append(dict(os.environ)), ("bench", "bench-secret"))
    call({}, "s3://b/k")
    assert seen[0]["AWS_ACCESS_KEY_ID"] == "bench" and "AWS_SESSION_TOKEN" not in seen[0]
    assert os.environ["AWS_ACCESS_KEY_ID"] == "users-own" and os.environ["AWS_SESSION_TOKEN"] == "users-token"


def test_incremental_benchmark_restores_in_rounds_next_to_the_raw_floor(tmp_path, capsys, monkeypatch):
    """--restores N: N interleaved restores of each step 5 and the floor under them (the incremental
    step's content objects and the same ranges of the other step's file, read and hashed by plain code),
    the roots removed after; the floor's reads land each range in order."""
    from ckptio.bench import incremental

    monkeypatch.setattr(incremental.tempfile, "tempdir", str(tmp_path))
    assert incremental.main(["--size", "4", "--repeats", "1", "--targets", "local", "--restores", "3"]) == 0
    out = capsys.readouterr().out
    assert "3 more interleaved restores of step 5" in out and "n=3" in out, out
    assert "floor, the same bytes read and hashed by plain code" in out and "objects / file" in out, out
    assert not any(p.name.startswith("ckptio-inc-") and any(p.iterdir()) for p in tmp_path.iterdir())
    data = os.urandom(3 << 20)
    (tmp_path / "f").write_bytes(data)
    out_buf = memoryview(bytearray(len(data)))
    f = str(tmp_path / "f")
    payloads = [[(f, 2 << 20, out_buf[: 1 << 20])], [(f, 5, out_buf[1 << 20 : 2 << 20]), (f, 0, out_buf[2 << 20 :])]]
    assert incremental.raw_reads(payloads) > 0
    assert out_buf[: 1 << 20] == data[2 << 20 :] and out_buf[1 << 20 : 2 << 20] == data[5 : (1 << 20) + 5]
    assert out_buf[2 << 20 :] == data[: 1 << 20]


def test_incremental_floor_reads_each_payload_into_the_restores_own_tensors(tmp_path):
    """The floor under a restore reads each payload into the tensor the restore fills (where page-cache
    pages and their destination lie relative to each other changes a read's speed), from the file or
    from the content objects covering its range, a piece per object."""
    import types

    import torch

    import ckptio
    from ckptio.bench import incremental

    state = {"a": torch.arange(1000, dtype=torch.float32), "b": {"c": torch.ones(3, 5, dtype=torch.int64)}, "n": 7}
    path = str(tmp_path / "s.fpk")
    ckptio.dump(state, path)
    target = {"a": torch.zeros(1000), "b": {"c": torch.zeros(3, 5, dtype=torch.int64)}, "n": 0}
    spans = incremental.payload_targets(path, target)
    assert [len(v) for _, v in spans] == [4000, 120] and spans[0][0] < spans[1][0]
    assert incremental.raw_reads([[(path, off, view)] for off, view in spans]) > 0
    assert torch.equal(target["a"], state["a"]) and torch.equal(target["b"]["c"], state["b"]["c"])
    recipe = types.SimpleNamespace(offsets=[0, 100, 250], lengths=[100, 150, 50], hashes=["aa11", "bb22", "cc33"])
    view = memoryview(bytearray(200))
    pieces = incremental.block_pieces(recipe, "/c", 60, view)
    assert [(p, off, len(v)) for p, off, v in pieces] == [
        (os.path.join("/c", "aa", "aa11"), 60, 40),
        (os.path.join("/c", "bb", "bb22"), 0, 150),
        (os.path.join("/c", "cc", "cc33"), 0, 10),
    ]
    assert sum(len(v) for _, _, v in pieces) == len(view)


@pytest.mark.parametrize("fmt", ["fpk", "dcp"])
def test_incremental_benchmark_restores_cold_then_from_the_cache_they_left(tmp_path, capsys, monkeypatch, fmt):
    """--cold N: N interleaved restores of each step 5 with both checkpoints dropped from the page cache
    before each, each followed by one from the page cache; any local format; the roots removed after."""
    from ckptio.bench import incremental, measure

    monkeypatch.setattr(incremental.tempfile, "tempdir", str(tmp_path))
    dropped = []
    real = measure.evict_local
    monkeypatch.setattr(measure, "evict_local", lambda path: dropped.append(path) or real(path))
    assert (
        incremental.main(["--size", "4", "--repeats", "1", "--targets", "local", "--format", fmt, "--cold", "2"]) == 0
    )
    out = capsys.readouterr().out
    assert "2 cold restores of step 5 (page cache dropped before each)" in out and "n=2" in out, out
    assert "each followed by a restore from the page cache it left" in out, out
    assert len(dropped) == 2 * 2 * 2  # both roots, before each of the 2 x 2 cold restores
    assert "more interleaved restores" not in out  # --restores not asked for
    assert not any(p.name.startswith("ckptio-inc-") and any(p.iterdir()) for p in tmp_path.iterdir())


def test_floors_measure_a_verified_fpk_load_with_the_least_python(capsys):
    """The floor under the small loads (issue 35, 7b): the least a verified .fpk load does in Python
    returns what ckptio returns, fails on a damaged payload as ckptio does, and is printed next to the
    raw memcpy and ckptio, each row against the first."""
    import torch

    import ckptio
    from ckptio.bench.floors import fpk_floor, main
    from ckptio.errors import IntegrityError

    state = {"w": torch.randn(5, 7), "b": torch.arange(3), "n": {"x": torch.ones(2, dtype=torch.bfloat16)}, "k": 3}
    ckptio.dump(state, "memory://floors-test/s.fpk")
    data = ckptio.get("memory://floors-test/s.fpk")
    for one_buffer in (False, True):
        out = fpk_floor(data, one_buffer)
        assert out["k"] == 3 and torch.equal(out["w"], state["w"]) and torch.equal(out["n"]["x"], state["n"]["x"])
        damaged = bytearray(data)
        damaged[64] ^= 1  # the first payload's first byte
        with pytest.raises(IntegrityError):
            fpk_floor(bytes(damaged), one_buffer)
    assert main(["--sizes", "6KiB", "--backends", "memory", "--repeats", "1"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("  load")]
    assert [r[-1] for r in rows][0] == "1.00x" and len(rows) == 4
    assert " ".join(rows[1][1:5]) == ".fpk verified, least Python" and rows[3][1:3] == ["ckptio", ".fpk"]

"""benchmarks.ceiling's no-work client moves the bytes it claims to (so the ceiling it reports is one a
real client could reach), and the script runs end to end and reports every client's share of it."""

from __future__ import annotations

import importlib.util
import os

import pytest

from ckptio.bench.ceiling import RawClient, main
from servers import MotoServer, make_s3_bucket, s3_client


def test_the_raw_client_moves_exact_bytes() -> None:
    data = os.urandom((20 << 20) + 4097)  # three 8 MiB upload parts, two 16 MiB ranges with a short last one
    with MotoServer(ranged_reads=True) as srv:
        make_s3_bucket(srv.url, "bkt")
        raw, boto = RawClient(srv.url), s3_client(srv.url)
        raw.put("/bkt/one", memoryview(data))
        raw.multipart("/bkt/parts", memoryview(data), 8 << 20, 8)
        for key in ("one", "parts"):
            assert boto.get_object(Bucket="bkt", Key=key)["Body"].read() == data, key
            for conns in (1, 8):
                buf = bytearray(len(data))
                raw.ranged(f"/bkt/{key}", memoryview(buf), 16 << 20, conns)
                assert buf == data, (key, conns)
        with pytest.raises(RuntimeError, match="HTTP 404"):
            raw.get_into("/bkt/missing", memoryview(bytearray(10)), 0)


@pytest.mark.slow
def test_the_ceiling_script_reports_every_client(capsys) -> None:
    assert main(["--sizes", "1MiB", "--repeats", "2", "--profile", "realistic"]) == 0
    out = capsys.readouterr().out
    for name in (
        "raw PUT / GET x1",
        "raw GET 16 MiB x16",
        "fresh memory",
        "ckptio .fpk",
        "ckptio DCP",
        "s3fs pipe_file",
    ):
        assert out.count(name) == 2 - ("raw GET" in name or "fresh" in name), name  # save and load (raw GET: load)
    assert out.count("of the ceiling") >= 12
    if importlib.util.find_spec("s3torchconnector") is not None:  # the bound against each of its APIs
        for peer in ("S3Checkpoint", "DCP"):
            for op in ("save", "load"):
                assert f"{op}: the most any client could be faster than s3torchconnector {peer} here:" in out

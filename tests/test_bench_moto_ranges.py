"""The realistic benchmark profile's S3 server (moto whose ranged GETs read only their range) answers
exactly what moto answers: the same bytes, Content-Range and errors, for every kind of range."""

from __future__ import annotations

import os

import pytest

from conftest import S3_TEST_OPTIONS
from servers import MotoServer, make_s3_bucket, s3_client

SIZE = (20 << 20) + 12345  # past moto's 16 MiB in-memory buffer: the object lives in a temporary file

RANGES = [
    "bytes=0-0",
    "bytes=0-99",
    "bytes=1000-2000000",
    f"bytes={SIZE - 10}-{SIZE + 100}",  # past the end: clipped
    f"bytes={SIZE - 1}-{SIZE - 1}",
    "bytes=-5",  # suffix
    "bytes=10-",  # open
    "bytes=5-3",  # reversed: the whole object
    "bytes=0-1,5-9",  # several: moto answers the whole object
]


def _answers(server: MotoServer, data: bytes) -> list[tuple]:
    make_s3_bucket(server.url, "bkt")
    c = s3_client(server.url)
    c.put_object(Bucket="bkt", Key="big", Body=data)
    c.put_object(Bucket="bkt", Key="empty", Body=b"")
    out: list[tuple] = []
    for key in ("big", "empty"):
        for rng in RANGES + [f"bytes={SIZE}-{SIZE + 5}"]:
            try:
                r = c.get_object(Bucket="bkt", Key=key, Range=rng)
                out.append((key, rng, r["ContentLength"], r.get("ContentRange"), r["Body"].read()))
            except c.exceptions.ClientError as e:
                out.append((key, rng, "error", e.response["Error"]["Code"]))
        out.append((key, "whole", c.get_object(Bucket="bkt", Key=key)["Body"].read()))
        try:
            out.append((key, "head", c.head_object(Bucket="bkt", Key=key, Range="bytes=0-9")["ContentLength"]))
        except c.exceptions.ClientError as e:
            out.append((key, "head", "error", e.response["Error"]["Code"]))
    return out


def test_ranged_reads_answer_what_moto_answers() -> None:
    data = os.urandom(SIZE)
    with MotoServer() as plain:
        want = _answers(plain, data)
    with MotoServer(ranged_reads=True) as ranged:
        got = _answers(ranged, data)
    assert [g[:4] for g in got] == [w[:4] for w in want]
    assert got == want
    assert any(len(w) == 5 and w[4] == data[1000:2000001] for w in want)


@pytest.mark.parametrize("fmt", [".fpk", ".pt"])
def test_ckptio_loads_through_the_ranged_server(tmp_path, fmt: str) -> None:
    import torch

    import ckptio

    state = {"w": torch.arange(6 << 20, dtype=torch.float32), "b": torch.ones(3), "step": 7}
    with MotoServer(ranged_reads=True) as srv:
        make_s3_bucket(srv.url, "bkt")
        ckptio.configure(backends={"s3": {"endpoint_url": srv.url, **S3_TEST_OPTIONS, "part_size": 8 << 20}})
        ckptio.dump(state, f"s3://bkt/state{fmt}")
        back = ckptio.load(f"s3://bkt/state{fmt}")
    assert back["step"] == 7 and torch.equal(back["w"], state["w"]) and torch.equal(back["b"], state["b"])

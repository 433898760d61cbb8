"""Ranged reads from S3/GCS when the server ignores ``Range`` (answers 200 with the whole object):
a read from offset 0 is still right, a read from further in fails loudly instead of returning the
object's first bytes."""

from __future__ import annotations

import os

import pytest

import ckptio
from ckptio.errors import TransferError
from faultproxy import Fault, MiB


def test_ignored_range_is_detected(faults):
    b, u = ckptio.resolve(faults.uri + "/obj.bin")
    data = os.urandom(MiB)
    b.write(u, data)
    faults.add(Fault("ignore_range", method="GET", path="obj.bin", fraction=1.0))
    buf = bytearray(1000)
    assert b.readinto(u, buf, 0) == 1000 and buf == data[:1000]  # the first bytes are the first bytes
    with pytest.raises(TransferError, match="ignored the Range header") as ei:
        b.readinto(u, buf, 5000)
    assert u in str(ei.value)
    with pytest.raises(TransferError, match="ignored the Range header"):
        b.read_range(u, 10, 20)
    faults.clear()
    assert b.read_range(u, 10, 20) == data[10:20]


@pytest.mark.parametrize("store", ["s3", "gcs"])
def test_scatter_reads_stream_across_buffers_and_requests(store, request):
    """``Backend.readv``: one ranged request streams through several buffers, a buffer larger than a
    part is cut across requests, and a read past the end fills the prefix only."""
    base = request.getfixturevalue(f"{store}_uri")
    b, u = ckptio.resolve(base + "/scatter.bin")
    part = 5 * MiB  # the smallest S3 allows
    b = b.with_options(part_size=part)
    data = os.urandom(3 * part - 1234)
    b.write(u, data)
    sizes = [1, part - 1001, 3000, 0, 17, part + 5000]
    sizes.append(len(data) - sum(sizes))
    views = [memoryview(bytearray(n)) for n in sizes]
    assert b.readv(u, views, 0) == len(data)
    assert b"".join(bytes(v) for v in views) == data
    views = [memoryview(bytearray(n)) for n in (100, 2000, 500)]
    assert b.readv(u, views, len(data) - 1000) == 1000  # 1600 bytes past the end: the filled prefix
    assert bytes(views[0]) + bytes(views[1][:900]) == data[-1000:]
    mb, mu = ckptio.resolve("memory://scatter-test/x.bin")
    mb.write(mu, data)
    mem = [memoryview(bytearray(n)) for n in sizes]
    assert mb.readv(mu, mem, 0) == len(data) and b"".join(bytes(v) for v in mem) == data  # per buffer, in place


def test_a_server_ignoring_suffix_ranges_is_read_by_offset(s3_faults, monkeypatch):
    """A server that answers ``Range: bytes=-N`` with the whole object (200): the end of the object is
    read again by offset (the reply told the size), the load is exact, and the backend asks for no more
    suffixes; a suffix read lies in its buffer as aligned as in the object."""
    import torch

    from ckptio.formats.fastpickle import read as fpk_read

    monkeypatch.setattr(fpk_read, "TAIL_EARLY", 0.0)  # the size is late whatever the store's speed
    b, u = ckptio.resolve(s3_faults.uri + "/tail.bin")
    data = os.urandom(MiB + 13)
    b.write(u, data)
    buf = memoryview(bytearray(1000 + 63))
    fut = b.start_read_tail(u, buf, 64)
    assert fut is not None and fut.result() == 1000
    at = (len(data) - 1000) % 64
    assert bytes(buf[at : at + 1000]) == data[-1000:]
    small = memoryview(bytearray(4096))
    assert b.start_read_tail(u + "-none", small) is not None  # a missing object: the future's error
    with pytest.raises(FileNotFoundError):
        b.start_read_tail(u + "-none", small).result()

    g = torch.Generator().manual_seed(4)
    state = {"a": torch.randn(3 << 20, generator=g), "z": torch.randn(5, generator=g)}
    uri = s3_faults.uri + "/ignored.fpk"
    ckptio.dump(state, uri)
    s3_faults.add(Fault("ignore_range", method="GET", range="bytes=-", fraction=1.0))
    out = ckptio.load(uri)
    assert all(torch.equal(out[k], v) for k, v in state.items())
    assert s3_faults.fired("ignore_range") == 1
    assert ckptio.resolve(uri)[0].suffix_reads is False  # this backend asks no more
    s3_faults.requests.clear()
    out = ckptio.load(uri)
    assert all(torch.equal(out[k], v) for k, v in state.items())
    assert not [r for r in s3_faults.requests if (r.headers.get("Range") or "").startswith("bytes=-")]


@pytest.mark.parametrize("kind", ["reset", "status", "truncate"])
def test_a_suffix_read_that_fails_once_is_retried(s3_faults, monkeypatch, kind):
    """The early read of an object's end goes through the retry policy as every GET does: a broken,
    refused or short reply is retried and the load is exact."""
    import torch

    from ckptio.formats.fastpickle import read as fpk_read

    monkeypatch.setattr(fpk_read, "TAIL_EARLY", 0.0)
    g = torch.Generator().manual_seed(6)
    state = {"a": torch.randn(3 << 20, generator=g), "z": torch.randn(5, generator=g)}
    uri = s3_faults.uri + f"/retried-{kind}.fpk"
    ckptio.dump(state, uri)
    s3_faults.add(Fault(kind, method="GET", range="bytes=-", nth=1))
    out = ckptio.load(uri)
    assert all(torch.equal(out[k], v) for k, v in state.items())
    assert s3_faults.fired(kind) == 1


@pytest.mark.parametrize("kind", ["reset", "status", "truncate"])
def test_a_middle_range_that_fails_once_is_retried(s3_faults, kind):
    """A mid-sized object's middle, read ahead once the size is known, goes through the retry policy as
    every GET does: a broken, refused or short reply of its first range is retried and the load is exact."""
    import torch

    from ckptio.formats.fastpickle import read as fpk_read

    g = torch.Generator().manual_seed(8)
    state = {"a": torch.randn(5 << 20, generator=g), "z": torch.randn(5, generator=g)}  # 20 MiB
    uri = s3_faults.uri + f"/middle-{kind}.fpk"
    ckptio.dump(state, uri)
    head = min(ckptio.resolve(uri)[0].part_size, fpk_read.HEAD_PREFETCH)
    s3_faults.add(Fault(kind, method="GET", range=f"bytes={head}-", nth=1))  # the middle's first range
    out = ckptio.load(uri)
    assert all(torch.equal(out[k], v) for k, v in state.items())
    assert s3_faults.fired(kind) == 1


def test_a_middle_range_that_keeps_failing_fails_the_load_naming_the_object(s3_faults):
    """Refused for good (403): the load raises the store's error naming the object, once every range
    read ahead has ended (nothing is still writing into the buffers), and the next load works."""
    import torch

    from ckptio.errors import AccessDeniedError
    from ckptio.formats.fastpickle import read as fpk_read

    g = torch.Generator().manual_seed(9)
    state = {"a": torch.randn(5 << 20, generator=g), "z": torch.randn(5, generator=g)}
    uri = s3_faults.uri + "/middle-denied.fpk"
    ckptio.dump(state, uri)
    head = min(ckptio.resolve(uri)[0].part_size, fpk_read.HEAD_PREFETCH)
    s3_faults.add(Fault("status", status=403, code="AccessDenied", method="GET", range=f"bytes={head}-", fraction=1.0))
    with pytest.raises(AccessDeniedError) as ei:
        ckptio.load(uri)
    assert "middle-denied.fpk" in str(ei.value)
    s3_faults.clear()
    out = ckptio.load(uri)
    assert all(torch.equal(out[k], v) for k, v in state.items())


def test_a_refused_suffix_range_is_read_by_offset_and_not_asked_again(s3_faults, monkeypatch):
    """A server that refuses ``bytes=-N`` (400) fails only the early read of the end: the load reads it
    by offset, and the backend asks for no more suffixes."""
    import torch

    from ckptio.formats.fastpickle import read as fpk_read

    monkeypatch.setattr(fpk_read, "TAIL_EARLY", 0.0)
    g = torch.Generator().manual_seed(7)
    state = {"a": torch.randn(3 << 20, generator=g), "z": torch.randn(5, generator=g)}
    uri = s3_faults.uri + "/refused.fpk"
    ckptio.dump(state, uri)
    s3_faults.add(Fault("status", status=400, code="InvalidArgument", method="GET", range="bytes=-", fraction=1.0))
    out = ckptio.load(uri)
    assert all(torch.equal(out[k], v) for k, v in state.items())
    assert s3_faults.fired("status") == 1 and ckptio.resolve(uri)[0].suffix_reads is False


def test_an_unused_suffix_read_that_stalls_does_not_hold_a_small_load(s3_faults, monkeypatch):
    """A small object comes whole with the first range: the early read of its end is not waited for."""
    import time

    import torch

    from ckptio.formats.fastpickle import read as fpk_read

    monkeypatch.setattr(fpk_read, "TAIL_EARLY", 0.0)
    state = {"w": torch.arange(100.0)}
    uri = s3_faults.uri + "/stalled.fpk"
    ckptio.dump(state, uri)
    s3_faults.add(Fault("stall", method="GET", range="bytes=-", before=True, stall=3.0, fraction=1.0))
    t = time.monotonic()
    out = ckptio.load(uri)
    assert time.monotonic() - t < 2.0 and torch.equal(out["w"], state["w"])


def test_suffix_replies_must_be_the_objects_last_bytes():
    from ckptio.objectstore import retry as _retry

    _retry.check_suffix_status(206, 100, 1000, "s3://b/k", "bytes 900-999/1000")
    _retry.check_suffix_status(206, 100, 50, "s3://b/k", "bytes 0-49/50")
    _retry.check_suffix_status(200, 100, 50, "s3://b/k", None)  # the whole object, no larger than asked
    for status, size, rng in [(206, 1000, "bytes 0-99/1000"), (206, 1000, "bytes 900-998/1000"), (206, 1000, None)]:
        with pytest.raises(TransferError, match="last 100 bytes of s3://b/k"):
            _retry.check_suffix_status(status, 100, size, "s3://b/k", rng)
    with pytest.raises(_retry.SuffixIgnoredError):
        _retry.check_suffix_status(200, 100, 1000, "s3://b/k", None)


@pytest.mark.parametrize("part", [(5 << 20) + 1, 7_500_000])
def test_views_of_ranges_read_ahead_are_aligned_whatever_the_part_size(s3_uri, monkeypatch, part):
    """The ranges a remote load reads ahead start wherever ``part_size`` and the object's size put them;
    a payload returned as a view of one is as aligned in memory as in the file, else it is copied."""
    import torch

    from ckptio.formats.fastpickle import read as fpk_read

    g = torch.Generator().manual_seed(8)
    # "b" lies past the first range (its end in the tail read ahead, which starts where part_size says)
    state = {"a": torch.randn(part // 4 + 100, generator=g), "b": torch.randn(300, generator=g)}
    for early in (3600.0, 0.0):
        monkeypatch.setattr(fpk_read, "TAIL_EARLY", early)
        uri = f"{s3_uri}/aligned-{part}-{early}.fpk"
        ckptio.dump(state, uri)
        out = ckptio.load(uri, backend_args={"part_size": part})
        for k, v in state.items():
            assert torch.equal(out[k], v) and out[k].data_ptr() % 64 == 0, (k, out[k].data_ptr() % 64)

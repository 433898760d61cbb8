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

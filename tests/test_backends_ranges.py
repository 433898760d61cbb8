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

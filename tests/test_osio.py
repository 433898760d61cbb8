"""``ckptio.osio.copy_bytes``: the copy memory:// reads use (large copies with the GIL released)."""

from __future__ import annotations

import os

import pytest

import ckptio
from ckptio import osio


@pytest.mark.parametrize("n", [0, 1, 4096, osio.COPY_UNLOCKED_MIN - 1, osio.COPY_UNLOCKED_MIN, 3 << 20])
@pytest.mark.parametrize("offset", [0, 7])
def test_copy_bytes_copies_what_a_slice_would(n, offset):
    src = os.urandom((3 << 20) + 100)
    dst = bytearray(n + 5)
    got = osio.copy_bytes(memoryview(dst)[2 : 2 + n], src, offset)
    assert got == n and dst[2 : 2 + n] == src[offset : offset + n] and dst[:2] == b"\0\0" and dst[2 + n :] == b"\0" * 3


def test_copy_bytes_past_the_end_and_other_sources_and_read_only_targets():
    src = os.urandom(2 << 20)
    dst = bytearray(2 << 20)
    assert osio.copy_bytes(memoryview(dst), src, (1 << 20) + 3) == (1 << 20) - 3  # short at the end
    assert dst[: (1 << 20) - 3] == src[(1 << 20) + 3 :]
    assert osio.copy_bytes(memoryview(dst), src, len(src) + 10) == 0
    arr = bytearray(src)  # not bytes: copied by slice assignment
    dst2 = bytearray(len(src))
    assert osio.copy_bytes(memoryview(dst2), arr) == len(src) and dst2 == arr
    with pytest.raises(TypeError):
        osio.copy_bytes(memoryview(bytes(len(src))), src)


def test_memory_reads_copy_large_ranges_without_the_gil(monkeypatch):
    calls: list[int] = []
    real = osio.memmove
    monkeypatch.setattr(osio, "memmove", lambda d, s, n, *a: (calls.append(n), real(d, s, n, *a)))
    backend, uri = ckptio.resolve("memory://osio-test/big.bin")
    data = os.urandom(5 << 20)
    backend.write(uri, data)
    buf = bytearray(4 << 20)
    assert backend.readinto(uri, buf, 1 << 20) == 4 << 20 and buf == data[1 << 20 :]
    assert calls == [4 << 20]
    small = bytearray(100)
    assert backend.readinto(uri, small, 10) == 100 and small == data[10:110] and calls == [4 << 20]
    backend.delete(uri)


def test_copy_bytes_refuses_negative_offsets_and_counts_bytes_of_any_format():
    src = os.urandom(3 << 20)
    with pytest.raises(ValueError, match="negative"):
        osio.copy_bytes(memoryview(bytearray(2 << 20)), src, -32)
    backend, uri = ckptio.resolve("memory://osio-test/neg.bin")
    backend.write(uri, src)
    with pytest.raises(ValueError, match="memory://osio-test/neg.bin"):
        backend.readinto(uri, bytearray(2 << 20), -(1 << 44))
    backend.delete(uri)
    floats = memoryview(bytearray(2 << 20)).cast("f")  # 512 Ki items, 2 MiB
    assert osio.copy_bytes(floats, src) == 2 << 20 and floats.cast("B") == src[: 2 << 20]

"""Local ``.fpk`` loads map the file by default (``mmap=None``): no second copy of the bytes, every
checksum still verified, the file never changed by the loaded tensors, and what ckptio does to the
file later (replace, delete) never changes them. Open file objects and ``mmap=False`` read into fresh
memory."""

from __future__ import annotations

import io
import os

import pytest
import torch

import ckptio
import ckptio.fastpickle as fp
from ckptio.errors import IntegrityError
from conftest import flip_byte


def mapped_file(t: torch.Tensor) -> str | None:
    """The file whose mapping holds ``t``'s bytes (None: anonymous memory)."""
    addr = t.data_ptr()
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= addr < hi:
                return parts[5].strip() if len(parts) == 6 and parts[5].startswith("/") else None
    return None


def state() -> dict:
    g = torch.Generator().manual_seed(0)
    w, h = torch.randn(256, 256, generator=g), torch.randn(7, generator=g).half()
    return {"w": w, "b": torch.arange(1000), "step": 3, "h": h}


def same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k, v in b.items():
        assert torch.equal(a[k], v) if isinstance(v, torch.Tensor) else a[k] == v


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs /proc/self/maps")
def test_local_load_is_a_verified_private_mapping(tmp_path):
    p = str(tmp_path / "s.fpk")
    want = state()
    ckptio.dump(want, p)
    for out in (ckptio.load(p), fp.load(p), ckptio.load("file://" + p)):
        same(out, want)
        assert mapped_file(out["w"]) == p and mapped_file(out["b"]) == p
    out = ckptio.load(p)
    out["w"].add_(1)  # copy-on-write: the file keeps what was saved
    same(ckptio.load(p, mmap=False), want)
    assert mapped_file(ckptio.load(p, mmap=False)["w"]) is None
    with open(p, "rb") as f:  # a caller's open file: it may be written through the caller's handle
        assert mapped_file(fp.load(f)["w"]) is None


def test_the_default_mapping_verifies_every_payload(tmp_path):
    p = str(tmp_path / "s.fpk")
    ckptio.dump(state(), p)
    flip_byte(p, fp.inspect(p).tensors[1].offset + 100)  # "b"
    with pytest.raises(IntegrityError, match="'b'"):
        ckptio.load(p)
    with pytest.raises(IntegrityError, match="'b'"):
        fp.load(p, mmap=True, verify=True)
    fp.load(p, mmap=True)  # asked for a lazy mapping: only what is touched is read
    ckptio.load(p, verify=False)


def test_tensors_of_a_mapped_load_outlive_the_file_being_replaced_or_deleted(tmp_path):
    p = str(tmp_path / "s.fpk")
    want = state()
    ckptio.dump(want, p)
    out = ckptio.load(p)
    ckptio.dump({k: (v + 1 if isinstance(v, torch.Tensor) else v) for k, v in want.items()}, p)  # replaced
    same(out, want)
    out2 = ckptio.load(p)
    os.remove(p)
    assert torch.equal(out2["b"], want["b"] + 1)
    same(out, want)


def test_many_payloads_are_verified_by_two_threads_and_any_damage_is_found(tmp_path):
    p = str(tmp_path / "many.fpk")
    want = {f"t{i}": torch.full((1000 + i,), float(i)) for i in range(40)}
    ckptio.dump(want, p)
    same(ckptio.load(p), want)
    infos = fp.inspect(p).tensors
    for victim in (0, 17, 39):
        data = bytearray(open(p, "rb").read())
        data[infos[victim].offset + 8] ^= 1
        q = str(tmp_path / f"bad{victim}.fpk")
        with open(q, "wb") as f:
            f.write(data)
        with pytest.raises(IntegrityError, match=f"'t{victim}'"):
            ckptio.load(q)


def test_bytes_io_and_memory_loads_are_never_mapped(memory_uri):
    buf = io.BytesIO()
    fp.save(state(), buf)
    buf.seek(0)
    same(fp.load(buf), state())
    ckptio.dump(state(), memory_uri + "/s.fpk")
    same(ckptio.load(memory_uri + "/s.fpk"), state())

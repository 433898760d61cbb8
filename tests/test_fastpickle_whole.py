"""A full ``.fpk`` load of a small object from a backend whose reads are local (memory://) reads it whole,
with one read into one buffer of its own, and returns the tensors as views of it, as a small remote
object's are; every checksum is still verified. ``mmap=False``, ``keys=``, ``into=`` and larger objects
read payload by payload."""

from __future__ import annotations

import pytest
import torch

import ckptio
from ckptio.errors import IntegrityError
from ckptio.formats.fastpickle import inspect
from ckptio.formats.fastpickle.layout import ALIGN


def state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(64, 32, generator=g), "b": torch.arange(100), "h": torch.randn(7).half(), "n": 3}


@pytest.fixture
def reads(monkeypatch) -> list[tuple[int, int]]:
    """(offset, bytes) of every copy out of a memory:// object (the bytes it holds: ``Backend.held``)."""
    from ckptio import osio

    seen: list[tuple[int, int]] = []

    def copy_bytes(dst, src, offset=0):
        n = osio.copy_bytes(dst, src, offset)
        seen.append((offset, n))
        return n

    monkeypatch.setattr("ckptio.formats.fastpickle.read.copy_bytes", copy_bytes)
    return seen


def test_a_small_memory_load_is_one_read_and_views_of_one_aligned_buffer(memory_uri, reads):
    uri = f"{memory_uri}/whole.fpk"
    s = state()
    ckptio.dump(s, uri)
    size = len(ckptio.get(uri))
    reads.clear()
    out = ckptio.load(uri)
    assert reads == [(0, size)]
    assert out["n"] == 3 and all(torch.equal(out[k], s[k]) for k in ("w", "b", "h"))
    ptrs = [out[k].data_ptr() for k in ("w", "b", "h")]
    assert all(p % ALIGN == 0 for p in ptrs)
    assert max(ptrs) - min(ptrs) < size  # one buffer
    out["w"].add_(1)  # the loaded tensors are the caller's: the stored object is unchanged
    assert torch.equal(ckptio.load(uri)["w"], s["w"])


@pytest.mark.parametrize("where", ["payload", "metadata"])
def test_damage_to_a_small_memory_object_is_found_and_named(memory_uri, where):
    uri = f"{memory_uri}/damaged-{where}.fpk"
    ckptio.dump(state(), uri)
    data = bytearray(ckptio.get(uri))
    info = next(t for t in inspect(uri).tensors if t.path == "w")
    at = info.offset + 5 if where == "payload" else len(data) - 80
    data[at] ^= 0x40
    ckptio.put(bytes(data), uri)
    with pytest.raises(IntegrityError) as e:
        ckptio.load(uri)
    assert uri.split("://", 1)[1] in str(e.value) and ("'w'" in str(e.value) if where == "payload" else True)


@pytest.mark.parametrize("how", ["mmap=False", "keys", "into", "large"])
def test_other_memory_loads_read_payload_by_payload(memory_uri, reads, monkeypatch, how):
    uri = f"{memory_uri}/by-payload-{how}.fpk"
    s = state()
    ckptio.dump(s, uri)
    size = len(ckptio.get(uri))
    if how == "large":
        monkeypatch.setattr("ckptio.formats.fastpickle.read.WHOLE_LOCAL_MAX", size - 1)
    reads.clear()
    if how == "into":
        target = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else v for k, v in s.items()}
        ckptio.load(uri, into=target)
        out = target
    elif how == "keys":
        out = ckptio.load(uri, keys=["w", "b"])
    else:
        out = ckptio.load(uri, mmap=False) if how == "mmap=False" else ckptio.load(uri)
    assert (0, size) not in reads and len(reads) > 1
    assert torch.equal(out["w"], s["w"]) and torch.equal(out["b"], s["b"])
    if how in ("mmap=False", "large"):  # fresh memory a tensor
        assert out["w"].untyped_storage().nbytes() == s["w"].nbytes


def test_memory_objects_are_read_out_of_the_bytes_the_backend_holds(memory_uri, tmp_path):
    """``Backend.held``: memory:// gives its stored bytes (one version: a write replaces them), a wrapper
    that must count every byte (progress) and every other backend give None."""
    from ckptio.backends.base import Held
    from ckptio.errors import NotFoundError
    from ckptio.formats.fastpickle.read import HeldSource, source_for

    uri = f"{memory_uri}/held.fpk"
    ckptio.dump(state(), uri)
    backend, resolved = ckptio.resolve(uri)
    held = backend.held(resolved)
    assert isinstance(held, Held) and held.data == ckptio.get(uri)
    assert isinstance(source_for(backend, resolved), HeldSource)
    ckptio.dump({"other": 1}, uri)  # replaced: what was held is unchanged
    assert held.data != ckptio.get(uri) and ckptio.load(uri) == {"other": 1}
    with pytest.raises(NotFoundError, match="nothing-here"):
        ckptio.load(f"{memory_uri}/nothing-here.fpk")
    local, path = ckptio.resolve(str(tmp_path / "x.fpk"))
    assert local.held(path) is None
    seen: list[int] = []
    ckptio.load(uri, progress=lambda done, total: seen.append(done))  # through the counting wrapper
    assert seen and seen[-1] == len(ckptio.get(uri))


def test_a_held_source_refuses_reads_past_its_end_naming_the_object():
    from ckptio.backends.base import Held
    from ckptio.formats.fastpickle.read import HeldSource

    counted: list[int] = []
    src = HeldSource(Held(b"0123456789", counted.append), "memory://b/x.fpk")
    assert bytes(src.view(2, 3)) == b"234" and src.read(8, 2) == b"89" and counted == [3, 2]
    for offset, n in ((8, 3), (-1, 2), (11, 0)):
        with pytest.raises(IntegrityError, match="memory://b/x.fpk: truncated"):
            src.read(offset, n)
    buf = bytearray(4)
    assert src.readinto(memoryview(buf), 8) == 2 and buf[:2] == b"89"  # a short read is counted as such

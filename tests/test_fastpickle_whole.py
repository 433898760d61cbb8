"""A full ``.fpk`` load of a small object from a backend whose reads are local (memory://) reads it whole,
with one read into one buffer of its own, and returns the tensors as views of it, as a small remote
object's are; every checksum is still verified. ``mmap=False``, ``keys=``, ``into=`` and larger objects
read payload by payload."""

from __future__ import annotations

import pytest
import torch

import ckptio
from ckptio.backends.memory import MemoryBackend
from ckptio.errors import IntegrityError
from ckptio.formats.fastpickle import inspect
from ckptio.formats.fastpickle.layout import ALIGN


def state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(64, 32, generator=g), "b": torch.arange(100), "h": torch.randn(7).half(), "n": 3}


@pytest.fixture
def reads(monkeypatch) -> list[tuple[int, int]]:
    """(offset, bytes) of every copy out of a memory:// object."""
    seen: list[tuple[int, int]] = []
    real = MemoryBackend._copy_out

    def copy_out(self, uri, data, buf, offset):
        n = real(self, uri, data, buf, offset)
        seen.append((offset, n))
        return n

    monkeypatch.setattr(MemoryBackend, "_copy_out", copy_out)
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

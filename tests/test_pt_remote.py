"""``.pt`` loads from storage without a local file: fetched into memory (the first part by the one request
that also tells the size, the rest in parallel ranges), read in place by torch's zip reader; an object that
changes while it is read is an error naming it, never a load of mixed bytes. Request counts on S3 / GCS are
in ``test_small_requests.py``; faults on the wire in ``test_faults.py``."""

from __future__ import annotations

import io
import random

import pytest
import torch

import ckptio
from ckptio.backends.readers import PiecesReader
from ckptio.errors import IntegrityError, NotFoundError
from conftest import UserDictBackend


def test_pieces_reader_reads_as_one_file():
    rng = random.Random(0)
    pieces = [bytes(rng.randrange(256) for _ in range(n)) for n in (5, 0, 17, 1, 0, 33)]
    whole = b"".join(pieces)
    r = PiecesReader([memoryview(p) for p in pieces], "mem://x")
    assert r.size == len(whole) and r.read() == whole
    for _ in range(300):
        pos, n = rng.randrange(len(whole) + 3), rng.randrange(40)
        r.seek(pos)
        assert r.read(n) == whole[pos : pos + n]
        assert r.tell() == min(max(pos, pos + min(n, len(whole) - pos)), max(pos, len(whole)))
    buf = io.BytesIO()
    torch.save({"w": torch.arange(1000)}, buf)
    data = buf.getvalue()
    cut = [data[:7], data[7:500], data[500:]]
    assert torch.equal(torch.load(PiecesReader(cut), weights_only=True)["w"], torch.arange(1000))
    assert PiecesReader([]).read() == b""


@pytest.fixture
def userdict():
    UserDictBackend.store.clear()
    yield "userdict://bkt"
    UserDictBackend.store.clear()


@pytest.mark.parametrize("part_size", [64 << 10, 8 << 20])  # several pieces; one
def test_remote_pt_round_trip(userdict, part_size):
    state = {"w": torch.randn(300_000), "step": 7, "nested": {"b": torch.arange(10)}}
    uri = userdict + "/m.pt"
    ckptio.dump(state, uri)
    out = ckptio.load(uri, backend_args={"part_size": part_size})
    assert torch.equal(out["w"], state["w"]) and out["step"] == 7 and torch.equal(out["nested"]["b"], torch.arange(10))
    out["w"].add_(1)  # writable tensors of their own storage, as torch.load's
    assert out["w"].untyped_storage().nbytes() == state["w"].nbytes


def test_remote_pt_over_the_memory_bound_goes_through_a_file(userdict, monkeypatch):
    from ckptio.formats import torch as ptformat

    monkeypatch.setattr(ptformat, "IN_MEMORY_MAX", 256 << 10)
    state = {"w": torch.randn(300_000)}  # 1.2 MiB
    ckptio.dump(state, userdict + "/m.pt")
    out = ckptio.load(userdict + "/m.pt", backend_args={"part_size": 64 << 10})
    assert torch.equal(out["w"], state["w"])


def test_remote_pt_that_shrinks_while_read_is_an_integrity_error(userdict, monkeypatch):
    state = {"w": torch.randn(300_000)}
    uri = userdict + "/m.pt"
    ckptio.dump(state, uri)
    real = UserDictBackend.read_range

    def shrinking(self, u, start=0, end=None):  # replaced by a shorter object after the first range
        return real(self, u, start, end) if start == 0 else real(self, u, start, end)[:-100]

    monkeypatch.setattr(UserDictBackend, "read_range", shrinking)
    with pytest.raises(IntegrityError, match="userdict://bkt/m.pt"):
        ckptio.load(uri, backend_args={"part_size": 64 << 10})


def test_remote_pt_missing_is_not_found(userdict):
    with pytest.raises(NotFoundError, match="userdict://bkt/none.pt"):
        ckptio.load(userdict + "/none.pt")


def test_memory_pt_over_the_memory_bound_needs_no_temporary_file(monkeypatch):
    from ckptio.backends import base
    from ckptio.formats import torch as ptformat

    state = {"w": torch.randn(300_000), "b": torch.arange(5)}  # 1.2 MiB
    ckptio.dump(state, "memory://bkt/big.pt")
    monkeypatch.setattr(ptformat, "IN_MEMORY_MAX", 256 << 10)

    def no_temp(*a, **k):
        raise AssertionError("a temporary file was made")

    monkeypatch.setattr(base.tempfile, "mkdtemp", no_temp)
    out = ckptio.load("memory://bkt/big.pt")
    assert torch.equal(out["w"], state["w"]) and torch.equal(out["b"], state["b"])
    ckptio.remove("memory://bkt/big.pt")


def test_pt_over_the_memory_bound_keeps_the_backends_error(monkeypatch):
    """torch's file adapter swallows a reader's exception and fails with its own ("read of closed
    file"); the reader route re-raises the backend's, which names the object."""
    from ckptio.backends import memory
    from ckptio.formats import torch as ptformat

    state = {"w": torch.randn(300_000)}
    ckptio.dump(state, "memory://bkt/gone.pt")
    monkeypatch.setattr(ptformat, "IN_MEMORY_MAX", 256 << 10)
    real = memory._Snapshot.readinto  # the reads of one load (Backend.pin_version)

    def vanishing(self, uri, buf, offset=0):
        if offset > 0:
            raise NotFoundError(uri)
        return real(self, uri, buf, offset)

    monkeypatch.setattr(memory._Snapshot, "readinto", vanishing)
    with pytest.raises(NotFoundError, match="memory://bkt/gone.pt"):
        ckptio.load("memory://bkt/gone.pt")
    ckptio.remove("memory://bkt/gone.pt")


def test_remote_pt_with_a_read_head_that_never_tells_the_size(userdict, monkeypatch):
    state = {"w": torch.randn(1000)}
    ckptio.dump(state, userdict + "/quiet.pt")
    monkeypatch.setattr(UserDictBackend, "read_head", lambda self, uri, buf, on_size: self.readinto(uri, buf, 0))
    assert torch.equal(ckptio.load(userdict + "/quiet.pt")["w"], state["w"])


def test_torchs_process_wide_mmap_default_is_honoured(userdict):
    from torch.utils.serialization import config

    state = {"w": torch.randn(1000)}
    ckptio.dump(state, userdict + "/m.pt")
    ckptio.dump(state, "memory://bkt/m.pt")
    before = config.load.mmap
    config.load.mmap = True  # (monkeypatch's undo deletes the setting of torch's config module)
    try:
        assert torch.equal(ckptio.load(userdict + "/m.pt")["w"], state["w"])  # through a local file, mapped
        assert torch.equal(ckptio.load("memory://bkt/m.pt")["w"], state["w"])
    finally:
        config.load.mmap = before
    ckptio.remove("memory://bkt/m.pt")


@pytest.mark.parametrize("cut", [0, 1, 100])
def test_a_torn_pt_names_the_object(userdict, cut):
    ckptio.dump({"w": torch.randn(1000)}, userdict + "/t.pt")
    data, gen = UserDictBackend.store[userdict + "/t.pt"]
    UserDictBackend.store[userdict + "/t.pt"] = (data[:cut], gen)
    with pytest.raises(Exception) as ei:
        ckptio.load(userdict + "/t.pt")
    assert "userdict://bkt/t.pt" in str(ei.value) + "".join(getattr(ei.value, "__notes__", []))

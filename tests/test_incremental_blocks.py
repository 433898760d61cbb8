"""How large an incremental save's blocks are: up to 64 MiB where the content objects are plain local
files (a payload of up to 64 MiB is one file: the kernel reads small files back into small page-cache
folios, slower to copy out of), 16 MiB elsewhere and for bytes the writer copies (``pt``: at most
``concurrency`` copies in memory); a store saved with 16 MiB blocks goes on working after the change."""

from __future__ import annotations

import os

import pytest
import torch

import ckptio
from ckptio.checkpointer import Checkpointer
from ckptio.incremental import MAGIC, recipe, store

pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
    pytest.mark.filterwarnings("ignore::ckptio.checkpointer.CheckpointWarning"),
]
MiB = 1 << 20
BIG = 40 * MiB  # one payload, between the remote and the local largest block


def state(step: int) -> dict:
    g = torch.Generator().manual_seed(0)
    return {"big": torch.randn(BIG // 4, generator=g), "head": torch.full((64,), float(step)), "step": step}


def block_lengths(step_dir: str) -> list[int]:
    """The lengths of the blocks every recipe of the local step directory ``step_dir`` names."""
    out: list[int] = []
    for d, _, files in os.walk(step_dir):
        for f in files:
            with open(os.path.join(d, f), "rb") as fh:
                data = fh.read()
            if data.startswith(MAGIC):
                out += recipe.parse_recipe(data, f).lengths
    return out


def loads_back(ck: Checkpointer, step: int) -> None:
    got = {"big": torch.zeros(BIG // 4), "head": torch.zeros(64), "step": 0}
    assert ck.load(got, step=step) == step
    want = state(step)
    assert torch.equal(got["big"], want["big"]) and torch.equal(got["head"], want["head"])


@pytest.mark.parametrize("fmt", ["fpk", "dcp", "pt"])
def test_local_blocks_hold_a_lent_payload_whole_and_copied_ones_in_16_mib(fmt, tmp_path):
    root = str(tmp_path / "run")
    ck = Checkpointer(root, format=fmt, incremental=True)
    ck.save(1, state(1))
    lengths = block_lengths(ck.uri(1))
    if fmt == "pt":  # torch.save's bytes are copied into blocks: 16 MiB at most
        assert max(lengths) == store.COPIED_MAX_BLOCK, lengths
    else:  # fpk and dcp lend the tensors' memory: the 40 MiB payload is one block
        assert max(lengths) == BIG, lengths
    assert all(n <= store.LOCAL_MAX_BLOCK for n in lengths)
    loads_back(ck, 1)


@pytest.mark.parametrize("fmt", ["fpk", "dcp"])
def test_remote_blocks_stay_at_16_mib(fmt, memory_uri, tmp_path):
    ck = Checkpointer(memory_uri + "/run", format=fmt, incremental=True)
    ck.save(1, state(1))
    backend, content_dir = ckptio.resolve(memory_uri + "/run/.content")
    assert store.BlockStore(backend, content_dir).max_block == store.REMOTE_MAX_BLOCK == 16 * MiB
    assert ck.last_save is not None and ck.last_save.bytes_written >= BIG
    loads_back(ck, 1)
    # the memory backend's objects are not files: its blocks are at most 16 MiB
    sizes = [i.size for i in backend.list(content_dir, recursive=True) if not i.is_dir]
    assert sizes and max(sizes) == 16 * MiB


def test_a_store_saved_with_16_mib_blocks_upgrades_once(tmp_path, monkeypatch):
    root = str(tmp_path / "run")
    with monkeypatch.context() as m:  # an older ckptio: 16 MiB local blocks
        m.setattr(store, "LOCAL_MAX_BLOCK", 16 * MiB)
        old = Checkpointer(root, format="fpk", incremental=True, keep_last=2, content_grace=0)
        old.save(1, state(1))
        assert max(block_lengths(old.uri(1))) == 16 * MiB
    ck = Checkpointer(root, format="fpk", incremental=True, keep_last=2, content_grace=0)
    ck.save(2, state(2))  # the big payload is one block now: written once more
    assert max(block_lengths(ck.uri(2))) == BIG
    assert ck.last_save is not None and ck.last_save.bytes_written >= BIG
    loads_back(ck, 1)
    loads_back(ck, 2)
    ck.save(3, state(3))  # and then deduplicated as before; step 1 and its 16 MiB blocks go
    assert ck.last_save is not None and ck.last_save.bytes_written < MiB
    assert ck.list() == [2, 3]
    loads_back(ck, 2)
    loads_back(ck, 3)
    sizes = [os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(os.path.join(root, ".content")) for f in fs]
    assert BIG in sizes and 16 * MiB not in sizes  # the sweep removed what only step 1 used


def test_partial_reads_keep_at_most_64_mib_of_blocks(tmp_path):
    """A buffered reader's small reads of a step fetch each block whole and keep the last few: 64 MiB of
    them at most (four 16 MiB blocks, one 64 MiB one), so large local blocks do not raise that bound."""
    from ckptio.incremental.direct import reader_for

    g = torch.Generator().manual_seed(1)
    tensors = {f"t{i}": torch.randn(BIG // 4, generator=g) for i in range(3)}
    ck = Checkpointer(str(tmp_path / "run"), format="fpk", incremental=True)
    ck.save(1, tensors)
    step_dir = ck.uri(1)
    (path,) = [p for p in (os.path.join(step_dir, f) for f in os.listdir(step_dir)) if _is_recipe(p)]
    backend, uri = ckptio.resolve(path)
    r = reader_for(backend, step_dir)
    rec = r.recipe(uri)
    assert rec is not None
    big = [i for i, n in enumerate(rec.lengths) if n == BIG]
    assert len(big) == 3
    parts = {}
    for i in big:  # a few bytes from the middle of each 40 MiB block: each fetched whole
        at = rec.offsets[i] + BIG // 2
        parts[at] = r.read_range(uri, at, at + 8)
        kept = [len(f.result()) for f in r._blocks.values() if f.done()]
        assert sum(kept) <= 64 * MiB and len(kept) == 1, kept
    whole = r.read_range(uri)  # whole blocks, straight into the buffer
    assert all(whole[at : at + 8] == data for at, data in parts.items())
    assert all(torch.equal(ckptio.load(uri)[k], t) for k, t in tensors.items())


def _is_recipe(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(len(MAGIC)) == MAGIC


def test_a_dcp_load_reads_whole_local_blocks_into_the_tensors(tmp_path, monkeypatch):
    """DCP cuts a long range into the backend's part_size pieces: on a local incremental root those are
    whole 64 MiB blocks, each read straight into the tensor, none through a copy of its block."""
    from ckptio.incremental.backend import IncrementalBackend

    g = torch.Generator().manual_seed(2)
    tensors = {"a": torch.randn(80 * MiB // 4, generator=g), "b": torch.randn(BIG // 4, generator=g)}
    ck = Checkpointer(str(tmp_path / "run"), format="dcp", incremental=True)
    ck.save(1, {"model": tensors})
    parts = []
    real = IncrementalBackend._read_part
    monkeypatch.setattr(IncrementalBackend, "_read_part", lambda self, *a: parts.append(a[3]) or real(self, *a))
    got = {"model": {k: torch.zeros_like(t) for k, t in tensors.items()}}
    assert Checkpointer(str(tmp_path / "run"), format="dcp").load(got, step=1) == 1
    assert all(torch.equal(got["model"][k], t) for k, t in tensors.items())
    assert not [n for n in parts if n > MiB], parts  # no payload block went through _read_part

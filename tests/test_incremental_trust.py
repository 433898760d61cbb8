"""Edited incremental recipes (issue 34, defect 7): a block reference swapped for another stored block of the
same length must fail the load and ``ckptio verify``, not return the other tensor's bytes.

A block's hash proves its bytes are *some* stored block's; only the format's own checksums (fpk and DCP
payload xxh3, torch's zip CRC32) prove they are the *tensor's*, so those are kept over recipes."""

from __future__ import annotations

import json
import os

import pytest
import torch
import xxhash

import ckptio
from ckptio.checkpointer import Checkpointer
from ckptio.cli import main as cli_main
from ckptio.errors import IntegrityError
from ckptio.incremental import MAGIC

pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
    pytest.mark.filterwarnings("ignore::ckptio.checkpointer.CheckpointWarning"),
]


def make_state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"model": {f"w{i}": torch.randn(512, 512, generator=g) for i in range(4)}, "trainer": {"step": 1}}


def recipes(step_dir: str) -> list[str]:
    out = []
    for name in sorted(os.listdir(step_dir)):
        p = os.path.join(step_dir, name)
        if os.path.isfile(p):
            with open(p, "rb") as f:
                if f.read(len(MAGIC)) == MAGIC:
                    out.append(p)
    return out


def swap_one_block(step_dir: str) -> None:
    """In the step's recipes, replace one 1 MiB block's hash by another stored 1 MiB block's."""
    paths = recipes(step_dir)
    bodies = {p: json.loads(open(p, "rb").read()[len(MAGIC) :]) for p in paths}
    mib = sorted({h for b in bodies.values() for h, n in b["blocks"] if n == 1 << 20})
    assert len(mib) >= 2, bodies
    a, b = mib[0], mib[1]
    for p, body in bodies.items():
        hit = [i for i, (h, _) in enumerate(body["blocks"]) if h == a]
        if hit:
            body["blocks"][hit[0]][0] = b
            with open(p, "wb") as f:
                f.write(MAGIC + json.dumps(body, separators=(",", ":")).encode())
            return
    raise AssertionError("no recipe holds the block")


@pytest.mark.parametrize("fmt", ["fpk", "pt", "dcp"])
def test_a_swapped_block_fails_the_load_and_verify(fmt, tmp_path, capsys):
    root = str(tmp_path / "run")
    ck = Checkpointer(root, format=fmt, incremental=True)
    ck.save(1, make_state())
    swap_one_block(ck.uri(1))
    st: dict = {"model": {}, "trainer": {}}
    with pytest.raises(IntegrityError):
        ck.load(st, step=1, strict=False)
    target = ck.uri(1) if fmt == "dcp" else os.path.join(ck.uri(1), f"state.{fmt}")
    if fmt != "dcp":
        with pytest.raises(IntegrityError):
            ckptio.load(target)
    with pytest.raises(IntegrityError):
        ckptio.verify(target)
    assert cli_main(["verify", target]) == 1
    assert "ok" not in capsys.readouterr().out.split()


def test_a_swapped_block_fails_a_remote_pt_load(s3_uri):
    """The remote path (buffers fetched by ranged reads) checks the CRCs of an assembled archive too."""
    root = s3_uri + "/run"
    ck = Checkpointer(root, format="pt", incremental=True)
    ck.save(1, make_state())
    backend, step_dir = ckptio.resolve(ck.uri(1))
    data = step_dir + "/state.pt"
    body = json.loads(backend.read(data)[len(MAGIC) :])
    mib = [i for i, (_, n) in enumerate(body["blocks"]) if n == 1 << 20]
    body["blocks"][mib[0]][0] = body["blocks"][mib[1]][0]
    backend.write(data, MAGIC + json.dumps(body).encode())
    with pytest.raises(IntegrityError, match="CRC mismatch"):
        ck.load({"model": {}, "trainer": {}}, step=1, strict=False)


@pytest.mark.parametrize("fmt", ["fpk", "pt"])
def test_verify_of_a_recipe_with_shortened_lengths_is_a_clear_error(fmt, tmp_path, capsys):
    """Block lengths shortened (and the size with them, so the recipe parses): the file is cut short inside;
    verify and load fail with a ckptio error naming the file (exit 1), never a raw ValueError."""
    ck = Checkpointer(str(tmp_path / "run"), format=fmt, incremental=True)
    ck.save(1, make_state())
    target = os.path.join(ck.uri(1), f"state.{fmt}")
    body = json.loads(open(target, "rb").read()[len(MAGIC) :])
    cut = 0
    for b in body["blocks"]:
        if b[1] == 1 << 20:
            b[1] -= 4096
            cut += 4096
    body["size"] -= cut
    with open(target, "wb") as f:
        f.write(MAGIC + json.dumps(body).encode())
    for call in (ckptio.verify, ckptio.load):
        with pytest.raises(IntegrityError, match=f"state.{fmt}"):
            call(target)
    assert cli_main(["verify", target]) == 1
    err = capsys.readouterr().err
    assert f"state.{fmt}" in err and "ValueError" not in err


def test_a_swapped_block_fails_a_partial_pt_load(tmp_path):
    """A load of some parts (keys=) of an incremental pt reads only their records: those are checked too."""
    ck = Checkpointer(str(tmp_path / "run"), format="pt", incremental=True)
    ck.save(1, make_state())
    swap_one_block(ck.uri(1))
    with pytest.raises(IntegrityError, match="CRC mismatch"):
        ck.load({"model": {}}, step=1, keys=["model"], strict=False)


def test_a_verified_fpk_load_hashes_each_byte_once(tmp_path, monkeypatch):
    """Issue 35 goal 5: the payload checksums check every byte a verified fpk load returns, so its blocks are
    read without their own hashes (a swapped or damaged block still fails: the tests above, test_incremental);
    a load with verify=False keeps them."""
    from ckptio.incremental import store

    ck = Checkpointer(str(tmp_path / "run"), format="fpk", incremental=True)
    state = make_state()
    ck.save(1, state)
    target = os.path.join(ck.uri(1), "state.fpk")
    hashed: list[int] = []
    real = xxhash.xxh3_128

    class Counting:
        def __init__(self) -> None:
            self._h = real()

        def update(self, data) -> None:
            hashed.append(memoryview(data).nbytes)
            self._h.update(data)

        def hexdigest(self) -> str:
            return self._h.hexdigest()

    monkeypatch.setattr(store.xxhash, "xxh3_128", Counting)
    assert torch.equal(ckptio.load(target)["model"]["w0"], state["model"]["w0"])
    assert sum(hashed) < 64 << 10  # the header and metadata blocks only (read before the payloads)
    assert torch.equal(ckptio.load(target, verify=False)["model"]["w0"], state["model"]["w0"])
    assert sum(hashed) >= 4 << 20  # the tensors' blocks

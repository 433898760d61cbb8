"""A local tier serves one remote root (``checkpointer/binding.py``, ``tier.json``): a second run with another root
is refused before it reads or writes a step there (issue 33, defect 4), locally and with S3 (moto) roots; two
processes racing to bind one empty tier: exactly one wins."""

from __future__ import annotations

import json
import os
import pickle
import time

import pytest
import torch

import ckptio
from ckptio.checkpointer import Checkpointer, tiered
from ckptio.checkpointer.catalog import catalog
from ckptio.errors import FormatError, TierInUseError
from multiproc import run_ranks

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def state(step: int) -> dict:
    return {"model": {"w": torch.full((4, 4), float(step))}, "trainer": {"step": step}}


@pytest.mark.parametrize("backend", ["local", "s3"])
def test_a_second_run_is_refused_a_tier_that_serves_another_root(backend, request, tmp_path):
    """Run B (rootB) on run A's tier (rootA) used to resume from A's step, replicate A's steps into rootB and
    let its retention delete B's own step; now B is refused at the constructor, naming both roots."""
    base = request.getfixturevalue(f"{backend}_uri")
    root_a, root_b, tier = base + "/runA", base + "/runB", str(tmp_path / "nvme")
    with Checkpointer(root_a, format="fpk", local_tier=tier, keep_local=2) as a:
        for s in (1, 2):
            a.save(s, state(s))
        a.wait()
    with pytest.raises(FileExistsError) as e:
        Checkpointer(root_b, format="fpk", local_tier=tier, keep_last=1)
    assert isinstance(e.value, TierInUseError)
    msg = str(e.value)
    assert root_a in msg and root_b in msg and "local_tier=" in msg and os.path.join(tier, "tier.json") in msg
    assert str(pickle.loads(pickle.dumps(e.value))) == msg
    assert Checkpointer(root_b).list() == [] and Checkpointer(root_a).list() == [1, 2]
    with pytest.raises(TierInUseError):  # ckptio ls --steps rootB --local-tier T: not rootB's steps
        tiered.status(root_b, tier)
    ckptio.put_text("1\n", root_b + "/latest.txt")  # something for ckptio info to show
    with pytest.raises(TierInUseError):  # ckptio info rootB --local-tier T
        catalog(root_b, tier)
    assert [r["where"] for r in catalog(root_a, tier)["steps"]] == ["local+remote", "local+remote"]
    assert tiered.status(root_a, tier) == {1: "local+remote", 2: "local+remote"}
    with Checkpointer(root_a + "/", format="fpk", local_tier=tier) as again:  # same root: resumes
        st = state(0)
        assert again.resume(st) == 3 and st["trainer"] == {"step": 2}
    with open(os.path.join(tier, "tier.json")) as f:
        assert json.load(f)["root"] == root_a


def test_one_root_spelled_two_ways_shares_its_tier(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    os.symlink(tmp_path, tmp_path / "link")
    with Checkpointer("remote", format="pt", local_tier="tier") as ck:
        ck.save(1, state(1))
    with Checkpointer(str(tmp_path / "link" / "remote"), format="pt", local_tier=str(tmp_path / "tier")) as ck:
        assert ck.latest() == 1


def test_a_damaged_binding_is_reported_not_overwritten(tmp_path):
    tier = tmp_path / "tier"
    tier.mkdir()
    (tier / "tier.json").write_text("{not json")
    with pytest.raises(FormatError, match="tier.json: damaged"):
        Checkpointer(str(tmp_path / "remote"), format="pt", local_tier=str(tier))
    assert (tier / "tier.json").read_text() == "{not json"


def _bind(rank: int, world: int, port: int, base: str, tier: str, out: str) -> None:
    """Wait until every process is ready (a file each), then open the tier with this rank's root."""
    open(os.path.join(out, f"ready{rank}"), "w").close()
    deadline = time.monotonic() + 60
    while len([n for n in os.listdir(out) if n.startswith("ready")]) < world and time.monotonic() < deadline:
        time.sleep(0.001)
    try:
        Checkpointer(f"{base}/run{rank}", format="fpk", local_tier=tier).close()
        result = "won"
    except TierInUseError as e:
        result = f"refused: {e}"
    with open(os.path.join(out, f"rank{rank}.txt"), "w") as f:
        f.write(result)


def test_two_processes_racing_to_bind_an_empty_tier_one_wins(tmp_path):
    tier, out = str(tmp_path / "tier"), str(tmp_path / "out")
    os.mkdir(out)
    run_ranks(_bind, 2, str(tmp_path), tier, out, timeout=120)
    got = []
    for r in range(2):
        with open(os.path.join(out, f"rank{r}.txt")) as f:
            got.append(f.read())
    assert sorted(g.split(":")[0] for g in got) == ["refused", "won"], got
    winner = got.index("won")
    with open(os.path.join(tier, "tier.json")) as f:
        assert json.load(f)["root"] == f"{tmp_path}/run{winner}"
    assert f"{tmp_path}/run{winner}" in got[1 - winner]

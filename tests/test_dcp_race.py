"""Two processes saving to one DCP URI at once (plain ``ckptio.dcp.save`` and ``Checkpointer``), on
local disk, S3 and GCS. One commit wins; the other save raises AlreadyExistsError; the committed
checkpoint always loads exactly the winner's state and verifies; the loser leaves no data objects.

Each case runs one forced interleaving (both write their data, then both commit: the order that
let the loser's data replace the winner's) and a few free races started at a shared barrier. The
GCS emulator does not make create-only writes atomic, so there a free race may let both saves
return; the committed checkpoint must still be exactly one racer's state.

Two ``Checkpointer`` saves of one step have two windows more (documented in
``ckptio/checkpointer/core.py``): a save whose start falls between the other's DCP commit and its
marker discards that DCP checkpoint as a crashed save's debris and commits its own data under the
other's marker; one whose start falls between the other's marker and its ``latest.txt`` replaces
that committed step as any step that is not the latest, and both saves return. The committed step
is then exactly one racer's complete state (it loads and verifies; no foreign object is left), but
it may not be the state of the racer told "ok", or both are told "ok". Free Checkpointer races check
that guarantee; the forced order checks the winner's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch

import ckptio
import ckptio.dcp as cd
import dcp_workers as W
import zygote
from ckptio.checkpointer import MARKER_NAME, Checkpointer
from conftest import S3_TEST_OPTIONS

pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
    pytest.mark.filterwarnings("ignore::ckptio.checkpointer.CheckpointWarning"),
]
WORKER = os.path.join(os.path.dirname(__file__), "dcp_workers.py")
TIMEOUT = 180


def race(
    sync: str, uri: str, kind: str, roles: tuple[str, str], backends: dict | None, overwrite: bool = False
) -> dict[int, str]:
    """Run two racers (seeds 1 and 2) and return each one's outcome."""
    os.makedirs(sync)
    procs = []
    for seed, role in zip((1, 2), roles, strict=True):
        args = {"kind": kind, "uri": uri, "seed": seed, "role": role, "overwrite": overwrite, "backends": backends}
        procs.append(zygote.Child([sys.executable, WORKER, "race", sync, json.dumps(args)], stderr=subprocess.STDOUT))
    try:
        deadline = time.monotonic() + TIMEOUT
        while not all(os.path.exists(os.path.join(sync, f"ready-{s}")) for s in (1, 2)):
            assert all(p.poll() is None for p in procs), [p.communicate()[0][-3000:] for p in procs if p.poll()]
            assert time.monotonic() < deadline, "racers did not get ready"
            time.sleep(0.01)
        W._touch(os.path.join(sync, "go"))
        logs = [p.communicate(timeout=TIMEOUT)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert all(p.returncode == 0 for p in procs), [log[-3000:] for log in logs]
    out = {}
    for seed in (1, 2):
        with open(os.path.join(sync, f"result-{seed}")) as f:
            out[seed] = f.read()
    return out


def committed(uri: str, kind: str) -> tuple[dict, str]:
    """The committed state, loaded into fresh tensors, and the URI of its DCP checkpoint."""
    got = {k: torch.zeros_like(v) for k, v in W.big_state(0).items()}
    if kind == "checkpointer":
        assert Checkpointer(uri).load({"model": got}) == 1
        return got, f"{uri}/000000000001"
    cd.load(got, uri)
    return got, uri


def check_outcome(
    outcomes: dict[int, str], uri: str, kind: str, atomic_create: bool = True, winner_committed: bool = True
) -> None:
    """``atomic_create=False``: the store may let two create-only writes both succeed (the GCS emulator
    checks ``ifGenerationMatch`` before an upload, not atomically; GCS does), so both DCP commits
    may land, the later one replacing the earlier. What is committed must still be exactly one
    racer's state, never a mix of their bytes. ``winner_committed=False``: the committed state may be
    the loser's, or both told "ok" (the Checkpointer windows in the module docstring), still exactly
    one racer's."""
    winners = [s for s, o in outcomes.items() if o == "ok"]
    assert all(o == "ok" or o.startswith("AlreadyExistsError") for o in outcomes.values()), outcomes
    assert len(winners) == 1 or (winners and not (atomic_create and winner_committed)), outcomes
    got, ckpt = committed(uri, kind)
    exact = [
        s
        for s in (winners if atomic_create and winner_committed else outcomes)
        if all(torch.equal(got[k], v) for k, v in W.big_state(s).items())
    ]
    assert exact, f"the committed checkpoint is not exactly the state of a racer allowed here: {outcomes}"
    assert cd.verify(ckpt)["checked"] == len(got)
    if atomic_create:
        md = cd.loads_metadata(ckptio.get(f"{ckpt}/.metadata"))
        referenced = {s.relative_path for s in md.storage_data.values()}
        left = {u[len(ckpt) + 1 :] for u in ckptio.ls(ckpt, recursive=True)}
        extra = {MARKER_NAME} if kind == "checkpointer" else set()
        assert left == referenced | {".metadata"} | extra, "the losing save's data objects were not removed"


def run_trials(tmp_path, uri: str, kind: str, backends: dict | None, free: int, atomic_create: bool = True) -> None:
    trials = [("first", "second")] + [("free", "free")] * free
    for i, roles in enumerate(trials):
        target = f"{uri}/t{i}"
        outcomes = race(str(tmp_path / f"sync{i}"), target, kind, roles, backends)
        forced = roles[0] != "free"  # forced: commits in turn
        check_outcome(outcomes, target, kind, atomic_create or forced, forced or kind != "checkpointer")


@pytest.mark.parametrize("kind", ["dcp", "checkpointer"])
def test_concurrent_saves_local(tmp_path, kind):
    run_trials(tmp_path, str(tmp_path / "ckpt"), kind, None, free=3)


# the Checkpointer cells on S3 and GCS are slow (the same races as local's, about a minute each): dcp stays default
REMOTE_KINDS = ["dcp", pytest.param("checkpointer", marks=pytest.mark.slow)]


@pytest.mark.parametrize("kind", REMOTE_KINDS)
def test_concurrent_saves_s3(tmp_path, s3_uri, s3_endpoint, kind):
    run_trials(tmp_path, f"{s3_uri}/ckpt", kind, {"s3": {"endpoint_url": s3_endpoint, **S3_TEST_OPTIONS}}, free=1)


@pytest.mark.parametrize("kind", REMOTE_KINDS)
def test_concurrent_saves_gcs(tmp_path, gcs_uri, gcs_endpoint, kind):
    run_trials(
        tmp_path,
        f"{gcs_uri}/ckpt",
        kind,
        {"gcs": {"endpoint_url": gcs_endpoint, "anon": True, "project": "test"}},
        free=1,
        atomic_create=False,
    )


def test_concurrent_overwrites_local(tmp_path):
    """overwrite=True on both sides of a committed checkpoint: whatever commits last is complete and
    exact, and neither the replaced checkpoint's nor a losing save's data objects are left."""
    for i, roles in enumerate([("first", "second"), ("free", "free")]):
        uri = str(tmp_path / f"ckpt{i}")
        cd.save(W.big_state(0), uri)
        old = {s.relative_path for s in cd.loads_metadata(ckptio.get(f"{uri}/.metadata")).storage_data.values()}
        outcomes = race(str(tmp_path / f"sync{i}"), uri, "dcp", roles, None, overwrite=True)
        ok = [s for s, o in outcomes.items() if o == "ok"]
        assert ok and all(o == "ok" or o.startswith("AlreadyExistsError") for o in outcomes.values()), outcomes
        got, _ = committed(uri, "dcp")
        assert any(all(torch.equal(got[k], v) for k, v in W.big_state(s).items()) for s in ok), outcomes
        referenced = {s.relative_path for s in cd.loads_metadata(ckptio.get(f"{uri}/.metadata")).storage_data.values()}
        assert not old & referenced
        assert set(os.listdir(uri)) == referenced | {".metadata"}, "replaced or losing data objects were left"

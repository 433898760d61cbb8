"""Crash safety: a child process saving with ckptio.dcp is SIGKILLed at several points. The previous
checkpoint must stay loadable and the interrupted one must report incomplete, never half-committed."""

from __future__ import annotations

import os
import signal
import sys

import pytest
import torch

import ckptio.dcp as cd
import dcp_workers as W
import zygote

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
WORKER = os.path.join(os.path.dirname(__file__), "dcp_workers.py")


def crash(point: str, uri: str, overwrite: bool = False) -> None:
    args = [sys.executable, WORKER, "crash", point, uri] + (["overwrite"] if overwrite else [])
    proc = zygote.run(args, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]


def assert_loads(uri: str, seed: int) -> None:
    want = W.big_state(seed)
    out = {k: torch.zeros_like(v) for k, v in want.items()}
    cd.load(out, uri)
    assert all(torch.equal(out[k], want[k]) for k in want)


@pytest.fixture
def previous(tmp_path):
    uri = str(tmp_path / "step1")
    cd.save(W.big_state(1), uri)
    return uri


@pytest.mark.parametrize("point", ["data", "before_metadata"])
def test_killed_new_save_is_incomplete_and_previous_loads(tmp_path, previous, point):
    new = str(tmp_path / "step2")
    crash(point, new)
    assert not cd.is_complete(new)
    committed = sorted(n for n in os.listdir(new) if n.endswith(".distcp"))
    if point == "before_metadata":  # all data objects durable, only the commit marker missing
        assert [n.split(".")[0] for n in committed] == ["__0_0", "__0_1"]
    assert_loads(previous, 1)
    cd.save(W.big_state(2), new)  # an incomplete directory can be saved over without overwrite=True
    assert_loads(new, 2)


def test_killed_overwrite_during_data_is_incomplete(previous):
    crash("data", previous, overwrite=True)
    assert not cd.is_complete(previous)  # uncommitted before the first data byte: never old metadata + new data


def test_killed_overwrite_before_uncommit_keeps_old_checkpoint(previous):
    crash("before_uncommit", previous, overwrite=True)
    assert cd.is_complete(previous)
    assert_loads(previous, 1)

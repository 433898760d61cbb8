"""Soak (``-m slow``): 200 save/resume cycles against S3 behind the fault proxy, with random
injected faults and random SIGKILLs of the saving process.

Each cycle forks a trainer that resumes from the latest checkpoint, checks that it restored
exactly the state of that step, and saves the next step while the proxy injects random faults;
the parent SIGKILLs some trainers at random moments. Every resume must restore the last step
whose save returned, or the step in flight when the trainer died (its commit may have landed).
"""

from __future__ import annotations

import os
import random
import signal
import time

import pytest
import torch

import ckptio
from ckptio.checkpointer import Checkpointer
from faultproxy import FAST, Fault

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork"),
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
    pytest.mark.filterwarnings("ignore::ckptio.checkpointer.CheckpointWarning"),
    pytest.mark.timeout(3000),
]
CYCLES = int(os.environ.get("CKPTIO_SOAK_CYCLES", "200"))


def make_state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"model": {"w": torch.randn(128, 128, generator=g)}, "trainer": {"step": step}}


def _trainer(root: str, fmt: str, endpoint: str, out: int) -> None:
    """In the forked child: resume, report, save the next step, report. Never returns."""
    code = 1
    try:
        ckptio.reset()
        from conftest import S3_TEST_OPTIONS

        ckptio.configure(backends={"s3": {"endpoint_url": endpoint, **S3_TEST_OPTIONS, **FAST, "max_attempts": 8}})
        ck = Checkpointer(root, format=fmt, keep_last=3)
        state = {"model": {"w": torch.zeros(128, 128)}, "trainer": {"step": -1}}
        step = ck.load(state)
        step = 0 if step is None else step
        ok = step == 0 or (
            torch.equal(state["model"]["w"], make_state(step)["model"]["w"]) and state["trainer"] == {"step": step}
        )
        os.write(out, f"resumed {step} {int(ok)}\n".encode())
        ck.save(step + 1, make_state(step + 1))
        ck.close()
        os.write(out, f"committed {step + 1}\n".encode())
        code = 0
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        os.write(out, f"error {type(e).__name__}: {str(e)[:300]!r}\n".replace("\n", " ").encode() + b"\n")
    finally:
        os._exit(code)


@pytest.mark.parametrize("fmt", ["dcp"])
def test_soak_save_resume_with_faults_and_kills(s3_faults, fmt):
    rng = random.Random(1234)
    root = s3_faults.uri + "/soak"
    committed = 0  # the last step whose save returned
    in_flight = None
    kills = errors = 0
    for cycle in range(CYCLES):
        s3_faults.clear()
        s3_faults._rng.seed(cycle)
        for kind in rng.sample(["status", "reset", "truncate", "stall"], k=rng.randint(0, 2)):
            s3_faults.add(Fault(kind, status=rng.choice([500, 503]), fraction=rng.uniform(0.02, 0.1), stall=1.5))
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            _trainer(root, fmt, s3_faults.url, w)
        os.close(w)
        kill_after = rng.uniform(0.5, 4.0) if rng.random() < 0.3 else None
        t0 = time.monotonic()
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if kill_after is not None and time.monotonic() - t0 > kill_after:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                kills += 1
                break
            if time.monotonic() - t0 > 300:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                pytest.fail(f"cycle {cycle}: trainer hung for 300 s")
            time.sleep(0.01)
        lines = os.read(r, 65536).decode().splitlines()
        os.close(r)
        for line in lines:
            word, _, rest = line.partition(" ")
            if word == "resumed":
                step, ok = map(int, rest.split())
                allowed = {committed} | ({in_flight} if in_flight is not None else set())
                assert step in allowed, f"cycle {cycle}: resumed step {step}, expected one of {allowed}"
                assert ok, f"cycle {cycle}: step {step} did not restore exactly"
                committed, in_flight = step, step + 1
            elif word == "committed":
                committed, in_flight = int(rest), None
            elif word == "error":
                errors += 1  # a save that failed cleanly (faults beyond the retry budget): allowed
    s3_faults.clear()
    state = {"model": {"w": torch.zeros(128, 128)}, "trainer": {"step": -1}}
    step = Checkpointer(root, format=fmt).load(state)
    assert step in ({committed} | ({in_flight} if in_flight else set()))
    assert torch.equal(state["model"]["w"], make_state(step)["model"]["w"])
    assert kills >= CYCLES // 10 and committed > CYCLES // 3, (kills, errors, committed)

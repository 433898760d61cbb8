"""Soak (``-m slow``): 200 save/resume cycles against S3 behind the fault proxy (four loops of 50 at
once, each on its own root), with random injected faults and random SIGKILLs of the saving process.

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
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import ckptio
from ckptio.checkpointer import Checkpointer
from faultproxy import FAST, Fault, FaultProxy

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


LOOPS = 4  # concurrent soak loops (own root, own fault proxy): the cycles mostly wait on stalls and kills


def _soak(proxy, root: str, fmt: str, cycles: int, seed: int) -> tuple[int, int | None, int, int]:
    """``cycles`` fork/resume/save cycles against ``root`` through ``proxy``; returns (the last step whose
    save returned, the step in flight when the last trainer died, kills, clean errors)."""
    rng = random.Random(seed)
    committed = 0  # the last step whose save returned
    in_flight = None
    kills = errors = 0
    for cycle in range(cycles):
        proxy.clear()
        proxy._rng.seed(seed * 100_000 + cycle)
        for kind in rng.sample(["status", "reset", "truncate", "stall"], k=rng.randint(0, 2)):
            proxy.add(Fault(kind, status=rng.choice([500, 503]), fraction=rng.uniform(0.02, 0.1), stall=1.5))
        r, w = os.pipe()
        pid = os.fork()  # the other loop's thread holds no lock the trainer takes: it waits, sleeps or reads
        if pid == 0:
            os.close(r)
            _trainer(root, fmt, proxy.url, w)
        os.close(w)
        # within a typical cycle (resume + a few saves, 0.5-2 s): a kill planned after the trainer has ended
        # lands nowhere, so late ones would make the count depend on how fast the storage calls are
        kill_after = rng.uniform(0.2, 1.2) if rng.random() < 0.3 else None
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
                raise AssertionError(f"{root} cycle {cycle}: trainer hung for 300 s")
            time.sleep(0.01)
        lines = os.read(r, 65536).decode().splitlines()
        os.close(r)
        for line in lines:
            word, _, rest = line.partition(" ")
            if word == "resumed":
                step, ok = map(int, rest.split())
                allowed = {committed} | ({in_flight} if in_flight is not None else set())
                assert step in allowed, f"{root} cycle {cycle}: resumed step {step}, expected one of {allowed}"
                assert ok, f"{root} cycle {cycle}: step {step} did not restore exactly"
                committed, in_flight = step, step + 1
            elif word == "committed":
                committed, in_flight = int(rest), None
            elif word == "error":
                errors += 1  # a save that failed cleanly (faults beyond the retry budget): allowed
    proxy.clear()
    return committed, in_flight, kills, errors


@pytest.mark.parametrize("fmt", ["dcp"])
def test_soak_save_resume_with_faults_and_kills(s3_faults, fmt):
    """CYCLES cycles in all, split over LOOPS concurrent loops, each on its own root and fault proxy."""
    proxies = [s3_faults] + [FaultProxy(s3_faults.endpoint).start() for _ in range(LOOPS - 1)]
    roots = [f"{s3_faults.uri}/soak{i}" for i in range(LOOPS)]
    try:
        with ThreadPoolExecutor(LOOPS) as pool:
            futures = [
                pool.submit(_soak, proxy, root, fmt, CYCLES // LOOPS, 1234 + i)
                for i, (proxy, root) in enumerate(zip(proxies, roots, strict=True))
            ]
            outcomes = [f.result() for f in futures]
    finally:
        for proxy in proxies[1:]:
            proxy.stop()
    for root, (committed, in_flight, kills, errors) in zip(roots, outcomes, strict=True):
        state = {"model": {"w": torch.zeros(128, 128)}, "trainer": {"step": -1}}
        step = Checkpointer(root, format=fmt).load(state)
        assert step in ({committed} | ({in_flight} if in_flight else set()))
        assert torch.equal(state["model"]["w"], make_state(step)["model"]["w"])
        assert committed > CYCLES // LOOPS // 3, (root, kills, errors, committed)
    assert sum(o[2] for o in outcomes) >= CYCLES // 10, outcomes  # kills, over all loops

"""Training programs (issue 33): :mod:`.train` runs the README's Checkpointer loop under plain, DDP and FSDP2
(2 gloo ranks), for each format (dcp, fpk, pt) and mode (sync, async, tiered, incremental), on a local
root and on S3 (moto); the job is SIGKILLed at a seeded random point (the start of a step, or a storage
event of its save, persist or replication; printed with the seed: ``CKPTIO_PROGRAMS_SEED`` picks another),
restarted, finished, and its final state (full model and
optimizer state dicts, scheduler, scaler, every rank's RNG and data position) must equal an uninterrupted
run's bit for bit. An FSDP2 run saved on 2 ranks must load on 1 rank with the same full state.

Default suite: each parallelism x each format, sync, local, one kill, and the resharded loads; the rest of
the matrix is ``slow``. Ranks are forked by one launcher process per session (:mod:`.launcher`)."""

from __future__ import annotations

import os
import random
from typing import Any

import pytest
import torch

from conftest import S3_TEST_OPTIONS
from programs.conftest import Launcher, logs, outcome
from programs.train import WORLD
from servers import make_s3_bucket

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

SEED = int(os.environ.get("CKPTIO_PROGRAMS_SEED", "0"))
STEPS = 6
FORMATS = ["dcp", "fpk", "pt"]
MODES = ["sync", "async", "tiered", "incremental"]
STORAGES = ["local", "s3"]


def defect(parallel: str, fmt: str, mode: str, storage: str) -> str | None:
    """The Checkpointer defect that fails a cell, if any (the cell is ``xfail(strict=True)``)."""
    return None


def program(parallel: str, **job: Any) -> dict[str, Any]:
    """A job running :func:`programs.train.main` (see its keys there)."""
    defaults = {"action": "train", "kill_at": None, "tier": None, "backends": None, "steps": STEPS}
    return {"entry": "programs.train:main", "world": WORLD[parallel], "parallel": parallel, **defaults, **job}


def reference(launcher: Launcher, parallel: str, tmp_root: str) -> list[dict]:
    """The uninterrupted run (no Checkpointer), once per parallelism."""
    if parallel not in launcher.references:
        out = os.path.join(tmp_root, f"reference-{parallel}")
        job = program(parallel, format=None, mode="sync", root=None, out=out)
        launcher.references[parallel] = outcome(launcher.run(job), out)
    return launcher.references[parallel]


def _bytes(t: torch.Tensor) -> bytes:
    return t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()


def differences(a: Any, b: Any, path: str = "") -> list[str]:
    """Where ``a`` and ``b`` differ: tensors byte for byte (dtype and shape too), the rest by ``==``."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return [f"{path}: {type(a).__name__} vs {type(b).__name__}"]
        if a.dtype != b.dtype or a.shape != b.shape:
            return [f"{path}: {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"]
        same = _bytes(a) == _bytes(b)
        return [] if same else [f"{path}: tensors differ (max abs diff {(a.double() - b.double()).abs().max()})"]
    if isinstance(a, dict) and isinstance(b, dict):
        out = [f"{path}.{k}: only in one" for k in set(a) ^ set(b)]
        for k in a.keys() & b.keys():
            out += differences(a[k], b[k], f"{path}.{k}")
        return out
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        out = [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in differences(x, y, f"{path}[{i}]")]
        return out if len(out) <= 3 else [*out[:3], f"{path}: {len(out) - 3} more items differ"]
    return [] if a == b else [f"{path}: {a!r} vs {b!r}"]


def compare(got: list[dict], want: list[dict], what: str) -> None:
    diffs = []
    for r, (g, w) in enumerate(zip(got, want, strict=True)):
        for k in ("model", "optim", "sched", "scaler", "rng", "data", "trainer"):
            diffs += differences(g[k], w[k], f"rank{r}.{k}")
        if "losses" in g:  # the steps the resumed run ran: the first that diverged tells where
            diffs += [
                f"rank{r}: loss at step {s} differs" for s in sorted(g["losses"]) if g["losses"][s] != w["losses"][s]
            ]
    assert not diffs, f"{what}: not bitwise equal to the uninterrupted run:\n" + "\n".join(diffs[:30])


def root_for(storage: str, tmp_path, request) -> tuple[str, dict | None]:
    if storage == "local":
        return str(tmp_path / "run"), None
    endpoint = request.getfixturevalue("s3_endpoint")
    bucket = f"programs-{random.getrandbits(48):012x}"
    make_s3_bucket(endpoint, bucket)
    return f"s3://{bucket}/run", {"s3": {"endpoint_url": endpoint, **S3_TEST_OPTIONS}}


def kill_point(cell: str) -> tuple[int, int]:
    """(step in [1, STEPS), event in [0, 5)): 0 kills at the start of the step, n > 0 at the n-th storage
    event from its save on. Seeded by ``CKPTIO_PROGRAMS_SEED`` and the cell, so a failure reproduces."""
    rng = random.Random(f"{SEED}:{cell}")
    return rng.randrange(1, STEPS), rng.randrange(0, 5)


def _cells() -> list:
    out = []
    for storage in STORAGES:
        for mode in MODES:
            for parallel in WORLD:
                for fmt in FORMATS:
                    cell = (parallel, fmt, mode, storage)
                    marks = [] if (mode, storage) == ("sync", "local") else [pytest.mark.slow]
                    if reason := defect(*cell):
                        marks.append(pytest.mark.xfail(strict=True, reason=reason))
                    out.append(pytest.param(*cell, marks=marks, id="-".join(cell)))
    return out


@pytest.mark.parametrize("parallel, fmt, mode, storage", _cells())
def test_killed_run_resumes_bitwise(launcher, parallel, fmt, mode, storage, tmp_path, request):
    cell = "-".join((parallel, fmt, mode, storage))
    kill_at, event = kill_point(cell)
    where = (
        f"at storage event {event} from the save of step {kill_at} on" if event else f"at the start of step {kill_at}"
    )
    what = f"{cell}: SIGKILL {where} (CKPTIO_PROGRAMS_SEED={SEED})"
    print(what)
    want = reference(launcher, parallel, str(tmp_path.parent))
    root, backends = root_for(storage, tmp_path, request)
    job = program(parallel, format=fmt, mode=mode, root=root, tier=str(tmp_path / "tier"), backends=backends)
    killed = launcher.run({**job, "kill_at": kill_at, "kill_event": event, "out": str(tmp_path / "killed")})
    # a rank SIGKILLed itself (the others were ended, or failed on the lost peer first)
    self_killed = [r for r, c in enumerate(killed["codes"]) if c == -9 and r not in killed["ended"]]
    assert self_killed, f"{what}: {killed}\n{logs(str(tmp_path / 'killed'))}"
    got = outcome(launcher.run({**job, "out": str(tmp_path / "resumed")}), str(tmp_path / "resumed"))
    resumed_at = got[0]["resumed_at"]
    # a save that returned is committed (tiered: locally); async: the last one may still have been persisting;
    # killed in a save: the step before it, it, or (async, the event in the next save) the next
    lowest, highest = (kill_at - 1 if mode == "async" else kill_at), kill_at + (2 if event else 0)
    assert lowest <= resumed_at <= highest, f"{what}: resumed at step {resumed_at}"
    compare(got, want, what)


@pytest.mark.parametrize("fmt", FORMATS)
def test_fsdp2_run_saved_on_two_ranks_loads_on_one(launcher, fmt, tmp_path):
    want = reference(launcher, "fsdp", str(tmp_path.parent))
    root = str(tmp_path / "run")
    out = str(tmp_path / "fsdp")
    saved = outcome(launcher.run(program("fsdp", format=fmt, mode="sync", root=root, out=out)), out)
    compare(saved, want, f"fsdp-{fmt}, uninterrupted with a Checkpointer")
    out = str(tmp_path / "one")
    job = program("plain", format=fmt, mode="sync", root=root, action="load", out=out)
    [got] = outcome(launcher.run(job), out)
    assert got["loaded"] == STEPS - 1
    diffs = []
    for k in ("model", "optim", "sched", "scaler", "rng", "data", "trainer"):
        diffs += differences(got[k], want[0][k], k)  # rank 0's RNG and data position: the file's (pt/fpk)
    assert not diffs, f"fsdp-{fmt} loaded on 1 rank:\n" + "\n".join(diffs)

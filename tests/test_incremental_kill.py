"""Incremental checkpoints killed anywhere: a forked child saving steps 1..3 (``keep_last=2``, so step 3's
retention deletes step 1 and the sweep deletes the content only step 1 used) SIGKILLs itself at the N-th
storage call (:class:`test_checkpointer_crash.Events`: a block, recipe, marker or pointer written, a
step deleted, a content object swept), for N chosen from a dry run: every call that is not a data
chunk, thinned evenly to about 12, plus every marker, pointer, rmtree and delete. Afterwards every committed step
loads exactly, and the next save (``stale_after=0``, ``content_grace=0``) brings storage back to what
the kept steps need: no content object they do not reference, nothing outside committed steps, no
unfinished upload. Local disk and S3 (moto)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
import time
import traceback
import warnings
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import ckptio
from ckptio import uri as _uri
from ckptio.checkpointer import Checkpointer
from ckptio.checkpointer.content import Content
from ckptio.checkpointer.manifest import Layout
from ckptio.incremental import CONTENT_DIR
from test_checkpointer_crash import Events

pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
    pytest.mark.filterwarnings("ignore::ckptio.checkpointer.CheckpointWarning"),
    pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork"),
]
BATCH = 4
FROZEN = 3  # 1 MiB tensors, changed only at step 2 (frozen seed = step // 2)


def make_state(step: int) -> dict:
    g = torch.Generator().manual_seed(step // 2)
    model = {f"backbone.{i}": torch.randn(512, 512, generator=g) for i in range(FROZEN)}
    model["head"] = torch.full((16, 16), float(step))
    return {"model": model, "trainer": {"step": step}}


def checkpointer(root: str, fmt: str, **kw) -> Checkpointer:
    return Checkpointer(root, format=fmt, incremental=True, keep_last=2, content_grace=0, **kw)


def check(ck: Checkpointer, step: int) -> None:
    want = make_state(step)
    st = {"model": {k: torch.zeros_like(v) for k, v in want["model"].items()}, "trainer": {"step": -1}}
    assert ck.load(st, step=step) == step
    assert st["trainer"] == want["trainer"]
    for k, v in want["model"].items():
        assert torch.equal(st["model"][k], v), (step, k)


def child(root: str, fmt: str, kill_at: int, log: str) -> int:
    """Fork a child that saves steps 1..3 into ``root`` and kills itself at call ``kill_at``; its pid."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            warnings.simplefilter("ignore")
            backend, _ = ckptio.resolve(root)
            Events(type(backend), kill_at, log)
            ck = checkpointer(root, fmt)
            for step in range(1, 4):
                ck.save(step, make_state(step))
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    return pid


def wait(pid: int) -> int:
    return os.waitpid(pid, 0)[1]


def assert_clean(root: str) -> None:
    """Storage under ``root`` is exactly what its committed steps need."""
    layout = Layout(root)
    steps = {layout.name(s) for s in layout.list()}
    content = Content(layout, 0)
    referenced, complete = content.referenced()
    assert complete
    prefix = layout.root.rstrip("/") + "/"
    for info in layout.backend.list(layout.root, recursive=True):
        if info.is_dir:
            continue
        rel = info.uri[len(prefix) :]
        top = rel.split("/", 1)[0]
        if top == CONTENT_DIR:
            assert _uri.basename(rel) in referenced, f"unreferenced or stray content {rel}"
        else:
            assert rel == "latest.txt" or top in steps, f"{rel} is outside the committed steps {sorted(steps)}"
    assert not list(layout.backend.list_pending_writes(layout.root))
    have = {_uri.basename(i.uri) for i in layout.backend.list(_uri.join_path(layout.root, CONTENT_DIR), recursive=True)}
    assert referenced <= have, "a kept step references missing content"


def kill_points(events: list) -> list[int]:
    """Every call but data chunks, thinned to about 12, plus every marker, pointer, rmtree and delete."""
    calls = [n for n, kind, _ in events if kind != "chunk"]
    must = [
        n
        for n, kind, u in events
        if kind in ("rmtree", "delete") or u.endswith(("checkpoint.json", "latest.txt", ".metadata"))
    ]
    return sorted(set(calls[:: max(1, len(calls) // 12)] + must))


def recover(root: str, fmt: str) -> None:
    """After a kill: every committed step loads exactly; the next save leaves storage clean."""
    ck = checkpointer(root, fmt, stale_after=0)
    for step in ck.list():
        check(ck, step)
    nxt = (ck.list() or [0])[-1] + 1
    time.sleep(0.01)  # content written before now is past the grace period (0 s)
    ck.save(nxt, make_state(nxt))
    for step in ck.list():
        check(ck, step)
    assert_clean(root)


def run_kills(base: str, fmt: str, tmp_path) -> int:
    checkpointer(str(tmp_path / "warm"), fmt).save(1, make_state(1))  # imports done once, before the forks
    log = str(tmp_path / "events.jsonl")
    assert wait(child(_uri.join_path(base, "dry"), fmt, 0, log)) == 0
    events = [json.loads(line) for line in open(log)]
    assert {"rmtree", "delete"} <= {kind for _, kind, _ in events}, "the dry run must retire step 1 and sweep"
    points = kill_points(events)
    assert len(points) >= 20, points
    roots = {n: _uri.join_path(base, f"k{n}") for n in points}
    for i in range(0, len(points), BATCH):  # a batch of children at once: they mostly wait on storage
        batch = {n: child(roots[n], fmt, n, str(tmp_path / f"events{n}.jsonl")) for n in points[i : i + BATCH]}
        for n, pid in batch.items():
            status = wait(pid)
            assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, (n, status)
    with ThreadPoolExecutor(BATCH) as pool:  # independent roots: recovered side by side
        list(pool.map(lambda root: recover(root, fmt), roots.values()))
    return len(points)


@pytest.fixture
def fast_dir(tmp_path):
    """A directory in memory where there is one (fsync is not what these tests are about)."""
    if not os.path.isdir("/dev/shm"):
        yield str(tmp_path / "runs")
        return
    d = tempfile.mkdtemp(prefix="ckptio-kill-", dir="/dev/shm")
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.mark.parametrize("fmt", ["fpk", "dcp"])
def test_killed_anywhere_local(fmt, fast_dir, tmp_path):
    run_kills(fast_dir, fmt, tmp_path)


def test_killed_anywhere_s3(s3_uri, tmp_path):
    run_kills(s3_uri + "/runs", "fpk", tmp_path)

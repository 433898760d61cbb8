"""Crash safety: a forked child saving checkpoints SIGKILLs itself at the N-th storage event (a
chunk written, an object committed, an object or tree deleted), for many N: during data writes,
between data and marker, between marker and pointer, during cleanup. Afterwards the latest
checkpoint always loads complete and correct, no save that returned is lost, and a fresh
Checkpointer on the same root continues. What a killed save leaves that storage keeps (a local
temporary file of the pointer, an S3 multipart upload) is discarded by a later Checkpointer once
it is older than ``stale_after``, and nothing else is."""

from __future__ import annotations

import json
import os
import signal
import threading
import warnings

import pytest
import torch

import ckptio
from ckptio.checkpointer import Checkpointer
from multiproc import forked
from servers import s3_client

pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
    pytest.mark.filterwarnings("ignore::ckptio.checkpointer.CheckpointWarning"),
    pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork"),
]
STEPS = 4
KEEP = 2
CHILD_TIMEOUT = 60


def make_state(step: int) -> dict:
    model = torch.nn.Linear(64, 64)  # 16 KiB of weights
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float(step))
    return {"model": model, "optim": optim, "trainer": {"step": step}}


def check(state: dict, step: int) -> None:
    for k, v in state["model"].state_dict().items():
        assert torch.all(v == float(step)), (k, step)
    assert state["trainer"] == {"step": step}


class Events:
    """Counts storage events of a backend class (in the child only) and kills the process at ``kill_at``."""

    def __init__(self, cls: type, kill_at: int | tuple[str, str], log_path: str) -> None:
        self.n, self.kill_at, self.log = 0, kill_at, open(log_path, "w", buffering=1)
        self.lock = threading.Lock()
        events = self
        real_open, real_write, real_delete, real_rmtree = cls.open_writer, cls.write, cls.delete, cls.rmtree

        class W:
            def __init__(self, w):
                self._w = w

            def __getattr__(self, name):
                return getattr(self._w, name)

            def write(self, data):
                events.hit("chunk", self._w.uri)
                return self._w.write(data)

            def close(self):
                events.hit("commit", self._w.uri)
                return self._w.close()

            def __enter__(self):
                return self

            def __exit__(self, et, e, tb):
                self.close() if et is None else self._w.abort()

        def open_writer(self, uri, **kw):
            return W(real_open(self, uri, **kw))

        def write(self, uri, data, **kw):
            events.hit("put", uri)
            return real_write(self, uri, data, **kw)

        def delete(self, uri):
            events.hit("delete", uri)
            return real_delete(self, uri)

        def rmtree(self, uri):
            events.hit("rmtree", uri)
            return real_rmtree(self, uri)

        cls.open_writer, cls.write, cls.delete, cls.rmtree = open_writer, write, delete, rmtree

    def hit(self, kind: str, uri: str) -> None:
        with self.lock:  # DCP writes from several threads
            self.n += 1
            self.log.write(json.dumps([self.n, kind, uri]) + "\n")
            # kill_at: the event's number, or (kind, end of the URI) of the first such event
            if self.n == self.kill_at or (
                isinstance(self.kill_at, tuple) and self.kill_at[0] == kind and uri.endswith(self.kill_at[1])
            ):
                os.kill(os.getpid(), signal.SIGKILL)


def run_child(
    root: str, fmt: str, kill_at: int | tuple[str, str], tmp: str, async_save: bool, state=make_state
) -> list:
    """Fork; the child saves ``state(step)`` for steps 1..STEPS; returns (events logged, steps whose
    save returned, killed).

    The child inherits the parent's ckptio settings; its backend clients are recreated after the fork."""
    events_path, done_path = os.path.join(tmp, "events.jsonl"), os.path.join(tmp, "done.txt")
    for p in (events_path, done_path):
        if os.path.exists(p):
            os.remove(p)

    def body() -> None:
        warnings.simplefilter("ignore")
        backend, _ = ckptio.resolve(root)
        Events(type(backend), kill_at, events_path)
        ck = Checkpointer(root, format=fmt, keep_last=KEEP, async_save=async_save)
        with open(done_path, "w", buffering=1) as done:
            for step in range(1, STEPS + 1):
                ck.save(step, state(step))
                ck.wait()
                done.write(f"{step}\n")

    killed = forked(body, CHILD_TIMEOUT)
    events = [json.loads(line) for line in open(events_path)] if os.path.exists(events_path) else []
    done = [int(x) for x in open(done_path).read().split()] if os.path.exists(done_path) else []
    return events, done, killed


def kill_points(events: list) -> list[int]:
    """Every protocol boundary (commit, put, delete, rmtree) and a sample of mid-object writes."""
    boundaries = [n for n, kind, _ in events if kind != "chunk"]
    chunks = [n for n, kind, _ in events if kind == "chunk"]
    return sorted(set(boundaries + chunks[:: max(1, len(chunks) // 6)]))


def crash_and_recover(root: str, fmt: str, tmp: str, *, async_save: bool = False, limit: int | None = None) -> int:
    make_state(0)  # import what optimizers import lazily (torch._dynamo, seconds) once, before forking
    events, done, killed = run_child(root + "/dry", fmt, 0, tmp, async_save)
    assert not killed and done == list(range(1, STEPS + 1))
    kinds = {kind for _, kind, _ in events}
    assert {"commit", "delete"} <= kinds, kinds
    points = kill_points(events)
    if limit is not None and len(points) > limit:
        points = points[:: -(-len(points) // limit)]
    for i, n in enumerate(points):
        run_root = f"{root}/k{i}"
        _, done, killed = run_child(run_root, fmt, n, tmp, async_save)
        assert killed, f"kill point {n} was not reached"
        what = f"killed at event {n} ({events[n - 1][1]} {events[n - 1][2]})"
        last_done = done[-1] if done else 0
        st = make_state(-1)
        ck = Checkpointer(run_root, format=fmt, keep_last=KEEP)
        step = ck.load(st)
        if last_done == 0 and step is None:
            pass  # nothing was committed yet: nothing to restore, which load says without error
        else:
            assert step is not None and last_done <= step <= last_done + 1, (what, step, done)
            check(st, step)
            assert step in ck.list(), what
        # a fresh Checkpointer continues from there
        nxt = (step or 0) + 1
        for s in range(nxt, nxt + 2):
            ck.save(s, make_state(s))
        st = make_state(-1)
        assert Checkpointer(run_root).load(st) == nxt + 1, what
        check(st, nxt + 1)
        assert ck.list()[-KEEP:] == [nxt, nxt + 1], (what, ck.list())
    return len(points)


NO_FSYNC = {"local": {"durable": False}}  # fsync guards against power loss, not SIGKILL: skipped for speed


@pytest.mark.parametrize("fmt", ["pt", "fpk", "dcp"])
def test_sigkill_at_every_storage_event(fmt, tmp_path):
    ckptio.configure(backends=NO_FSYNC)
    n = crash_and_recover(str(tmp_path / "ck"), fmt, str(tmp_path))
    assert n >= 20


def test_sigkill_during_async_persist(tmp_path):
    ckptio.configure(backends=NO_FSYNC)
    crash_and_recover(str(tmp_path / "ck"), "pt", str(tmp_path), async_save=True, limit=12)


def test_sigkill_on_s3(s3_uri, tmp_path):
    crash_and_recover(s3_uri + "/ck", "pt", str(tmp_path), limit=4)


# ---- what killed saves leave behind -------------------------------------------------------------


def test_next_start_removes_the_pointer_temp_file_of_a_killed_save(tmp_path):
    ckptio.configure(backends=NO_FSYNC)
    root, ck_dir = str(tmp_path / "ck"), tmp_path / "ck"
    make_state(0)
    _, _, killed = run_child(root, "pt", ("chunk", "/latest.txt"), str(tmp_path), False)  # mid pointer write
    assert killed

    def temps() -> list[str]:
        return sorted(p.name for p in ck_dir.iterdir() if ".ckptio-tmp-" in p.name)

    assert len(temps()) == 1 and temps()[0].startswith(".latest.txt.ckptio-tmp-")
    Checkpointer(root, format="pt").save(5, make_state(5))
    assert len(temps()) == 1  # written moments ago: it could be a save running in another process
    ck = Checkpointer(root, format="pt", stale_after=0)
    ck.save(6, make_state(6))
    assert temps() == [] and ck.list() == [1, 5, 6] and ck.latest() == 6


def big_state(step: int) -> dict:
    """12 MiB: a multipart upload of 5 MiB parts. Built without a torch op: an OpenMP pool the parent
    used before the fork would hang the child's parallel fill."""
    return {"w": torch.frombuffer(bytearray(12 * 1024 * 1024), dtype=torch.float32)}


def test_next_start_aborts_the_multipart_upload_of_a_killed_save(s3_uri, s3_endpoint, tmp_path):
    ckptio.configure(backends={"s3": {"upload_part_size": "5MiB"}})
    root, bucket = s3_uri + "/ck", s3_uri.removeprefix("s3://")
    client = s3_client(s3_endpoint)

    def uploads() -> list[str]:
        return sorted(u["Key"] for u in client.list_multipart_uploads(Bucket=bucket).get("Uploads", []))

    _, _, killed = run_child(root, "pt", ("commit", "/state.pt"), str(tmp_path), False, state=big_state)
    assert killed
    killed_upload = uploads()
    assert len(killed_upload) == 1 and killed_upload[0].startswith("ck/0") and killed_upload[0].endswith("/state.pt")
    others = ["ck/notes/big.bin", "ck0/000000000001/state.pt", "other/big.bin"]  # not this Checkpointer's
    for key in others:
        client.create_multipart_upload(Bucket=bucket, Key=key)
    # moto dates every upload 2010-11-10: younger than a century, older than 0 seconds
    Checkpointer(root, format="pt", stale_after=100 * 365 * 86400.0).save(5, make_state(5))
    assert uploads() == sorted(killed_upload + others)
    Checkpointer(root, format="pt", stale_after=0).save(6, make_state(6))
    assert uploads() == others
    assert ckptio.load(root + "/000000000006/state.pt")["trainer"] == {"step": 6}

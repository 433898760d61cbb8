"""Tiered checkpoints (``local_tier=``): saves commit on a local tier and replicate to the remote root in the
background; status, wait, latest(durable=), keep_local, restore from the nearest verified copy,
re-replication after a restart, a remote outage, the backlog policy, two gloo ranks, and SIGKILL at
every storage event of saves, replication and eviction."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
import warnings
from datetime import timedelta

import pytest
import torch

import ckptio
from ckptio import cli
from ckptio.checkpointer import Checkpointer, CheckpointWarning, tiered
from ckptio.checkpointer.replication import BacklogError, ReplicationError
from multiproc import forked, record, results, run_ranks
from test_checkpointer_crash import CHILD_TIMEOUT, Events, kill_points

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def state(step: int) -> dict:
    return {"model": {"w": torch.full((64, 64), float(step)), "b": torch.arange(8.0) + step}, "trainer": {"step": step}}


def blank() -> dict:
    return {"model": {"w": torch.zeros(64, 64), "b": torch.zeros(8)}, "trainer": {"step": -1}}


def check(st: dict, step: int) -> None:
    assert torch.all(st["model"]["w"] == float(step)), step
    assert torch.equal(st["model"]["b"], torch.arange(8.0) + step), step
    assert st["trainer"] == {"step": step}


def loads(ck: Checkpointer, step) -> tuple[int | None, str | None]:
    st = blank()
    got = ck.load(st, step=step)
    check(st, got)
    return got, ck.last_load.uri


class Gate:
    """Holds every replication (``tiered.copy_objects``) until ``open()``."""

    def __init__(self, monkeypatch) -> None:
        self.event = threading.Event()
        real = tiered.copy_objects

        def gated(*a, **kw):
            assert self.event.wait(30), "gate never opened"
            return real(*a, **kw)

        monkeypatch.setattr(tiered, "copy_objects", gated)

    def open(self) -> None:
        self.event.set()


# ---- round trips ----------------------------------------------------------------------------------


@pytest.mark.parametrize("async_save", [False, True])
def test_round_trip_local_tier_and_s3(s3_uri, tmp_path, monkeypatch, async_save):
    root, local = s3_uri + "/run7", str(tmp_path / "nvme")
    gate = Gate(monkeypatch)
    ck = Checkpointer(root, format="fpk", local_tier=local, keep_local=2, async_save=async_save, max_pending=8)
    for s in (1, 2, 3):
        ck.save(s, state(s), metrics={"loss": 1.0 / s})
    ck._background.wait()  # async: the local commit is done
    assert ck.status() == {1: "replicating", 2: "replicating", 3: "replicating"}
    assert ck.latest(durable="local") == ck.latest() == 3 and ck.latest(durable="remote") is None
    assert Checkpointer(root).list() == []
    assert sorted(os.listdir(local)) == ["000000000001", "000000000002", "000000000003", "latest.txt", "tier.json"]
    gate.open()
    ck.wait()
    assert ck.status() == {1: "remote", 2: "local+remote", 3: "local+remote"}
    assert ck.latest(durable="remote") == 3 and ck.list() == [1, 2, 3]
    assert sorted(os.listdir(local)) == ["000000000002", "000000000003", "latest.txt", "tier.json"]
    remote = Checkpointer(root)
    assert remote.list() == [1, 2, 3] and remote.latest() == 3
    m = remote.manifest(3)
    assert m["sizes"] == ck._layout.manifest(3)["sizes"] and m["metrics"] == {"loss": 1.0 / 3}
    assert loads(remote, 1) == (1, root + "/000000000001")  # from the remote root alone
    assert loads(ck, "latest") == (3, local + "/000000000003")  # the local copy
    assert loads(ck, 1) == (1, root + "/000000000001")  # evicted locally: the remote one
    ck.close()


def test_dcp_single_process_and_cli_ls(tmp_path, capsys):
    root, local = str(tmp_path / "remote"), str(tmp_path / "local")
    with Checkpointer(root, format="dcp", local_tier=local, keep_local=1) as ck:
        for s in (1, 2):
            ck.save(s, state(s))
        ck.wait()
        assert ck.status() == {1: "remote", 2: "local+remote"}
        assert set(ck.manifest(2)["sizes"]) >= {".metadata"}
    assert loads(Checkpointer(root), 2) == (2, root + "/000000000002")
    assert cli.main(["ls", "--steps", "--local-tier", local, root]) == 0
    assert capsys.readouterr().out.split() == ["1", "remote", "2", "local+remote"]
    assert cli.main(["ls", "--json", "--steps", root]) == 0
    assert json.loads(capsys.readouterr().out) == [{"step": 1, "state": "remote"}, {"step": 2, "state": "remote"}]


def test_arguments_are_checked(tmp_path):
    r, loc = str(tmp_path / "r"), str(tmp_path / "l")
    for kw, what in (
        ({"keep_local": 0}, "keep_local"),
        ({"max_pending": 0}, "max_pending"),
        ({"on_backlog": "drop"}, "on_backlog"),
        ({"incremental": True, "format": "fpk"}, "incremental"),
        ({"incremental": True, "format": "dcp"}, "incremental"),
    ):
        with pytest.raises(ValueError, match=what):
            Checkpointer(r, local_tier=loc, **kw)
    ck = Checkpointer(r, local_tier=loc)
    with pytest.raises(ValueError, match="durable"):
        ck.latest(durable="disk")
    with pytest.raises(ValueError, match="local_tier"):
        Checkpointer(r).latest(durable="remote")
    ck.close()


def test_settings_checkpointer_table(s3_uri, tmp_path):
    from ckptio.errors import SettingsError

    toml = tmp_path / "ckptio.toml"
    toml.write_text(f'[checkpointer]\nlocal_tier = "{tmp_path / "tier"}"\nkeep_local = 1\non_backlog = "raise"\n')
    ckptio.configure(settings_file=str(toml))
    assert ckptio.settings()["checkpointer"]["keep_local"] == 1
    bucket = s3_uri.removeprefix("s3://")
    with Checkpointer(s3_uri + "/run7", format="pt") as ck:  # a remote root: tiered from the settings
        assert ck._tier is not None and ck._tier.keep_local == 1
        assert ck._tier.replicator.on_backlog == "raise"
        ck.save(1, state(1))
        ck.save(2, state(2))
        ck.wait()
        assert ck.status() == {1: "remote", 2: "local+remote"}
    assert sorted(os.listdir(tmp_path / "tier" / "s3" / bucket / "run7")) == ["000000000002", "latest.txt", "tier.json"]
    assert Checkpointer(str(tmp_path / "plain"))._tier is None  # a local root: no tier
    assert Checkpointer(s3_uri + "/x", local_tier=False)._tier is None
    assert Checkpointer(s3_uri + "/inc", format="dcp", incremental=True)._tier is None  # not combined yet
    toml.write_text('[checkpointer]\non_backlog = "drop"\n')
    with pytest.raises(SettingsError, match="checkpointer.on_backlog"):
        ckptio.configure(settings_file=str(toml))


# ---- keep_local, restore choice ------------------------------------------------------------------


def test_keep_local_never_evicts_an_unreplicated_step(tmp_path, monkeypatch):
    root, local = str(tmp_path / "remote"), str(tmp_path / "local")
    gate = Gate(monkeypatch)
    ck = Checkpointer(root, format="pt", local_tier=local, keep_local=1, max_pending=10)
    for s in range(1, 5):
        ck.save(s, state(s))
    assert ck.status() == {s: "replicating" for s in range(1, 5)}
    assert ck._layout.list() == [1, 2, 3, 4]  # none replicated: none evicted
    gate.open()
    ck.wait()
    assert ck._layout.list() == [4] and Checkpointer(root).list() == [1, 2, 3, 4]
    ck.close()


def test_a_load_holds_back_the_eviction_of_the_copy_it_reads(tmp_path, monkeypatch):
    from ckptio.checkpointer import formats

    root, local = str(tmp_path / "remote"), str(tmp_path / "local")
    gate = Gate(monkeypatch)
    ck = Checkpointer(root, format="pt", local_tier=local, keep_local=1)
    ck.save(1, state(1))
    ck.save(2, state(2))
    reading, resume, got = threading.Event(), threading.Event(), {}
    real = formats.read_file

    def held(*a, **kw):
        reading.set()
        assert resume.wait(30)
        return real(*a, **kw)

    monkeypatch.setattr(formats, "read_file", held)
    t = threading.Thread(target=lambda: got.update(r=loads(ck, 1)))
    t.start()
    assert reading.wait(30)  # step 1 chosen on this node and being read
    gate.open()
    ck.wait()  # both replicated; step 1 is past keep_local=1 but is being read
    assert ck._layout.list() == [1, 2]
    resume.set()
    t.join(30)
    assert got["r"] == (1, f"{local}/000000000001")
    assert ck._layout.list() == [2]  # evicted once the load finished
    ck.close()


def test_remote_retention_follows_keep_rules(tmp_path):
    root, local = str(tmp_path / "remote"), str(tmp_path / "local")
    with Checkpointer(root, format="pt", local_tier=local, keep_local=3, keep_last=2) as ck:
        for s in range(1, 5):
            ck.save(s, state(s))
            ck.wait()
        assert Checkpointer(root).list() == [3, 4]
        assert ck.status() == {2: "local", 3: "local+remote", 4: "local+remote"}  # the local tier keeps 3
        ck.save(5, state(5))
        ck.wait()  # step 2 was replicated (then deleted remotely by retention): evicted as any other
        assert ck.status() == {3: "local", 4: "local+remote", 5: "local+remote"}


def test_restore_prefers_a_verified_local_copy_and_falls_back_to_remote(tmp_path):
    root, local = str(tmp_path / "remote"), str(tmp_path / "local")
    ck = Checkpointer(root, format="fpk", local_tier=local, keep_local=3)
    for s in (1, 2, 3):
        ck.save(s, state(s))
    ck.wait()
    for s in (1, 2, 3):
        assert loads(ck, s)[1] == f"{local}/{s:012d}"
    data = tmp_path / "local" / "000000000001" / "state.fpk"
    with open(data, "ab") as f:  # a size the marker does not list
        f.write(b"x")
    shutil.rmtree(tmp_path / "local" / "000000000002")
    os.remove(tmp_path / "local" / "000000000003" / "state.fpk")
    with pytest.warns(CheckpointWarning, match="local copy not used"):
        assert loads(ck, 1) == (1, f"{root}/000000000001")
    assert loads(ck, 2) == (2, f"{root}/000000000002")  # not on this node: no warning needed
    with pytest.warns(CheckpointWarning, match="missing"):
        assert loads(ck, "latest") == (3, f"{root}/000000000003")
    ck.close()


def test_a_damaged_local_payload_is_read_from_the_remote_copy(tmp_path):
    from conftest import flip_byte

    root, local = str(tmp_path / "remote"), str(tmp_path / "local")
    with Checkpointer(root, format="fpk", local_tier=local) as ck:
        ck.save(1, state(1))
        ck.wait()
        path = str(tmp_path / "local" / "000000000001" / "state.fpk")
        flip_byte(path, 4096 + 10)  # inside the first payload: same size, bad checksum
        with pytest.warns(CheckpointWarning, match="cannot be read"):
            assert loads(ck, 1) == (1, f"{root}/000000000001")


# ---- restarts, outages, backlog -------------------------------------------------------------------


def test_a_step_never_replicated_is_replicated_on_the_next_start(tmp_path):
    root, local = str(tmp_path / "remote"), str(tmp_path / "local")
    plain = Checkpointer(local, format="pt")  # what a process killed before replication leaves
    plain.save(1, state(1))
    plain.save(2, state(2))
    assert tiered.status(root, local) == {1: "local", 2: "local"}
    ck = Checkpointer(root, format="pt", local_tier=local, keep_local=1)
    ck.wait()
    assert ck.status() == {1: "remote", 2: "local+remote"}
    assert loads(Checkpointer(root), "latest") == (2, f"{root}/000000000002")
    assert Checkpointer(root).manifest(2)["sizes"] == {"state.pt": os.path.getsize(f"{local}/000000000002/state.pt")}
    ck.close()


def test_remote_outage_warns_training_goes_on_and_later_succeeds(s3_faults, tmp_path):
    from faultproxy import Fault

    root, local = s3_faults.uri + "/run", str(tmp_path / "local")
    for method in ("PUT", "POST"):
        s3_faults.add(Fault("status", status=503, method=method, fraction=1.0))
    ck = Checkpointer(root, format="pt", local_tier=local, keep_local=1, max_pending=8)
    ck._tier.replicator.retry_after = 0.2
    with pytest.warns(CheckpointWarning, match="replication to .* failed"):
        ck.save(1, state(1))
        with pytest.raises(ReplicationError, match="retried"):
            ck.wait()
        ck.save(2, state(2))  # training goes on
    assert ck.status() == {1: "replicating", 2: "replicating"}
    assert Checkpointer(root).list() == []  # nothing partial committed
    s3_faults.clear()
    ck.wait()
    assert ck.status() == {1: "remote", 2: "local+remote"}
    assert loads(Checkpointer(root), 1) == (1, root + "/000000000001")
    ck.close()


def test_after_close_a_save_is_refused_and_nothing_waits_forever(tmp_path, monkeypatch):
    """close() stops the replicator: a later save is refused before it writes (it would never be
    replicated), and wait()/close() with steps left unreplicated (the first close raised their failure)
    raise at once instead of waiting for a thread that is gone; loads and listing still work, and the
    next Checkpointer on the root replicates what is left."""
    from ckptio.errors import CkptioError

    root, local = str(tmp_path / "remote"), str(tmp_path / "tier")
    ck = Checkpointer(root, format="pt", local_tier=local, max_pending=8)
    ck.save(1, state(1))
    ck.close()
    with pytest.raises(CkptioError, match="was closed.*make a new Checkpointer"):
        ck.save(2, state(2))
    assert ck.list() == [1] and loads(ck, 1)[0] == 1
    ck.close()  # again: nothing pending, returns

    def refuse(*a, **kw):
        raise OSError("remote refused")

    monkeypatch.setattr(tiered, "copy_objects", refuse)
    ck = Checkpointer(root, format="pt", local_tier=local, max_pending=8)
    ck._tier.replicator.retry_after = 60
    with pytest.warns(CheckpointWarning, match="replication to .* failed"):
        ck.save(3, state(3))
        with pytest.raises(ReplicationError, match="closing: the next one on this root replicates them"):
            ck.close()
    for call in (ck.wait, ck.close):
        t0 = time.monotonic()
        with pytest.raises(ReplicationError, match=r"stopped by close\(\); steps \[3\].*next Checkpointer"):
            call()
        assert time.monotonic() - t0 < 5
    monkeypatch.undo()
    again = Checkpointer(root, format="pt", local_tier=local)
    again.wait()
    assert Checkpointer(root).list() == [1, 3]
    again.close()


def test_backlog_raise_and_block(tmp_path, monkeypatch):
    root = str(tmp_path / "remote")
    gate = Gate(monkeypatch)
    ck = Checkpointer(root, format="pt", local_tier=str(tmp_path / "a"), max_pending=2, on_backlog="raise")
    ck.save(1, state(1))
    ck.save(2, state(2))
    with pytest.raises(BacklogError, match="2 step"):
        ck.save(3, state(3))
    blocking = Checkpointer(root + "2", format="pt", local_tier=str(tmp_path / "b"), max_pending=1)
    blocking.save(1, state(1))
    done = threading.Event()
    t = threading.Thread(target=lambda: (blocking.save(2, state(2)), done.set()))
    t.start()
    assert not done.wait(0.5)  # blocked behind step 1
    gate.open()
    assert done.wait(20)
    t.join()
    for c in (ck, blocking):
        c.wait()
    assert Checkpointer(root).list() == [1, 2] and Checkpointer(root + "2").list() == [1, 2]
    ck.close()
    blocking.close()


def test_delete_unschedules_and_an_idle_replicator_restarts(tmp_path, monkeypatch):
    from ckptio.checkpointer import replication

    monkeypatch.setattr(replication, "IDLE_EXIT", 0.2)
    root = str(tmp_path / "remote")
    gate = Gate(monkeypatch)
    ck = Checkpointer(root, format="pt", local_tier=str(tmp_path / "local"), max_pending=8)
    ck.save(1, state(1))
    ck.save(2, state(2))
    ck.delete(2)  # queued behind step 1 (held by the gate): unscheduled and deleted
    assert 2 not in ck._tier.replicator.pending()
    gate.open()
    ck.wait()
    assert ck.status() == {1: "local+remote"}
    time.sleep(0.6)
    assert ck._tier.replicator._thread is None  # idle: gone
    ck.save(3, state(3))
    ck.wait()
    assert ck.status() == {1: "local+remote", 3: "local+remote"}
    ck.close()


# ---- two gloo ranks --------------------------------------------------------------------------------


def _rank(rank: int, world: int, port: int, root: str, local: str, out_dir: str) -> None:
    record(out_dir, rank, _ranks_body, rank, world, port, root, local)


def _ranks_body(rank: int, world: int, port: int, root: str, local: str) -> None:
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    ck = Checkpointer(root, format="pt", local_tier=local, keep_local=1, timeout=60)
    for s in (1, 2, 3):
        ck.save(s, state(s))
    ck.wait()
    assert ck.status() == {1: "remote", 2: "remote", 3: "local+remote"}, ck.status()
    assert ck.latest(durable="remote") == 3
    st = blank()
    assert ck.load(st) == 3 and ck.last_load.uri == f"{local}/000000000003"
    check(st, 3)
    st = blank()
    assert ck.load(st, step=1) == 1 and ck.last_load.uri == f"{root}/000000000001"
    check(st, 1)
    ck.close()
    _dcp_on_two_nodes(rank, root + "-dcp", f"{local}-node{rank}")
    dist.barrier()
    dist.destroy_process_group()


def _dcp_on_two_nodes(rank: int, root: str, local: str) -> None:
    """DCP, each rank with its own local tier (as on two nodes): each replicates its own files, rank 0
    commits once both ranks' files are remote; a load reads the remote copy (no node has every file)."""
    ck = Checkpointer(root, format="dcp", local_tier=local, keep_local=1, timeout=60)
    for s in (1, 2, 3):
        ck.save(s, {"model": {"w": torch.full((32, 32), float(s * 10 + rank))}, "trainer": {"step": s}})
    ck.wait()
    assert ck.status() == {1: "remote", 2: "remote", 3: "local+remote"}, ck.status()
    sizes = Checkpointer(root).manifest(3)["sizes"]
    assert {n.split("_")[2] for n in sizes if n.startswith("__")} == {"0", "1"}, sizes
    st = {"model": {"w": torch.zeros(32, 32)}, "trainer": {"step": -1}}
    assert ck.load(st) == 3 and ck.last_load.uri == f"{root}/000000000003", ck.last_load
    assert st["trainer"] == {"step": 3} and torch.all(st["model"]["w"] == 30.0)  # replicated: saved once
    ck.close()
    here = sorted(n for n in os.listdir(local) if n.isdigit())
    assert here == ["000000000003"], here  # the older steps left this node once committed remotely


def test_two_gloo_ranks(tmp_path):
    root, local = str(tmp_path / "remote"), str(tmp_path / "local")
    run_ranks(_rank, 2, root, local, str(tmp_path))
    assert results(str(tmp_path), 2) == ["ok", "ok"]
    assert Checkpointer(root).list() == [1, 2, 3] and Checkpointer(root + "-dcp").list() == [1, 2, 3]


# ---- SIGKILL across local commit, replication and eviction ------------------------------------------

STEPS = 3


def _child(root: str, local: str, kill_at: int, tmp: str, async_save: bool) -> tuple[list, list, list, bool]:
    """Fork; the child saves steps 1..STEPS on a tiered Checkpointer (waiting for replication after each,
    so every storage event has a fixed number) and logs ``status()`` after each save and wait; it SIGKILLs
    itself at event ``kill_at``. Returns (events, steps whose save returned, statuses reported, killed)."""
    paths = {k: os.path.join(tmp, f"{k}.jsonl") for k in ("events", "done", "reports")}
    for p in paths.values():
        if os.path.exists(p):
            os.remove(p)

    def body() -> None:
        warnings.simplefilter("ignore")
        backend, _ = ckptio.resolve(local)
        Events(type(backend), kill_at, paths["events"])
        ck = Checkpointer(root, format="pt", local_tier=local, keep_local=1, async_save=async_save)
        with open(paths["done"], "w", buffering=1) as done, open(paths["reports"], "w", buffering=1) as rep:
            for step in range(1, STEPS + 1):
                ck.save(step, state(step))
                ck._background.wait()
                done.write(f"{step}\n")
                rep.write(json.dumps(ck.status()) + "\n")
                ck.wait()
                rep.write(json.dumps(ck.status()) + "\n")

    killed = forked(body, CHILD_TIMEOUT)

    def lines(k: str) -> list:
        return [json.loads(x) for x in open(paths[k])] if os.path.exists(paths[k]) else []

    return lines("events"), lines("done"), lines("reports"), killed


def _after_kill(root: str, local: str, done: list, reports: list, what: str) -> None:
    remote_said = {int(s) for r in reports for s, st in r.items() if "remote" in st}
    local_said = {int(s) for r in reports for s, st in r.items() if "local" in st or st == "replicating"}
    plain, on_node = Checkpointer(root), Checkpointer(local)
    for s in sorted(remote_said):  # reported remote: loads from the remote root alone
        assert loads(plain, s)[0] == s, (what, s)
    for s in sorted(local_said | set(done)):  # reported local: loads from this node's tier alone, or was
        assert loads(on_node if s in on_node.list() else plain, s)[0] == s, (what, s)  # replicated, then evicted
    ck = Checkpointer(root, format="pt", local_tier=local, keep_local=1)
    for s in sorted(local_said | set(done)):  # reported anywhere, or its save returned: loads on this node
        assert loads(ck, s)[0] == s, (what, s)
    ck.wait()  # the next start replicates what the killed process did not
    assert all(st != "local" and st != "replicating" for st in ck.status().values()), (what, ck.status())
    for s in ck.status():
        assert loads(plain, s)[0] == s, (what, s)
    newest = max(local_said | set(done) | remote_said, default=None)
    if newest is not None:
        assert ck.latest(durable="remote") >= newest, what
    ck.save(10, state(10))  # and continues
    ck.wait()
    assert loads(Checkpointer(root), "latest")[0] == 10, what
    ck.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
@pytest.mark.filterwarnings("ignore::ckptio.checkpointer.CheckpointWarning")
@pytest.mark.parametrize("async_save", [False, True])
def test_sigkill_across_commit_replication_and_eviction(tmp_path, async_save):
    ckptio.configure(backends={"local": {"durable": False}})
    state(0)
    tmp = str(tmp_path)
    events, done, _, killed = _child(f"{tmp}/dry/r", f"{tmp}/dry/l", 0, tmp, async_save)
    assert not killed and done == [1, 2, 3]
    uris = [u for _, _, u in events]
    assert any("/dry/r/" in u for u in uris) and any("/dry/l/" in u for u in uris)
    assert any(kind in ("delete", "rmtree") and "/dry/l/" in u for _, kind, u in events)  # eviction
    points = kill_points(events)
    phase = {n: "r" if "/dry/r/" in u else "evict" if k in ("delete", "rmtree") else "l" for n, k, u in events}
    if async_save:  # a sample, and the first eviction
        points = sorted({*points[:: max(1, len(points) // 8)], min(n for n in points if phase[n] == "evict")})
    per_phase = {p: sum(phase[n] == p for n in points) for p in ("l", "r", "evict")}
    assert all(per_phase.values()) and (async_save or min(per_phase.values()) >= 4), per_phase
    for i, n in enumerate(points):
        root, local = f"{tmp}/k{i}/r", f"{tmp}/k{i}/l"
        _, done, reports, killed = _child(root, local, n, tmp, async_save)
        assert killed, f"kill point {n} not reached"
        _after_kill(root, local, done, reports, f"killed at event {n} ({events[n - 1][1]} {events[n - 1][2]})")
    assert len(points) >= (8 if async_save else 20), len(points)

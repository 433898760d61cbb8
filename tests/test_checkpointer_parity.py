"""Parity with the seeds' checkpointers (issue 33): init from a checkpoint (load_model, FSDP2 on 2 gloo ranks),
is_complete for any URI, resuming from a DINOv3 or Cosmos layout in the Checkpointer's root (local and S3),
and one read of the latest pointer per job under a process group (GETs counted by a proxy)."""

from __future__ import annotations

import io
import os
import warnings
import zipfile
from datetime import timedelta

import pytest
import torch

import ckptio
from ckptio.checkpointer import Checkpointer, CheckpointWarning, is_complete, load_model
from ckptio.checkpointer.seeds import KEYS, find
from ckptio.errors import IncompleteCheckpointError
from multiproc import forked, record, results, run_ranks
from test_seeds import assert_same_tree, cosmos_save, dino_keep, dino_save, same_weights, trained

pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
    pytest.mark.filterwarnings("ignore:.*single process:UserWarning"),
    pytest.mark.filterwarnings("ignore:.*torch.distributed.*not initialized:UserWarning"),
]


def _net(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def _files(root: str) -> dict[str, bytes]:
    out = {}
    for d, _, names in os.walk(root):
        for n in names:
            p = os.path.join(d, n)
            with open(p, "rb") as f:
                out[os.path.relpath(p, root)] = f.read()
    return out


# ---- is_complete ---------------------------------------------------------------------------------------
def test_is_complete_for_steps_dcp_dirs_files_and_roots(tmp_path):
    root = str(tmp_path / "run")
    for fmt in ("dcp", "pt", "fpk"):
        ck = Checkpointer(f"{root}-{fmt}", format=fmt)
        ck.save(5, {"model": _net(0)})
        assert is_complete(ck.uri(5)) and is_complete(f"{root}-{fmt}")
        if fmt != "dcp":
            data = f"{ck.uri(5)}/state.{fmt}"
            assert is_complete(data)
            whole = ckptio.get(data)
            ckptio.put(whole[: len(whole) // 2], data)  # torn (copied short): neither the file nor the step
            assert not is_complete(data) and not is_complete(ck.uri(5))
    ck = Checkpointer(f"{root}-dcp", format="dcp")
    os.remove(os.path.join(ck.uri(5), "checkpoint.json"))  # the marker not written yet
    assert not is_complete(ck.uri(5))
    assert is_complete(ck.uri(5)) is False and not is_complete(f"{root}-dcp")  # a root with no complete step

    ckptio.dcp.save({"w": torch.ones(2)}, str(tmp_path / "bare"))
    assert is_complete(str(tmp_path / "bare"))
    os.remove(tmp_path / "bare" / ".metadata")  # DCP writes it last
    assert not is_complete(str(tmp_path / "bare"))

    torch.save(_net(0).state_dict(), tmp_path / "w.pth")
    assert is_complete(str(tmp_path / "w.pth"))
    assert not is_complete(str(tmp_path / "missing.pt")) and not is_complete(str(tmp_path / "missing"))
    (tmp_path / "notes.txt").write_text("x")
    assert not is_complete(str(tmp_path / "notes.txt"))

    m, o, _, _ = trained(0)
    dino_save(str(tmp_path / "dino"), 99, m, o)
    assert is_complete(str(tmp_path / "dino")) and is_complete(str(tmp_path / "dino" / "99"))
    cosmos_save(str(tmp_path / "cosmos"), 10, keys=("model",))  # pointer written, the other keys never came
    assert not is_complete(str(tmp_path / "cosmos"))


def test_is_complete_on_s3(s3_uri):
    ck = Checkpointer(f"{s3_uri}/run", format="pt")
    assert not is_complete(f"{s3_uri}/run")
    ck.save(1, {"model": _net(0)})
    assert is_complete(f"{s3_uri}/run") and is_complete(ck.uri(1)) and is_complete(f"{ck.uri(1)}/state.pt")
    ckptio.remove(f"{ck.uri(1)}/state.pt")  # the marker names a file that is gone
    assert not is_complete(ck.uri(1))
    cosmos_save(f"{s3_uri}/checkpoints", 10)
    assert is_complete(f"{s3_uri}/checkpoints") and is_complete(f"{s3_uri}/checkpoints/iter_000000010_model.pt")


# ---- load_model: init from a checkpoint ---------------------------------------------------------------
def test_load_model_from_any_uri_reads_the_model_only(tmp_path, s3_uri):
    src, optim, _, _ = trained(3)
    state = {"model": src, "optim": optim}
    ck = Checkpointer(f"{s3_uri}/run", format="pt")
    ck.save(7, state)
    Checkpointer(str(tmp_path / "dcp"), format="dcp").save(8, state)
    ckptio.dcp.save({"model": src.state_dict()}, str(tmp_path / "bare"))
    torch.save({"teacher": src.state_dict()}, tmp_path / "teacher_checkpoint.pth")
    torch.save(src.state_dict(), tmp_path / "plain.pt")
    ckptio.dump({"model": src.state_dict()}, str(tmp_path / "m.fpk"))
    dino = str(tmp_path / "dino" / "ckpt")
    dino_save(dino, 199, src, optim)

    cases = [
        (f"{s3_uri}/run", {}, 7),  # a root: its latest step
        (ck.uri(7), {}, 7),
        (str(tmp_path / "dcp"), {}, 8),
        (str(tmp_path / "bare"), {}, 0),
        (str(tmp_path / "teacher_checkpoint.pth"), {"key": "teacher"}, 0),
        (str(tmp_path / "plain.pt"), {"key": None}, 0),
        (str(tmp_path / "m.fpk"), {}, 0),
        (str(tmp_path / "dino"), {}, 199),  # DINOv3's output_dir
    ]
    for uri, kw, step in cases:
        fresh = _net(11)
        assert load_model(fresh, uri, **kw) == step, uri
        assert same_weights(fresh, src), uri
    with pytest.raises(KeyError, match="unexpected keys"):
        load_model(_net(1), str(tmp_path / "teacher_checkpoint.pth"), key=None)
    with pytest.raises(KeyError, match="model"):
        load_model(torch.nn.Linear(4, 2), str(tmp_path / "plain.pt"), key=None)
    with pytest.raises(IncompleteCheckpointError, match="not a complete checkpoint"):
        load_model(_net(1), str(tmp_path / "nothing"))


def test_load_model_writes_nothing_even_with_a_default_local_tier(s3_uri, tmp_path):
    src = _net(3)
    Checkpointer(f"{s3_uri}/run", format="pt", local_tier=False).save(2, {"model": src})
    toml = tmp_path / "ckptio.toml"
    toml.write_text(f'[checkpointer]\nlocal_tier = "{tmp_path / "tier"}"\n')
    ckptio.configure(settings_file=str(toml))  # remote roots get a node-local tier by default
    fresh = _net(4)
    assert load_model(fresh, f"{s3_uri}/run") == 2 and same_weights(fresh, src)
    assert not (tmp_path / "tier").exists()  # no tier directory, no tier.json: an init reads only


def _fsdp2_worker(rank: int, world: int, port: int, root: str, out: str) -> None:
    record(out, rank, _fsdp2_body, rank, world, port, root)


def _fsdp2_body(rank: int, world: int, port: int, root: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    expected = _net(3).state_dict()
    for uri in (f"{root}/dcp", f"{root}/pt", f"{root}/plain.pt", f"{root}/dino"):
        model = _net(rank + 20)
        mesh = init_device_mesh("cpu", (world,))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        load_model(model, uri, key=None if uri.endswith(".pt") else "model", timeout=60)
        for k, v in model.state_dict().items():
            assert isinstance(v, DTensor), k
            assert torch.equal(v.full_tensor(), expected[k]), (uri, k)
    dist.barrier()
    dist.destroy_process_group()


def test_load_model_into_an_fsdp2_model_on_two_ranks(tmp_path):
    src = _net(3)
    optim = torch.optim.AdamW(src.parameters())
    for fmt in ("dcp", "pt"):
        Checkpointer(str(tmp_path / fmt), format=fmt).save(4, {"model": src, "optim": optim})
    torch.save(src.state_dict(), tmp_path / "plain.pt")
    dino_save(str(tmp_path / "dino" / "ckpt"), 99, src, optim)  # DINOv3's output_dir
    out = str(tmp_path / "out")
    os.makedirs(out)
    run_ranks(_fsdp2_worker, 2, str(tmp_path), out)
    assert results(out, 2) == ["ok", "ok"]


# ---- one read of the latest pointer per job ----------------------------------------------------------
def _pointer_worker(rank: int, world: int, port: int, root: str, backends: dict, out: str) -> None:
    record(out, rank, _pointer_body, rank, world, port, root, backends)


def _pointer_body(rank: int, world: int, port: int, root: str, backends: dict) -> None:
    import torch.distributed as dist

    ckptio.configure(backends=backends)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    ck = Checkpointer(root, format="dcp", timeout=60)
    assert ck.latest() == 3
    assert ck.list() == [3]
    dist.barrier()
    dist.destroy_process_group()


def test_two_ranks_read_the_latest_pointer_once(tmp_path, s3_proxy):
    from conftest import S3_TEST_OPTIONS

    root = s3_proxy.uri + "/run"
    Checkpointer(root, format="dcp").save(3, {"w": torch.ones(2)})
    s3_proxy.clear()
    out = str(tmp_path / "out")
    os.makedirs(out)
    run_ranks(_pointer_worker, 2, root, {"s3": {"endpoint_url": s3_proxy.url, **S3_TEST_OPTIONS}}, out)
    assert results(out, 2) == ["ok", "ok"]
    gets = [r for r in s3_proxy.requests if r.method == "GET" and r.path.split("?")[0].endswith("/run/latest.txt")]
    lists = [r for r in s3_proxy.requests if r.method == "GET" and "list-type" in r.path]
    assert len(gets) == 1, [r.path for r in gets]
    assert len(lists) == 1, [r.path for r in lists]


# ---- resuming from a seed's own layout ----------------------------------------------------------------
def _adamw_state_equal(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> None:
    for p, q in zip(a.param_groups[0]["params"], b.param_groups[0]["params"], strict=True):
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(a.state[p][k], b.state[q][k]), k


@pytest.mark.parametrize("backend", ["local", "s3"])
def test_resume_from_a_dinov3_root_then_save_beside_it(backend, request):
    job = request.getfixturevalue(f"{backend}_uri") + "/job"
    seed_root = job + "/ckpt"
    models = {it: trained(it) for it in (99, 199)}
    for it, (m, o, _, _) in models.items():
        dino_save(seed_root, it, m, o)
    if backend == "local":
        dino_keep(seed_root, 99)
    before = _files(seed_root) if backend == "local" else None

    for root in (seed_root, job):  # DINOv3's ckpt directory, or the output_dir above it
        model, optim, _, _ = trained(5)
        ck = Checkpointer(root, format="dcp")
        assert ck.latest() is None  # none of its own
        assert ck.resume({"model": model, "optimizer": optim}) == 200  # strict: DINOv3's "iteration" is no part
        assert ck.last_load.step == 199 and ck.last_load.uri == f"{seed_root}/199"
        assert same_weights(model, models[199][0])
        _adamw_state_equal(optim, models[199][1])

    for root in (job, seed_root):  # its own steps beside ckpt/, or inside it beside DINOv3's
        model, optim, _, _ = trained(5)
        ck = Checkpointer(root, format="dcp", keep_last=1)
        ck.resume({"model": model, "optimizer": optim})
        for it in (299, 399):
            ck.save(it, {"model": model, "optimizer": optim})
        assert ck.list() == [399]
        if before is not None:
            assert {k: v for k, v in _files(seed_root).items() if k in before} == before  # only read
        assert find(seed_root).steps() == [99, 199]
        fresh, fresh_optim, _, _ = trained(6)
        assert Checkpointer(root).resume({"model": fresh, "optimizer": fresh_optim}) == 400  # its own step now
        assert same_weights(fresh, model)


def _cosmos_state(seed: int) -> dict:
    model, optim, sched, scaler = trained(seed)
    return {"model": model, "optim": optim, "scheduler": sched, "trainer": {"grad_scaler": scaler, "iteration": 0}}


@pytest.mark.parametrize(("backend", "layout"), [("local", "flat"), ("s3", "flat"), ("local", "by-key")])
def test_resume_from_a_cosmos_root_then_save_beside_it(backend, layout, request):
    root = request.getfixturevalue(f"{backend}_uri") + "/job/checkpoints"
    states = {it: cosmos_save(root, it, layout) for it in (10, 20)}
    cosmos_save(root, 30, layout, keys=("model", "optim"))  # killed mid-save, pointer already moved (by-key)
    ckptio.put_text(f"iter_{20:09d}.pt\n", f"{root}/latest_checkpoint.txt")
    before = _files(root) if backend == "local" else None

    state = _cosmos_state(99)
    model, optim, sched, scaler = state["model"], state["optim"], state["scheduler"], state["trainer"]["grad_scaler"]
    ck = Checkpointer(root, format="pt")
    with warnings.catch_warnings():
        warnings.simplefilter("error", CheckpointWarning)
        iteration = ck.load(state)  # strict
    assert iteration == 20 and state["trainer"]["iteration"] == 20
    assert same_weights(model, trained(20)[0]) and scaler.get_scale() == 2.0**20
    assert_same_tree(optim.state_dict(), states[20]["optim"])
    assert_same_tree(sched.state_dict(), states[20]["scheduler"])

    # keys_not_to_resume: only the other parts' files are read (a damaged optimizer file is never opened)
    optim_file = find(root).target(20).files["optim"]
    saved = ckptio.get(optim_file)
    junk = io.BytesIO()
    with zipfile.ZipFile(junk, "w") as z:  # whole as a zip (the seed's torn-write check passes), no torch file
        z.writestr("junk", b"x")
    ckptio.put(junk.getvalue(), optim_file)

    def load_all() -> None:  # a crafted file: read in a child process
        with pytest.raises(Exception, match=r"optim/iter_000000020|iter_000000020_optim"):
            Checkpointer(root, format="pt").load(_cosmos_state(1))

    assert not forked(load_all, timeout=120)
    part_state = _cosmos_state(1)
    keys = [k for k in KEYS if k not in ("optim",)]
    assert Checkpointer(root, format="pt").load(part_state, keys=keys) == 20
    assert same_weights(part_state["model"], trained(20)[0])
    ckptio.put(saved, optim_file)
    if before is not None:
        assert _files(root) == before

    ck.save(iteration + 10, state)
    assert ck.list() == [30] and ck.latest() == 30
    if before is not None:
        assert {k: v for k, v in _files(root).items() if k in before} == before  # the seed's files untouched
    assert find(root).steps() == [10, 20]
    state2 = _cosmos_state(2)
    assert Checkpointer(root, format="pt").resume(state2) == 31  # its own checkpoint, not the seed's
    assert state2["trainer"]["iteration"] == 20  # the state saved at 30 came from the seed's step 20


def test_cosmos_dcp_layout_is_refused_with_the_way_to_read_it(tmp_path):
    root = str(tmp_path / "checkpoints")
    cosmos_save(root, 10, "dcp")
    with pytest.raises(ckptio.errors.CkptioError, match="ckptio.dcp.load"):
        Checkpointer(root).load({"model": _net(0)})

"""The Checkpointer defects real training programs found (issue 33), one test each: the README loop, FSDP2
and DDP states through torch's state_dict functions, nested Stateful parts, strict and non-strict loads,
bare checkpoint URIs, one ``.metadata`` read per load, no single-process warnings. Multi-rank cases run on
real gloo process groups in spawned ranks under a deadline."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

import ckptio
from ckptio.checkpointer import Checkpointer, RNGState
from ckptio.errors import AlreadyExistsError
from multiproc import record, results, run_ranks

FORMATS = ["pt", "fpk", "dcp"]


def _model(seed: int = 0, wide: bool = False) -> torch.nn.Module:
    torch.manual_seed(seed)
    layers = [torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)]
    if wide:
        layers += [torch.nn.ReLU(), torch.nn.Linear(2, 2)]
    return torch.nn.Sequential(*layers)


def _step(model: torch.nn.Module, optim: torch.optim.Optimizer) -> torch.Tensor:
    loss = model(torch.randn(3, 4)).pow(2).mean()
    optim.zero_grad()
    loss.backward()
    optim.step()
    return loss


# ---- 1. the README loop ------------------------------------------------------------------------
def _readme_loop(root: str, steps: int, stop_at: int | None, every: int) -> list[int]:
    """The README's loop as written; returns the steps it saved. ``stop_at``: a crash after that step."""
    torch.manual_seed(0)
    model = _model()
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    ck = Checkpointer(root, format="dcp", keep_last=3, async_save=True)
    state = {"model": model, "optim": optim, "trainer": {"step": 0}, "rng": RNGState()}
    saved = []
    for step in range(ck.resume(state), steps):
        loss = _step(model, optim)
        if step % every == 0:
            state["trainer"]["step"] = step
            ck.save(step, state, metrics={"loss": loss})  # a tensor that requires grad
            saved.append(step)
        if step == stop_at:
            ck.wait()
            return saved
    ck.wait()
    return saved


def test_readme_loop_resumes_after_each_restart_and_matches_an_uninterrupted_run(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no requires_grad warning for the tensor metric, no torch warning
        assert _readme_loop(str(tmp_path / "a"), 10, 3, 2) == [0, 2]
        assert _readme_loop(str(tmp_path / "a"), 10, 6, 2) == [4, 6]  # resumes after 2, not at it
        assert _readme_loop(str(tmp_path / "a"), 10, None, 2) == [8]
        assert _readme_loop(str(tmp_path / "b"), 10, None, 2) == [0, 2, 4, 6, 8]
    a, b = Checkpointer(str(tmp_path / "a")), Checkpointer(str(tmp_path / "b"))
    assert a.list() == b.list() == [4, 6, 8]
    ma, mb = _model(1), _model(2)
    a.load({"model": ma}, keys=["model"]), b.load({"model": mb}, keys=["model"])
    for x, y in zip(ma.state_dict().values(), mb.state_dict().values(), strict=True):
        assert torch.equal(x, y)
    assert isinstance(a.manifest(8)["metrics"]["loss"], float)


@pytest.mark.parametrize("fmt", FORMATS)
def test_saving_the_latest_step_again_raises_at_the_call_even_async(tmp_path, fmt):
    root = str(tmp_path / "run")
    model = _model()
    Checkpointer(root, format=fmt).save(5, {"model": model})
    ck = Checkpointer(root, format=fmt, async_save=True)  # a restarted job
    assert ck.load({"model": model}) == 5
    with pytest.raises(AlreadyExistsError, match="latest checkpoint"):
        ck.save(5, {"model": model})  # here, not one save later from the background thread
    ck.save(6, {"model": model})
    with pytest.raises(AlreadyExistsError):
        ck.save(6, {"model": model})  # known from its own save: no pointer read
    ck.wait()
    fresh = Checkpointer(root, format=fmt, async_save=True)  # knows nothing yet: reads the pointer once
    with pytest.raises(AlreadyExistsError):
        fresh.save(6, {"model": model})


@pytest.mark.parametrize("fmt", FORMATS)
def test_overwrite_replaces_the_latest_step(tmp_path, fmt):
    root = str(tmp_path / "run")
    ck = Checkpointer(root, format=fmt)
    a, b = _model(0), _model(1)
    ck.save(3, {"model": a})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ck.save(3, {"model": b}, overwrite=True)
    got = _model(2)
    assert Checkpointer(root).load({"model": got}) == 3
    for x, y in zip(got.state_dict().values(), b.state_dict().values(), strict=True):
        assert torch.equal(x, y)


def test_metrics_must_be_numbers(tmp_path):
    ck = Checkpointer(str(tmp_path / "r"), format="pt")
    with pytest.raises(ValueError, match="metrics\\['loss'\\]"):
        ck.save(1, {"x": torch.zeros(1)}, metrics={"loss": torch.zeros(2)})
    with pytest.raises(TypeError, match="metrics\\['loss'\\]"):
        ck.save(1, {"x": torch.zeros(1)}, metrics={"loss": "low"})


# ---- 3. nested Stateful parts ------------------------------------------------------------------
@pytest.mark.parametrize("fmt", FORMATS)
def test_nested_stateful_parts_save_and_load(tmp_path, fmt):
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler.scale(torch.ones(()))
    scaler.update(512.0)
    model = _model()
    optim = torch.optim.AdamW(model.parameters())
    _step(model, optim)
    ck = Checkpointer(str(tmp_path / "run"), format=fmt)
    ck.save(1, {"extra": {"scaler": scaler, "opt": [optim], "n": 3}, "model": model})
    scaler2 = torch.amp.GradScaler("cpu")
    model2 = _model(1)
    optim2 = torch.optim.AdamW(model2.parameters())
    state = {"extra": {"scaler": scaler2, "opt": [optim2], "n": 0}, "model": model2}
    assert ck.load(state) == 1
    assert state["extra"]["scaler"] is scaler2 and scaler2.get_scale() == 512.0
    assert state["extra"]["n"] == 3
    assert torch.equal(optim2.state[model2[0].weight]["exp_avg"], optim.state[model[0].weight]["exp_avg"])


# ---- 5. strict, non-strict, bare URIs ------------------------------------------------------------
@pytest.mark.parametrize("fmt", FORMATS)
def test_strict_mismatch_raises_before_anything_is_restored(tmp_path, fmt):
    ck = Checkpointer(str(tmp_path / "run"), format=fmt)
    src = _model(0)
    ck.save(1, {"model": src, "trainer": {"step": 1}})
    target = _model(1, wide=True)  # a layer more than the checkpoint has
    before = {k: v.clone() for k, v in target.state_dict().items()}
    trainer = {"step": 0}
    with pytest.raises(KeyError, match="model.4.weight.*nothing was restored"):
        ck.load({"model": target, "trainer": trainer})
    for k, v in target.state_dict().items():
        assert torch.equal(v, before[k]), k  # not one tensor touched, not even read in place
    assert trainer == {"step": 0}


@pytest.mark.parametrize("fmt", FORMATS)
def test_non_strict_load_reports_missing_and_unexpected_keys(tmp_path, fmt):
    ck = Checkpointer(str(tmp_path / "run"), format=fmt)
    ck.save(1, {"model": _model(0, wide=True), "trainer": {"step": 1, "old": 2}, "gone": {"x": 1}})
    target = _model(1)
    with pytest.warns(ckptio.checkpointer.CheckpointWarning, match="does not match"):
        assert ck.load({"model": target, "trainer": {"step": 0, "new": 1}}, strict=False) == 1
    res = ck.last_load
    assert "trainer.new" in res.missing_keys
    assert {"model.4.weight", "model.4.bias", "trainer.old", "gone"} <= set(res.unexpected_keys)
    wide = _model(2, wide=True)
    ck.save(2, {"model": _model(0), "trainer": {"step": 2}})
    with pytest.warns(ckptio.checkpointer.CheckpointWarning):
        ck.load({"model": wide, "trainer": {}}, strict=False)
    assert {"model.4.weight", "model.4.bias"} <= set(ck.last_load.missing_keys)


@pytest.mark.parametrize("fmt", FORMATS)
def test_exclude_skips_parts_and_reads_only_the_others(tmp_path, fmt):
    ck = Checkpointer(str(tmp_path / "run"), format=fmt)
    model = _model(0)
    optim = torch.optim.AdamW(model.parameters())
    _step(model, optim)
    ck.save(4, {"model": model, "optim": optim, "trainer": {"step": 4}})
    m2 = _model(1)
    o2 = torch.optim.AdamW(m2.parameters())
    assert ck.load({"model": m2, "optim": o2, "trainer": {"step": 0}}, exclude=["optim"]) == 4
    assert not o2.state  # Cosmos keys_not_to_resume
    assert torch.equal(m2[0].weight, model[0].weight)


def test_bare_dcp_directory_and_pt_file_give_the_step_of_their_name(tmp_path):
    model = _model(0)
    d = tmp_path / "dinov3" / "1234"
    ckptio.dcp.save({"model": model.state_dict()}, str(d))
    f = tmp_path / "iter_000000500_model.pt"
    torch.save({"model": model.state_dict()}, f)
    ck = Checkpointer(str(tmp_path / "mine"))
    assert ck.load({"model": _model(1)}, step=str(d)) == 1234
    assert ck.last_load.uri == str(d)
    assert ck.load({"model": _model(1)}, step=str(f)) == 500
    assert ck.last_load.uri.endswith("iter_000000500_model.pt")


def test_dcp_load_reads_the_metadata_once_and_warns_nothing(tmp_path, monkeypatch):
    from ckptio.dcp.reader import StorageReader

    ck = Checkpointer(str(tmp_path / "run"), format="dcp")
    model = _model()
    optim = torch.optim.AdamW(model.parameters())
    _step(model, optim)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ck.save(1, {"model": model, "optim": optim})
        reads = []
        real = StorageReader._read_metadata
        monkeypatch.setattr(StorageReader, "_read_metadata", lambda self, m: reads.append(m) or real(self, m))
        m2 = _model(1)
        ck.load({"model": m2, "optim": torch.optim.AdamW(m2.parameters())})
    assert len(reads) == 1, reads


# ---- 2. FSDP2 and DDP, given directly --------------------------------------------------------------
def _dist_worker(rank: int, world: int, port: int, root: str, fmt: str, mode: str, out: str) -> None:
    record(out, rank, _dist_body, rank, world, port, root, fmt, mode)


def _dist_body(rank: int, world: int, port: int, root: str, fmt: str, mode: str) -> None:
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )

    def build(seed: int):
        torch.manual_seed(seed)
        m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
        if mode == "fsdp2":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (world,))
            for layer in m:
                fully_shard(layer, mesh=mesh)
            m = fully_shard(m, mesh=mesh)
        elif mode == "ddp":
            m = torch.nn.parallel.DistributedDataParallel(m)
        return m, torch.optim.AdamW(m.parameters(), lr=0.01)

    def full(t):
        return t.full_tensor() if isinstance(t, DTensor) else t

    model, optim = build(0)
    for _ in range(2):
        torch.manual_seed(rank)
        model(torch.randn(4, 8)).sum().backward()
        optim.step()
        optim.zero_grad()
    ck = Checkpointer(root, format=fmt, timeout=60)
    ck.save(2, {"model": model, "optim": optim})
    model2, optim2 = build(1)  # a fresh model and a fresh optimizer, given directly
    assert ck.load({"model": model2, "optim": optim2}) == 2
    for (k, a), b in zip(model.state_dict().items(), model2.state_dict().values(), strict=True):
        assert type(a) is type(b) and torch.equal(full(a), full(b)), k
    for p, q in zip(model.parameters(), model2.parameters(), strict=True):
        sa, sb = optim.state[p], optim2.state[q]
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert type(sa[key]) is type(sb[key]), (key, type(sa[key]), type(sb[key]), getattr(sb[key], "shape", None))
            if isinstance(sa[key], DTensor):
                assert sa[key].to_local().shape == sb[key].to_local().shape
            assert torch.equal(full(sa[key]), full(sb[key])), key
    torch.manual_seed(rank)
    model2(torch.randn(4, 8)).sum().backward()
    optim2.step()  # no "mixed torch.Tensor and DTensor"
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.parametrize("mode", ["fsdp2", "ddp"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_fsdp2_and_ddp_model_and_fresh_optimizer_given_directly(tmp_path, fmt, mode):
    out = str(tmp_path / "out")
    os.makedirs(out)
    run_ranks(_dist_worker, 2, str(tmp_path / "run"), fmt, mode, out)
    assert results(out, 2) == ["ok", "ok"]

"""Checkpointer.load (and load_model) when the state given differs from the checkpoint: a model grown or
reshaped, an optimizer over other parameters or groups. A load restores what matches, the optimizer's state
too, bitwise as the checkpoint holds it, and reports the rest; a load that fails (strict, shapes, an
optimizer it cannot match) names the checkpoint, its step and the keys, and leaves the model and the
optimizer bitwise as they were. The cases live in ``mismatch_cases.py``; the fuzzer runs random ones there
in a child process."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

import mismatch_cases as mc
import zygote
from multiproc import results, run_ranks

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.mark.parametrize("optim", ["adamw", "sgd"])
@pytest.mark.parametrize("fmt", mc.FORMATS)
@pytest.mark.parametrize("stepped", [False, True])
def test_a_non_strict_load_restores_the_optimizer_state_both_hold(tmp_path, fmt, optim, stepped):
    """DINOv3's flow: the model given directly has parameters the checkpoint lacks, its optimizer is new."""
    save, load = mc.replace(mc.GROWN[0], optim=optim), mc.replace(mc.GROWN[1], optim=optim, steps=int(stepped))
    root = str(tmp_path / "run")
    out = mc.run_case(fmt, False, save, load, root)
    assert out["outcome"] == "ok", out.get("message")
    assert out["bad"] == []  # the matching parameters and their state bitwise; x and its state as they were
    missing, unexpected = out["result"]
    assert missing == [
        "model.layers.x.weight",
        "model.layers.x.bias",
        "optim.state.layers.x.weight",
        "optim.state.layers.x.bias",
        "optim.param_groups.1",
    ]
    assert unexpected == []


@pytest.mark.parametrize("fmt", mc.FORMATS)
@pytest.mark.parametrize("named", [(True, True), (False, True), (True, False)])
def test_a_group_restored_in_part_keeps_its_parameter_names(tmp_path, fmt, named):
    """An optimizer built from named parameters (torch >= 2.6: ``param_names`` in each group): a group that
    gains a parameter keeps its own names, one for each of its parameters, whatever the checkpoint's said."""
    save, load = (
        mc.replace(mc.GROWN[0], named=named[0]),
        mc.replace(mc.GROWN[1], groups=[None], lrs=[0.5], named=named[1]),
    )
    out = mc.run_case(fmt, False, save, load, str(tmp_path / "run"))
    assert out["outcome"] == "ok" and out["bad"] == [], out


@pytest.mark.parametrize("fmt", mc.FORMATS)
def test_the_optimizer_restored_in_part_trains_on(tmp_path, fmt):
    from ckptio.checkpointer import Checkpointer, CheckpointWarning

    save, load = mc.GROWN
    m, _, o = save.build()
    Checkpointer(tmp_path, format=fmt).save(3, {"model": m, "optim": o})
    m2, _, o2 = load.build()
    with pytest.warns(CheckpointWarning, match=r"optim\.state\.layers\.x\.weight"):
        assert Checkpointer(tmp_path, format=fmt).load({"model": m2, "optim": o2}, strict=False) == 3
    assert [g["lr"] for g in o2.param_groups] == [0.01, 0.5]  # the checkpoint's group; x's keeps its own
    m2().backward()
    o2.step()
    assert all(len(o2.state[p]) == 3 for p in m2.parameters())


@pytest.mark.parametrize("fmt", mc.FORMATS)
@pytest.mark.parametrize("strict", [True, False])
def test_a_shape_mismatch_names_the_checkpoint_and_touches_nothing(tmp_path, fmt, strict):
    from ckptio.errors import StateMismatchError

    root = str(tmp_path / "run")
    out = mc.run_case(fmt, strict, *mc.RESHAPED, root)
    assert out["error"] == "StateMismatchError" and out["bad"] == [], out
    assert issubclass(StateMismatchError, RuntimeError)  # what torch's size mismatch is
    msg = out["message"]
    for part in (root, "step 3", "model.layers.l1.weight has shape (4, 2) in the checkpoint, (5, 2) here"):
        assert part in msg, msg
    assert "model.layers.l0" not in msg  # only what differs


@pytest.mark.parametrize("fmt", mc.FORMATS)
def test_a_strict_load_refuses_an_optimizer_over_other_parameters_before_restoring_the_model(tmp_path, fmt):
    out = mc.run_case(fmt, True, *mc.OPTIMIZER_GREW, str(tmp_path / "run"))
    assert out["error"] == "KeyError" and out["bad"] == [], out
    assert "optim.state.layers.l1.weight" in out["message"]
    out = mc.run_case(fmt, False, *mc.OPTIMIZER_GREW, str(tmp_path / "run2"))
    assert out["outcome"] == "ok" and out["bad"] == [], out


def test_optimizer_groups_that_are_not_groups_fail_naming_the_checkpoint(tmp_path):
    from ckptio.checkpointer import Checkpointer
    from ckptio.errors import StateMismatchError

    m, _, o = mc.GROWN[0].build()
    ck = Checkpointer(tmp_path, format="pt")
    ck.save(3, {"model": m, "optim": o})
    f = os.path.join(ck.uri(3), "state.pt")
    sd = torch.load(f)
    sd["optim"]["param_groups"] = [{"params": 7}]
    torch.save(sd, f)
    m2, _, o2 = mc.GROWN[0].build()
    before = mc.snapshot(m2, o2)
    with pytest.raises(StateMismatchError, match=r"state\.pt \(step 3\).*optim\.param_groups: not a list of groups"):
        ck.load({"model": m2, "optim": o2}, strict=False)
    assert mc.same(mc.snapshot(m2, o2), before)


@pytest.mark.parametrize("fmt", mc.FORMATS)
def test_load_model_names_the_checkpoint_step_and_shapes(tmp_path, fmt):
    from ckptio.checkpointer import Checkpointer, load_model
    from ckptio.errors import StateMismatchError

    m, _, o = mc.GROWN[0].build()
    ck = Checkpointer(tmp_path / "run", format=fmt)
    ck.save(3, {"model": m, "optim": o})
    m2, _, _ = mc.RESHAPED[1].build()
    before = {k: v.clone() for k, v in m2.state_dict().items()}
    uris = [ck.uri(3)] + ([] if fmt == "dcp" else [os.path.join(ck.uri(3), f"state.{fmt}")])
    for uri in uris:
        for strict in (True, False):
            with pytest.raises(RuntimeError) as e:
                load_model(m2, uri, strict=strict)
            msg = str(e.value)
            assert isinstance(e.value, StateMismatchError) and uri in msg
            assert "(step 3)" in msg or uri != ck.uri(3), msg  # a bare file's step: the number its name ends with
            assert "model.layers.l1.weight has shape (4, 2) in the checkpoint, (5, 2) here" in msg
            assert all(mc.tensors_same(v, before[k]) for k, v in m2.state_dict().items())
    if fmt != "dcp":  # a file holding the state dict itself (key=None)
        import ckptio

        path = str(tmp_path / f"sd.{fmt}")
        ckptio.dump(m.state_dict(), path)
        shapes = r"layers\.l1\.bias has shape \(4,\) in the checkpoint, \(5,\) here"
        with pytest.raises(StateMismatchError, match=rf"sd\.{fmt}.*{shapes}"):
            load_model(m2, path, key=None, strict=False)
        assert all(mc.tensors_same(v, before[k]) for k, v in m2.state_dict().items())


@pytest.mark.parametrize("world,mode", [(1, "plain"), (2, "ddp"), (2, "fsdp2")])
def test_mismatched_loads_under_gloo(tmp_path, world, mode):
    """A 1-process gloo group with the modules as they are; 2 gloo ranks with DDP modules, and FSDP2."""
    run_ranks(mc.ranks_main, world, str(tmp_path), mode, timeout=240)
    assert results(str(tmp_path), world) == ["ok"] * world


def test_a_mismatch_on_one_rank_fails_every_rank_at_once(tmp_path):
    """Ranks holding different states (pipeline stages): a check failing on some ranks of a dcp load fails
    every rank with its message, before the read's collectives, never a wait for the collective timeout
    (random cases: which ranks mismatch, strict or not)."""
    run_ranks(mc.stages_main, 2, str(tmp_path), 53, 8, timeout=120)
    assert results(str(tmp_path), 2) == ["ok"] * 2


def _fuzz(seed: int, count: int, timeout: float, script: str = "mismatch_cases.py") -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([here, *sys.path])}
    proc = zygote.run([sys.executable, os.path.join(here, script), str(seed), str(count)], timeout=timeout, env=env)
    found = [json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and len(found) == count, (proc.returncode, proc.stdout[-2000:], proc.stderr[-4000:])
    bad = [r for r in found if r["bad"]]
    assert not bad, json.dumps(bad[:3], indent=1)[:6000]


def test_fuzz_mismatched_loads():
    """Random mismatches between the saved and the loading model and optimizer, each format, strict or not:
    a correct partial restore (bitwise) or a clear error with nothing changed."""
    _fuzz(51, 16, timeout=120)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(4))
def test_fuzz_mismatched_loads_long(seed):
    _fuzz(1000 + seed, 150, timeout=600)


def test_fuzz_shapes_refused_as_torch_refuses_them():
    """Random models of other shapes (layers torch's load checks, and ones that load their own way): a load
    refuses exactly what torch's load_state_dict refuses, touching nothing, else restores as torch does."""
    _fuzz(52, 16, timeout=120, script="shape_cases.py")


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(2))
def test_fuzz_shapes_refused_as_torch_refuses_them_long(seed):
    _fuzz(2000 + seed, 150, timeout=600, script="shape_cases.py")


def test_dcp_check_reads_only_the_groups_parameter_lists_before_the_load(tmp_path, monkeypatch):
    """The check's extra DCP round reads each optimizer group's ``params`` (what it compares), no other value:
    with many groups (per-layer learning rates) or a large non-tensor part beside, every other item is read
    once, as by a load without the check."""
    from torch.distributed.checkpoint.planner import LoadItemType

    from ckptio.checkpointer import Checkpointer
    from ckptio.dcp.reader import StorageReader

    def build() -> tuple[dict, torch.optim.Optimizer]:
        torch.manual_seed(0)
        m = torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(3)])
        o = torch.optim.AdamW([{"params": list(layer.parameters()), "lr": 0.1 * i} for i, layer in enumerate(m)])
        return {"model": m, "optim": o, "data": {"order": list(range(100))}}, o

    st, o = build()
    st["model"](torch.ones(2)).sum().backward()
    o.step()
    ck = Checkpointer(tmp_path, format="dcp")
    ck.save(1, st)
    seen: list[str] = []
    read_data = StorageReader.read_data

    def counting(self, plan, planner):
        seen.extend(i.dest_index.fqn for i in plan.items if i.type == LoadItemType.BYTE_IO)
        return read_data(self, plan, planner)

    monkeypatch.setattr(StorageReader, "read_data", counting)
    st2, o2 = build()
    assert ck.load(st2) == 1
    assert [g["lr"] for g in o2.param_groups] == [0.0, 0.1, 0.2]
    twice = sorted({f for f in seen if seen.count(f) > 1})
    assert twice == [f"optim.param_groups.{i}.params" for i in range(3)], twice


def _qat() -> torch.nn.Module:
    """A linear layer with a per-channel fake-quantizer: its observer's buffers start empty, and its own
    ``_load_from_state_dict`` resizes them (and the quantizer's scale and zero point) to the checkpoint's."""
    from torch.ao.quantization import FakeQuantize, PerChannelMinMaxObserver

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 3))
    m.fq = FakeQuantize(
        observer=PerChannelMinMaxObserver,
        quant_min=-128,
        quant_max=127,
        dtype=torch.qint8,
        qscheme=torch.per_channel_symmetric,
        ch_axis=0,
    )
    return m


@pytest.mark.parametrize("fmt", mc.FORMATS)
def test_a_module_that_loads_its_own_way_resumes(tmp_path, fmt):
    """Quantization-aware training resumed into a fresh model: the shapes that module's own load accepts
    (torch's observers resize their buffers) are not refused; a lazy module not yet run is loaded as torch
    loads it (``pt``), and a 1-element tensor fills a 0-d parameter as torch's load_state_dict does."""
    from ckptio.checkpointer import Checkpointer

    m = _qat()
    o = torch.optim.AdamW(m.parameters())
    m.fq(m[0](torch.ones(2, 4))).sum().backward()
    o.step()
    ck = Checkpointer(tmp_path / "qat", format=fmt)
    ck.save(1, {"model": m, "optim": o})
    m2 = _qat()
    o2 = torch.optim.AdamW(m2.parameters())
    assert ck.load({"model": m2, "optim": o2}) == 1
    assert mc.same(mc.snapshot(m2, o2), mc.snapshot(m, o))
    assert all(mc.tensors_same(a, b) for a, b in zip(m.state_dict().values(), m2.state_dict().values(), strict=True))
    if fmt == "pt":  # torch's own load of a lazy module into one not run yet
        ck = Checkpointer(tmp_path / "lazy", format=fmt)
        lazy = torch.nn.LazyLinear(2)
        lazy(torch.ones(1, 3))
        ck.save(1, {"model": lazy})
        lazy2 = torch.nn.LazyLinear(2)
        assert ck.load({"model": lazy2}) == 1 and torch.equal(lazy2.weight, lazy.weight)
    ck = Checkpointer(tmp_path / "scalar", format=fmt)
    ck.save(1, {"model": {"t": torch.nn.ParameterDict({"t": torch.nn.Parameter(torch.tensor([2.0]))})}})
    new = torch.nn.ParameterDict({"t": torch.nn.Parameter(torch.tensor(1.0))})
    assert ck.load({"model": {"t": new}}) == 1 and new["t"].item() == 2.0


@pytest.mark.parametrize("fmt", mc.FORMATS)
def test_a_mismatch_on_the_local_tier_is_not_taken_for_a_damaged_copy(tmp_path, fmt):
    """A state that does not fit the checkpoint fails on the local copy as it is: no warning that the copy
    cannot be read, no read of the remote copy."""
    import warnings

    from ckptio.checkpointer import Checkpointer
    from ckptio.errors import StateMismatchError

    local = str(tmp_path / "local")
    with Checkpointer(tmp_path / "remote", format=fmt, local_tier=local) as ck:
        ck.save(1, {"model": torch.nn.Linear(4, 4)})
        ck.wait()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with pytest.raises(StateMismatchError, match=r"local/000000000001.*model\.weight has shape") as e:
                ck.load({"model": torch.nn.Linear(4, 5)})
        assert "remote" not in str(e.value)


@pytest.mark.parametrize("first", ["tensors", "scheduler"])
def test_an_optimizer_after_other_items_of_a_list_loads_from_dcp(tmp_path, first):
    """The check's read of an optimizer's groups asks for those items only: never for the list items before
    the optimizer (a dict of tensors, a scheduler), which are no items of the checkpoint themselves."""
    from ckptio.checkpointer import Checkpointer

    def build() -> tuple:
        torch.manual_seed(0)
        m = torch.nn.Linear(2, 2)
        o = torch.optim.AdamW(m.parameters())
        item = {"ema": torch.zeros(2)} if first == "tensors" else torch.optim.lr_scheduler.StepLR(o, 1)
        return m, o, {"model": m, "train": [item, o]}

    m, o, st = build()
    m(torch.ones(2)).sum().backward()
    o.step()
    ck = Checkpointer(tmp_path, format="dcp")
    ck.save(1, st)
    _, o2, st2 = build()
    assert ck.load(st2) == 1
    assert mc.same(o2.state_dict(), o.state_dict())


@pytest.mark.parametrize("fmt", mc.FORMATS)
def test_optimizers_in_a_tuple_are_restored(tmp_path, fmt):
    """Optimizers (and a scheduler) given in a tuple, as in a list: each restored in place, bitwise, the tuple
    kept; never its raw state dicts put in its place with the optimizers left as they were."""
    from ckptio.checkpointer import Checkpointer

    def build() -> tuple:
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 2))
        o1, o2 = torch.optim.AdamW(m[0].parameters()), torch.optim.SGD(m[1].parameters(), lr=0.1, momentum=0.9)
        return m, (o1, o2, torch.optim.lr_scheduler.StepLR(o1, 1, gamma=0.5)), 7

    m, opts, n = build()
    for _ in range(2):
        m(torch.ones(3)).sum().backward()
        for o in opts[:2]:
            o.step()
        opts[2].step()
    ck = Checkpointer(tmp_path, format=fmt)
    ck.save(2, {"model": m, "opts": opts, "n": (n, 8)})
    m2, opts2, _ = build()
    st = {"model": m2, "opts": opts2, "n": (0, 0)}
    assert ck.load(st) == 2
    assert st["opts"] is opts2 and tuple(st["n"]) == (7, 8)
    for a, b in zip(opts, opts2, strict=True):
        assert mc.same(a.state_dict(), b.state_dict()), type(a).__name__


def test_fuzz_nested_states():
    """Optimizers, schedulers, tensors and values nested at random in dicts, lists and tuples: every one
    restored in place, bitwise, in every format."""
    _fuzz(54, 24, timeout=120, script="nesting_cases.py")


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(2))
def test_fuzz_nested_states_long(seed):
    _fuzz(3000 + seed, 200, timeout=600, script="nesting_cases.py")

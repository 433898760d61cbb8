"""A model and optimizer saved by a Checkpointer, then loaded into another model and optimizer, and what that
load must do: either restore what matches, bitwise as the checkpoint holds it (the rest untouched and
reported), or raise a clear error with the model and optimizer bitwise as they were.

Shared by tests/test_checkpointer_mismatch.py (the cases, the gloo groups) and its fuzzer's child
(``python mismatch_cases.py SEED COUNT``: random cases, one ``RESULT`` line each).
"""

from __future__ import annotations

import copy
import json
import random
import sys
import tempfile
import traceback
from dataclasses import dataclass, field, replace

import torch

FORMATS = ("dcp", "pt", "fpk")


class Net(torch.nn.Module):
    """Independent linear layers by name (``layers``: name -> (in, out, bias, dtype)), so layers can be
    added, dropped or reshaped without renaming the others; ``idle``: layers the forward leaves out (no
    gradient, so no optimizer state)."""

    def __init__(self, layers: dict, seed: int, idle: tuple = (), frozen: tuple = ()) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.layers = torch.nn.ModuleDict(
            {n: torch.nn.Linear(i, o, bias=b, dtype=getattr(torch, dt)) for n, (i, o, b, dt) in layers.items()}
        )
        self.idle = set(idle)
        for n in frozen:
            self.layers[n].requires_grad_(False)

    def forward(self) -> torch.Tensor:
        return sum(
            (m(torch.ones(m.in_features, dtype=m.weight.dtype)) ** 2).sum().float()
            for n, m in self.layers.items()
            if n not in self.idle
        ) + torch.zeros((), requires_grad=True)


@dataclass
class Side:
    """One side of a case: the model's layers, the optimizer and its groups (lists of layer names, each
    with its lr), how many steps it took."""

    layers: dict
    optim: str = "adamw"
    groups: list = field(default_factory=lambda: [None])  # None: every layer
    lrs: list = field(default_factory=lambda: [0.01])
    steps: int = 1
    idle: tuple = ()
    frozen: tuple = ()
    seed: int = 0
    named: bool = False  # the optimizer built from named parameters (its groups hold ``param_names``)

    def build(self, wrap=None) -> tuple[Net, torch.nn.Module, torch.optim.Optimizer]:
        """The model, the model as the Checkpointer gets it (``wrap(model)``: DDP, FSDP2) and the optimizer,
        after ``steps`` steps."""
        m = Net(self.layers, self.seed, self.idle, self.frozen)
        wm = m if wrap is None else wrap(m)
        groups = []
        for names, lr in zip(self.groups, self.lrs, strict=True):
            names = list(self.layers) if names is None else names
            params = [(f"layers.{n}.{k}", p) for n in names for k, p in m.layers[n].named_parameters()]
            groups.append({"params": params if self.named else [p for _, p in params], "lr": lr})
        if self.optim == "adamw":
            o: torch.optim.Optimizer = torch.optim.AdamW(groups, weight_decay=0.1)
        else:
            o = torch.optim.SGD(groups, momentum=0.9)
        for _ in range(self.steps):
            o.zero_grad()
            wm().backward()
            o.step()
        return m, wm, o


def fsdp2(m: Net) -> Net:
    """``m``'s layers and ``m`` sharded over every rank (FSDP2)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in m.layers.values():
        fully_shard(layer, mesh=mesh)
    return fully_shard(m, mesh=mesh)


def full(x):
    """``x`` copied, DTensors gathered into full tensors (every rank calls it, in the same order)."""
    from torch.distributed.tensor import DTensor

    if isinstance(x, DTensor):
        return x.full_tensor()
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, dict):
        return {k: full(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(full(v) for v in x)
    return copy.deepcopy(x)


def tensors_same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise: dtype, shape and every byte."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.detach().reshape(-1).view(torch.uint8), b.detach().reshape(-1).view(torch.uint8))


def snapshot(m: torch.nn.Module, o: torch.optim.Optimizer) -> dict:
    """The model's tensors and the optimizer's state and groups, by parameter name, copied (full tensors)."""
    names = {id(p): n for n, p in m.named_parameters()}
    state = {names[id(p)]: full(s) for p, s in o.state.items()}
    groups = [
        ([names[id(p)] for p in g["params"]], full({k: v for k, v in g.items() if k != "params"}))
        for g in o.param_groups
    ]
    return {"model": full(dict(m.state_dict())), "state": state, "groups": groups}


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and tensors_same(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def _cast(v, like: torch.Tensor):
    return v.to(like.dtype) if isinstance(v, torch.Tensor) else v


def expect_restored(saved: dict, before: dict, after: dict, params: dict) -> list[str]:
    """What differs from a correct partial restore: the model's tensors the checkpoint holds in the same shape
    as the checkpoint's (cast to the model's dtype, as ``load_state_dict`` copies), the others as before; the
    optimizer state of the parameters the checkpoint's optimizer holds as the checkpoint's (floating tensors
    cast to the parameter's dtype, ``step`` as it is), the others as before; each group's hyperparameters
    from the one checkpoint group holding its parameters, else as before. ``params``: name -> parameter."""
    bad = []
    for k, v in after["model"].items():
        want = _cast(saved["model"][k], v) if k in saved["model"] else before["model"][k]
        if not tensors_same(v, want):
            bad.append(f"model {k}")
    positional = saved["groups"] and saved["groups"][0][0] is None  # saved by index: groups match in order
    held = set(params) if positional else {n for names, _ in saved["groups"] for n in names} | set(saved["state"])
    for n, p in params.items():
        if n in held:
            want = {
                k: (v if k == "step" or not p.is_floating_point() else _cast(v, p))
                for k, v in saved["state"].get(n, {}).items()
            }
        else:
            want = before["state"].get(n, {})
        if not same(after["state"].get(n, {}), want):
            bad.append(f"optimizer state {n}")
    for i, (names, hyper) in enumerate(after["groups"]):
        hits = [saved["groups"][i][1]] if positional else [h for ns, h in saved["groups"] if set(ns) & set(names)]
        want = hits[0] if len(hits) == 1 else before["groups"][i][1]
        own = before["groups"][i][1]  # matched by name: the group's parameter names stay its own; by index,
        if not positional or "param_names" not in want:  # the checkpoint's if it has them (torch's load_state_dict)
            want = {k: v for k, v in want.items() if k != "param_names"}
            want.update({"param_names": own["param_names"]} if "param_names" in own else {})
        if not same(hyper, want):
            bad.append(f"group {i}: {hyper} != {want}")
    return bad


def run_case(fmt: str, strict: bool, save: Side, load: Side, root: str, wrap=None) -> dict:
    """Save ``save``'s model and optimizer at step 3 under ``root``, load into ``load``'s (``wrap``: what the
    models are given as, e.g. DDP); the outcome: ``{"outcome": "ok" | "error", "error": type name,
    "message", "bad": [what is wrong], "result": [missing keys, unexpected keys]}``."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from ckptio.checkpointer import Checkpointer
    from ckptio.errors import StateMismatchError

    m, wm, o = save.build(wrap)
    ck = Checkpointer(root, format=fmt)
    ck.save(3, {"model": wm, "optim": o})
    saved = snapshot(m, o)
    saved["groups"] = [(None, h) for _, h in saved["groups"]]  # by index, unless stepped:
    if o.state:  # what the checkpoint holds: the optimizer by name, as get_optimizer_state_dict gives it
        osd = full(get_optimizer_state_dict(wm, o))
        saved["state"] = osd["state"]
        saved["groups"] = [(g["params"], {k: v for k, v in g.items() if k != "params"}) for g in osd["param_groups"]]
    m2, wm2, o2 = load.build(wrap)
    before = snapshot(m2, o2)
    out: dict = {"outcome": "ok", "bad": []}
    try:
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ck.load({"model": wm2, "optim": o2}, strict=strict)
        out["bad"] = expect_restored(saved, before, snapshot(m2, o2), dict(m2.named_parameters()))
        out["result"] = [ck.last_load.missing_keys, ck.last_load.unexpected_keys]
    except (StateMismatchError, KeyError) as e:
        out.update(outcome="error", error=type(e).__name__, message=str(e))
        if not same(snapshot(m2, o2), before):
            out["bad"].append("a failed load changed the model or the optimizer")
        if root not in str(e) or "step 3" not in str(e):
            out["bad"].append("the error does not name the checkpoint and its step")
    except Exception as e:  # noqa: BLE001 - any other error is a finding
        out.update(outcome="error", error=type(e).__name__, message=traceback.format_exc())
        out["bad"].append(f"unexpected {type(e).__name__}")
    return out


def draw(rng: random.Random) -> tuple[str, bool, Side, Side]:
    """A random case: layers added, dropped, reshaped, retyped, biases toggled; groups split or joined,
    extra groups; AdamW or SGD with momentum; 0-2 steps before the save, fresh or stepped at the load."""
    names = [f"l{i}" for i in range(rng.randint(1, 4))]
    layers = {n: (rng.randint(1, 4), rng.randint(1, 4), rng.random() < 0.8, "float32") for n in names}
    optim = rng.choice(["adamw", "sgd"])
    save = Side(layers, optim, steps=rng.choice([0, 1, 1, 2]), seed=rng.randint(0, 99), named=rng.random() < 0.3)
    if rng.random() < 0.2:
        save.idle = (rng.choice(names),)
    if rng.random() < 0.1:
        save.frozen = (rng.choice(names),)
    new = dict(layers)
    for _ in range(rng.randint(0, 3)):
        n = rng.choice(list(new) + ["x", "y"])
        what = rng.choice(["add", "drop", "shape", "dtype", "bias"])
        if what == "add" or n not in new:
            new[n] = (rng.randint(1, 4), rng.randint(1, 4), rng.random() < 0.8, "float32")
        elif what == "drop" and len(new) > 1:
            del new[n]
        elif what == "shape":
            i, o, b, dt = new[n]
            new[n] = (i, o + 1, b, dt)
        elif what == "dtype":
            i, o, b, _ = new[n]
            new[n] = (i, o, b, rng.choice(["float64", "bfloat16"]))
        elif what == "bias":
            i, o, b, dt = new[n]
            new[n] = (i, o, not b, dt)
    load = Side(new, optim, steps=rng.choice([0, 0, 1]), seed=rng.randint(100, 199), named=rng.random() < 0.3)
    for side in (save, load):
        ls = list(side.layers)
        rng.shuffle(ls)
        k = rng.randint(1, min(3, len(ls)))
        side.groups = [ls[i::k] for i in range(k)]
        side.lrs = [rng.choice([0.1, 0.01, 0.5]) for _ in range(k)]
    return rng.choice(FORMATS), rng.random() < 0.5, save, load


GROWN = (  # a model grown by a layer in a group of its own
    Side({"l0": (3, 2, True, "float32"), "l1": (2, 4, True, "float32")}, steps=2),
    Side(
        {"l0": (3, 2, True, "float32"), "l1": (2, 4, True, "float32"), "x": (4, 2, True, "float32")},
        groups=[["l0", "l1"], ["x"]],
        lrs=[0.5, 0.5],
        steps=0,
        seed=1,
    ),
)
RESHAPED = (GROWN[0], Side({"l0": (3, 2, True, "float32"), "l1": (2, 5, True, "float32")}, steps=0, seed=1))
OPTIMIZER_GREW = (  # the same model; the optimizer now holds l1 too
    Side({"l0": (3, 2, True, "float32"), "l1": (2, 4, True, "float32")}, "sgd", groups=[["l0"]], steps=2),
    Side({"l0": (3, 2, True, "float32"), "l1": (2, 4, True, "float32")}, "sgd", steps=0, seed=1),
)
# (save, load, outcome strict, outcome not strict)
CASES = [
    (*GROWN, "KeyError", "ok"),
    (replace(GROWN[0], optim="sgd"), replace(GROWN[1], optim="sgd"), "KeyError", "ok"),
    (*RESHAPED, "StateMismatchError", "StateMismatchError"),
    (*OPTIMIZER_GREW, "KeyError", "ok"),
]


def ranks_main(rank: int, world: int, port: int, out_dir: str, mode: str) -> None:
    """A rank of a gloo group (tests/multiproc.py): every case of :data:`CASES` in every format, the models
    given as they are (``mode`` "plain"), as DDP modules ("ddp") or sharded ("fsdp2"); writes ``ok`` or what
    went wrong to ``out_dir/rank<r>.txt``."""
    from datetime import timedelta

    import torch.distributed as dist

    from multiproc import record

    def body() -> None:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
        )
        wrap = {"plain": None, "ddp": torch.nn.parallel.DistributedDataParallel, "fsdp2": fsdp2}[mode]
        bad = []
        for fmt in FORMATS:
            for i, (save, load, *outcomes) in enumerate(CASES):
                for strict, want in zip((True, False), outcomes, strict=True):
                    out = run_case(fmt, strict, save, load, f"{out_dir}/{fmt}-{i}-{strict}", wrap)
                    if out["bad"] or out.get("error", "ok") != want:
                        bad.append((fmt, i, strict, out))
        assert not bad, bad
        dist.barrier()
        dist.destroy_process_group()

    record(out_dir, rank, body)


def stages_main(rank: int, world: int, port: int, out_dir: str, seed: int, count: int) -> None:
    """A rank of a gloo group holding its own stage of a model (as pipeline parallelism does), saved in dcp,
    then loaded ``count`` times (random: which ranks' stages are reshaped, strict or not): when any rank's
    check fails, every rank fails at once (no collective left waiting for that rank), that rank with its
    StateMismatchError, the others naming it (strict: with their own KeyError); else every rank loads."""
    import random
    import time
    from datetime import timedelta

    import torch.distributed as dist

    from ckptio.checkpointer import Checkpointer
    from ckptio.errors import CkptioError, StateMismatchError
    from multiproc import record

    def stage(n: int) -> dict:
        torch.manual_seed(rank)
        return {"model": torch.nn.ModuleDict({f"s{rank}": torch.nn.Linear(2, n)})}

    def body() -> None:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
        )
        ck = Checkpointer(f"{out_dir}/run", format="dcp", timeout=30)
        ck.save(1, stage(2))
        rng = random.Random(seed)  # the same draws on every rank
        for _ in range(count):
            reshaped = {r for r in range(world) if rng.random() < 0.4}
            strict = rng.random() < 0.3
            case = f"reshaped {sorted(reshaped)}, strict {strict}"
            start = time.monotonic()
            try:
                ck.load(stage(3 if rank in reshaped else 2), strict=strict)
                err: Exception | None = None
            except (CkptioError, KeyError) as e:
                err = e
            assert time.monotonic() - start < 20, (case, time.monotonic() - start)
            want = StateMismatchError if rank in reshaped else KeyError if strict else CkptioError if reshaped else None
            assert (None if err is None else type(err)) is want, (case, err)
            if rank in reshaped:
                assert f"s{rank}.weight has shape (2, 2) in the checkpoint, (3, 2) here" in str(err), (case, err)
            elif reshaped and not strict:
                assert all(f"rank {r} failed: StateMismatchError" in str(err) for r in reshaped), (case, err)
        ck.close()
        dist.destroy_process_group()

    record(out_dir, rank, body)


def main(seed: int, count: int) -> None:
    rng = random.Random(seed)
    for i in range(count):
        fmt, strict, save, load = draw(rng)
        case = {"fmt": fmt, "strict": strict, "save": save.__dict__, "load": load.__dict__}
        with tempfile.TemporaryDirectory() as d:
            out = run_case(fmt, strict, save, load, d + "/run")
        print("RESULT " + json.dumps({"case": i, **case, **out}, default=str), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))

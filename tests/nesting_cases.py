"""Random states of optimizers, LR schedulers, tensors and values nested in dicts, lists and tuples, saved
by a Checkpointer after two steps and loaded into the same structure built fresh: every optimizer and
scheduler restored in place, bitwise, and every value as saved.

Run as ``python nesting_cases.py SEED COUNT``: one ``RESULT`` line (JSON) per case.
"""

from __future__ import annotations

import json
import random
import sys
import tempfile
import traceback
import warnings

import torch

from mismatch_cases import same


def build(shape: list, seed: int) -> tuple[dict, torch.nn.Module, list]:
    """The state ``shape`` describes (``["dict"|"list"|"tuple", children]`` or a leaf kind), a model with a
    layer for each optimizer, and the optimizers and schedulers in the order built."""
    torch.manual_seed(seed)
    model = torch.nn.ModuleDict()
    made: list = []

    def make(node):
        if isinstance(node, list):
            kind, children = node
            items = [make(c) for c in children]
            return (
                {f"k{i}": x for i, x in enumerate(items)}
                if kind == "dict"
                else tuple(items)
                if kind == "tuple"
                else items
            )
        if node == "optim":
            layer = model[f"l{len(model)}"] = torch.nn.Linear(2, 2)
            made.append(torch.optim.AdamW(layer.parameters(), lr=0.1))
            return made[-1]
        if node == "sched" and any(isinstance(o, torch.optim.Optimizer) for o in made):
            opt = [o for o in made if isinstance(o, torch.optim.Optimizer)][-1]
            made.append(torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5))
            return made[-1]
        return torch.randn(2) if node == "tensor" else seed

    state = {"tree": make(shape)}
    if len(model):  # torch's get_model_state_dict refuses a module without tensors
        state["model"] = model
    return state, model, made


def draw(rng: random.Random, depth: int = 0) -> object:
    if depth < 3 and rng.random() < 0.6:
        return [rng.choice(["dict", "list", "tuple"]), [draw(rng, depth + 1) for _ in range(rng.randint(1, 3))]]
    return rng.choice(["optim", "optim", "sched", "tensor", "value"])


def case(shape: object, fmt: str) -> dict:
    state, model, made = build(shape, 1)
    for _ in range(2):
        if len(model):
            sum(m(torch.ones(2)).sum() for m in model.values()).backward()
        for x in made:
            x.step()
    want = [x.state_dict() for x in made]
    out: dict = {"shape": shape, "fmt": fmt, "bad": []}
    with tempfile.TemporaryDirectory() as d:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from ckptio.checkpointer import Checkpointer

            Checkpointer(d, format=fmt).save(2, state)
            state2, _, made2 = build(shape, 2)
            tree = state2["tree"]
            try:
                Checkpointer(d, format=fmt).load(state2)
            except Exception:  # noqa: BLE001 - a finding
                out["bad"].append(traceback.format_exc()[-1500:])
                return out
    for i, (x, w) in enumerate(zip(made2, want, strict=True)):
        if not same(x.state_dict(), w):
            out["bad"].append(f"{type(x).__name__} {i} not restored")
    if not _values_same(state2["tree"], state["tree"]) or _containers(state2["tree"]) != _containers(tree):
        out["bad"].append("values or containers differ")
    return out


def _values_same(a, b) -> bool:
    if isinstance(a, (torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler)):
        return type(a) is type(b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_values_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_values_same(x, y) for x, y in zip(a, b, strict=True))
    return same(a, b)


def _containers(x) -> list:
    """The ids of the state's containers and stateful objects: a load keeps them (restores in place)."""
    if isinstance(x, dict):
        return [id(x), *[i for v in x.values() for i in _containers(v)]]
    if isinstance(x, (list, tuple)):
        return [id(x) if isinstance(x, list) else None, *[i for v in x for i in _containers(v)]]
    return [id(x)] if hasattr(x, "load_state_dict") else []


def main(seed: int, count: int) -> None:
    rng = random.Random(seed)
    for i in range(count):
        fmt = rng.choice(["dcp", "pt", "fpk"])
        print("RESULT " + json.dumps({"case": i, **case(draw(rng), fmt)}, default=str), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))

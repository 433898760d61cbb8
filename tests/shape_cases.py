"""Random models saved by a Checkpointer and loaded into models of other shapes, compared with torch's own
``load_state_dict(strict=False)`` on a copy: a Checkpointer load refuses (StateMismatchError, nothing touched)
exactly what torch refuses, and otherwise leaves the model as torch's load does, bitwise. The models mix
layers torch's load checks (linear, batch norm, a 0-d parameter) with ones that load their own way (a
per-channel fake-quantizer resizing its buffers, a lazy layer not yet run).

Run as ``python shape_cases.py SEED COUNT``: one ``RESULT`` line (JSON) per case.
"""

from __future__ import annotations

import copy
import json
import random
import sys
import tempfile
import traceback
import warnings

import torch


def layer(kind: str, n: int, seed: int, run: bool) -> torch.nn.Module:
    torch.manual_seed(seed)
    if kind == "linear":
        return torch.nn.Linear(3, n)
    if kind == "norm":
        return torch.nn.BatchNorm1d(n)
    if kind == "scalar":  # 0-d when n == 1, else a vector of n
        return torch.nn.ParameterDict({"t": torch.nn.Parameter(torch.randn(()) if n == 1 else torch.randn(n))})
    if kind == "quant":
        from torch.ao.quantization import FakeQuantize, PerChannelMinMaxObserver

        fq = FakeQuantize(
            observer=PerChannelMinMaxObserver,
            quant_min=-128,
            quant_max=127,
            dtype=torch.qint8,
            qscheme=torch.per_channel_symmetric,
            ch_axis=0,
        )
        if run:
            fq(torch.randn(n, 3))
        return fq
    lazy = torch.nn.LazyLinear(n)
    if run:
        lazy(torch.ones(1, 3))
    return lazy


def model(spec: dict, seed: int, run: bool) -> torch.nn.ModuleDict:
    return torch.nn.ModuleDict({k: layer(kind, n, seed + i, run) for i, (k, (kind, n)) in enumerate(spec.items())})


def case(rng: random.Random, fmt: str) -> dict:
    kinds = ["linear", "norm", "scalar", "quant"] + (["lazy"] if fmt == "pt" else [])
    spec = {f"l{i}": (rng.choice(kinds), rng.randint(1, 3)) for i in range(rng.randint(1, 3))}
    new = {k: (kind, n if rng.random() < 0.6 else rng.randint(1, 3)) for k, (kind, n) in spec.items()}
    saved = model(spec, 0, True)
    fresh = model(new, 100, rng.random() < 0.5)
    expected = copy.deepcopy(fresh)
    try:
        expected.load_state_dict(copy.deepcopy(saved.state_dict()), strict=False)
        torch_error = None
    except RuntimeError as e:
        torch_error = str(e).splitlines()[0]
    before = copy.deepcopy(fresh.state_dict(keep_vars=True))
    out: dict = {"spec": spec, "new": new, "torch": torch_error}
    from ckptio.checkpointer import Checkpointer
    from ckptio.errors import StateMismatchError

    with tempfile.TemporaryDirectory() as d:
        Checkpointer(d, format=fmt).save(1, {"model": saved})
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                Checkpointer(d, format=fmt).load({"model": fresh}, strict=False)
            out["ckptio"] = None
        except StateMismatchError as e:
            out["ckptio"] = str(e)[:300]
        except Exception:
            out["ckptio"] = "other: " + traceback.format_exc()[-1500:]
    want = expected.state_dict(keep_vars=True) if out["ckptio"] is None else before
    got = fresh.state_dict(keep_vars=True)
    bad = (torch_error is None) != (out["ckptio"] is None) or str(out["ckptio"]).startswith("other")
    bad = bad or set(got) != set(want) or not all(_same(got[k], want[k]) for k in got)
    return {**out, "bad": bad}


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if torch.nn.parameter.is_lazy(a) or torch.nn.parameter.is_lazy(b):
        return torch.nn.parameter.is_lazy(a) and torch.nn.parameter.is_lazy(b)
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.detach(), b.detach())


def main(seed: int, count: int) -> None:
    rng = random.Random(seed)
    for i in range(count):
        fmt = rng.choice(["dcp", "pt", "fpk"])
        print("RESULT " + json.dumps({"case": i, "fmt": fmt, **case(rng, fmt)}, default=str), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))

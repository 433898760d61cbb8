"""Rank programs for the per-rank RNG tests: each rank seeds its RNGs differently, saves ``{"rng": RNGState()}``
with a Checkpointer, and later restores into a different RNG state; each writes what it drew to
``out/rank<r>.pt``."""

from __future__ import annotations

import os
import random
from datetime import timedelta
from typing import Any

import torch

import ckptio


def _draw() -> list[float]:
    import numpy as np

    return [float(torch.rand(())), random.random(), float(np.random.rand())]


def _seed(value: int) -> None:
    import numpy as np

    torch.manual_seed(value)
    random.seed(value)
    np.random.seed(value)


def save_and_load(rank: int, world: int, port: int, job: dict[str, Any]) -> None:
    """``job["save"]``: seed with ``100 + rank``, save step 0, draw (what a resume must draw again);
    ``job["load"]``: seed with ``7`` (the same on every rank), load the latest with ``strict``, draw."""
    import torch.distributed as dist

    if world > 1:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
        )
    ck = ckptio.Checkpointer(job["root"], format=job["format"], timeout=60)
    out: dict[str, Any] = {}
    if job.get("save"):
        _seed(100 + rank)
        ck.save(0, {"rng": ckptio.RNGState()})
        out["saved"] = _draw()
    if job.get("load"):
        _seed(7)
        try:
            out["loaded_step"] = ck.load({"rng": ckptio.RNGState()}, strict=job.get("strict", True))
            out["missing"] = ck.last_load.missing_keys
        except KeyError as e:
            out["error"] = str(e)
        out["loaded"] = _draw()
    torch.save(out, os.path.join(job["out"], f"rank{rank}.pt"))
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()

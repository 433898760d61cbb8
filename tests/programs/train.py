"""The training program: one rank of a job, run by :mod:`.launcher` in a forked process.

A ~500-parameter MLP with dropout, AdamW, a warmup-then-cosine LR schedule, a CPU ``GradScaler``
(``torch.amp.GradScaler("cpu")``, enabled, growing its scale every 2 steps), ``ckptio.RNGState`` and a
dataloader position (:class:`Batches`, a ``Stateful``), trained for ``steps`` steps under plain (1 rank),
DDP or FSDP2 (``fully_shard``) on gloo. Every rank seeds its RNGs differently (dropout masks and input
noise differ per rank, as in real jobs), so a resume is bitwise only if each rank gets its own RNG state
back. The loop is the README's: ``for step in range(ck.resume(state), steps)``, a save after every step.

``job`` (a dict, JSON from the test): ``parallel`` (plain/ddp/fsdp), ``format`` (None: no Checkpointer,
the uninterrupted reference), ``mode`` (sync/async/tiered/incremental), ``root``, ``tier``,
``backends`` (ckptio settings, e.g. the moto endpoint), ``steps``, ``kill_at`` and ``kill_event`` (SIGKILL
this process at the start of step ``kill_at``, or with ``kill_event`` n > 0 at the n-th storage event (a
chunk written, an object committed or deleted under root, from any thread: a sync save, an async persist,
a replication) from the save of step ``kill_at`` on, else at the end of the loop), ``action`` (``train``,
or ``load``: restore the latest checkpoint into a fresh state and report it), ``out`` (each rank writes
its final state to ``out/rank<r>.pt``).
"""

from __future__ import annotations

import os
import random
import signal
from datetime import timedelta
from typing import Any

import numpy as np
import torch

import ckptio

WORLD = {"plain": 1, "ddp": 2, "fsdp": 2}  # ranks per parallelism
D_IN, D_HID, D_OUT = 8, 16, 4
DATASET, BATCH = 20, 4  # an epoch ends within the run on 1 and on 2 ranks (a short last batch)
SEED = 1234


def build_model() -> torch.nn.Module:
    torch.manual_seed(SEED)  # the same initial weights on every rank
    return torch.nn.Sequential(
        torch.nn.Linear(D_IN, D_HID),
        torch.nn.ReLU(),
        torch.nn.Dropout(0.2),
        torch.nn.Linear(D_HID, D_HID),
        torch.nn.ReLU(),
        torch.nn.Linear(D_HID, D_OUT),
    )


class Batches:
    """A dataloader position as a ``Stateful``: a fixed dataset, reshuffled each epoch (by epoch number,
    not by a global RNG), this rank's shard of it, and where in it the next batch starts."""

    def __init__(self, rank: int, world: int) -> None:
        g = torch.Generator().manual_seed(SEED + 1)
        self.x = torch.randn(DATASET, D_IN, generator=g)
        self.y = torch.randn(DATASET, D_OUT, generator=g)
        self.rank, self.world = rank, world
        self.epoch, self.pos = 0, 0

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        order = torch.randperm(DATASET, generator=torch.Generator().manual_seed(SEED + 100 + self.epoch))
        shard = order[self.rank :: self.world]
        idx = shard[self.pos : self.pos + BATCH]
        self.pos += BATCH
        if self.pos >= len(shard):
            self.epoch, self.pos = self.epoch + 1, 0
        return self.x[idx], self.y[idx]

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.epoch, self.pos = int(sd["epoch"]), int(sd["pos"])


def seed_rank(rank: int, base: int = SEED) -> None:
    torch.manual_seed(base + 1000 + rank)
    random.seed(base + 2000 + rank)
    np.random.seed(base + 3000 + rank)


def make_state(parallel: str, rank: int, world: int, steps: int) -> dict[str, Any]:
    model = build_model()
    if parallel == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    elif parallel == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        fully_shard(model)
    elif parallel != "plain":
        raise ValueError(f"parallel: {parallel!r}")
    optim = torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.01)
    warmup = torch.optim.lr_scheduler.LinearLR(optim, start_factor=0.25, total_iters=2)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(optim, T_max=steps)
    sched = torch.optim.lr_scheduler.SequentialLR(optim, [warmup, cosine], milestones=[2])
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    return {
        "model": model,
        "optim": optim,
        "sched": sched,
        "scaler": scaler,
        "rng": ckptio.RNGState(),
        "data": Batches(rank, world),
        "trainer": {"step": 0},
    }


def train_step(state: dict[str, Any]) -> float:
    model, optim, scaler = state["model"], state["optim"], state["scaler"]
    x, y = state["data"].next()
    # input noise from all three RNGs RNGState holds
    x = x + torch.randn_like(x) * 0.05 * random.random() + torch.from_numpy(np.random.normal(0, 0.01, x.shape)).float()
    loss = torch.nn.functional.mse_loss(model(x), y)
    optim.zero_grad(set_to_none=True)
    scaler.scale(loss).backward()
    scaler.step(optim)
    scaler.update()
    state["sched"].step()
    return float(loss.detach())


def checkpointer(job: dict[str, Any]) -> ckptio.Checkpointer:
    mode = job["mode"]
    return ckptio.Checkpointer(
        job["root"],
        format=job["format"],
        keep_last=2,
        async_save=mode == "async",
        local_tier=job["tier"] if mode == "tiered" else None,
        incremental=mode == "incremental",
        timeout=60,
    )


def full_state(state: dict[str, Any]) -> dict[str, Any]:
    """The state to compare: full (unsharded) model and optimizer state dicts, the rest as they are."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    opts = StateDictOptions(full_state_dict=True, cpu_offload=dist.is_initialized())
    model, optim = state["model"], state["optim"]
    return {
        "model": get_model_state_dict(model, options=opts),
        "optim": get_optimizer_state_dict(model, optim, options=opts),
        "sched": state["sched"].state_dict(),
        "scaler": state["scaler"].state_dict(),
        "rng": state["rng"].state_dict(),
        "data": state["data"].state_dict(),
        "trainer": dict(state["trainer"]),
    }


def main(rank: int, world: int, port: int, job: dict[str, Any]) -> None:
    import torch.distributed as dist

    if job.get("backends"):
        ckptio.configure(backends=job["backends"])
    if world > 1:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=60),
        )
    steps = job["steps"]
    state = make_state(job["parallel"], rank, world, steps)
    out: dict[str, Any] = {}
    if job["action"] == "load":
        seed_rank(rank, base=SEED + 7)  # not the run's: the load must bring everything back
        out["loaded"] = checkpointer(job).load(state)
    else:
        seed_rank(rank)
        ck = None if job["format"] is None else checkpointer(job)
        start = 0 if ck is None else ck.resume(state)
        out["resumed_at"] = start
        losses = {}
        kill_at, kill_event = job.get("kill_at"), job.get("kill_event", 0)
        for step in range(start, steps):
            if step == kill_at and not kill_event:
                os.kill(os.getpid(), signal.SIGKILL)
            losses[step] = train_step(state)
            state["trainer"]["step"] = step
            if step == kill_at:
                arm(job, rank, kill_event)
            if ck is not None:
                ck.save(step, state, metrics={"loss": losses[step]})
        if kill_at is not None and kill_event:
            os.kill(os.getpid(), signal.SIGKILL)  # the n-th event did not come
        if ck is not None:
            ck.wait()
        out["losses"] = losses
    out.update(full_state(state))
    torch.save(out, os.path.join(job["out"], f"rank{rank}.pt"))
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


def arm(job: dict[str, Any], rank: int, n: int) -> None:
    """SIGKILL this process at the n-th storage event under root from now on (events logged to
    ``out/events<rank>.jsonl``)."""
    from test_checkpointer_crash import Events

    backend, _ = ckptio.resolve(job["root"])
    Events(type(backend), n, os.path.join(job["out"], f"events{rank}.jsonl"))


def warm_up() -> None:
    """Import and run once what a rank uses (torch's lazy imports take seconds), in the launcher before it
    forks, on one thread (no OpenMP pool exists to be lost in a forked child)."""
    import torch.distributed.checkpoint
    import torch.distributed.checkpoint.state_dict
    import torch.distributed.fsdp  # noqa: F401

    import ckptio.backends.s3
    import ckptio.checkpointer
    import ckptio.dcp  # noqa: F401
    import test_checkpointer_crash  # noqa: F401

    state = make_state("plain", 0, 1, 4)
    train_step(state)
    full_state(state)

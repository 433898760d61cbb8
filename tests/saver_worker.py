"""One saver of an incremental root, run as its own process by test_two_savers.

``python saver_worker.py JSON`` with keys:

- ``root``; ``backends`` (optional: ``ckptio.configure(backends=...)``); ``steps`` (saved in order);
  ``saver``: whose state (:func:`state`) it saves; ``format`` (default ``fpk``);
- ``hold`` (optional ``[held, go]``): at its first commit marker, create the file ``held``, wait for ``go``;
- ``wait_for`` (optional): a file to wait for before the first save; ``done`` (optional): a file created
  once every save returned;
- ``jitter`` (optional seed): each storage call sleeps 0-3 ms first, so savers interleave differently;
- ``saved`` (optional): a file each step is appended to with ``ok`` or the name of the ckptio error its
  save raised (without it, the error ends the process; any other error always does).
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
import warnings

import torch

import ckptio
from ckptio.backends.local import LocalBackend
from ckptio.checkpointer import Checkpointer
from ckptio.checkpointer.manifest import Layout
from ckptio.errors import CkptioError

SHARED = 4  # 256 KiB tensors every step holds (stored once)


def state(step: int, saver: int = 0) -> dict:
    """What saver ``saver`` saves as ``step``: shared tensors, and a head of its own."""
    g = torch.Generator().manual_seed(1000)
    model = {f"frozen.{i}": torch.randn(256, 256, generator=g) for i in range(SHARED)}
    model["head"] = torch.randn(128, 128, generator=torch.Generator().manual_seed(step * 100 + saver))
    return {"model": model, "trainer": {"step": step}}


def wait_for(path: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.005)


def touch(path: str) -> None:
    with open(path, "w"):
        pass


def hold_first_commit(held: str, go: str) -> None:
    real = Layout.commit

    def commit(self, step, manifest):
        if not os.path.exists(held):
            touch(held)
            wait_for(go)
        return real(self, step, manifest)

    Layout.commit = commit  # type: ignore[method-assign]


def jitter(seed: int) -> None:
    rng = random.Random(seed)
    for name in ("open_writer", "write", "delete", "rmtree", "list", "stat"):
        real = getattr(LocalBackend, name)

        def call(self, *a, _real=real, **kw):
            time.sleep(rng.random() * 0.003)
            return _real(self, *a, **kw)

        setattr(LocalBackend, name, call)


def main() -> None:
    job = json.loads(sys.argv[1])
    warnings.simplefilter("ignore")
    if job.get("backends"):
        ckptio.configure(backends=job["backends"])
    if job.get("hold"):
        hold_first_commit(*job["hold"])
    if job.get("jitter") is not None:
        jitter(job["jitter"])
    if job.get("wait_for"):
        wait_for(job["wait_for"])
    ck = Checkpointer(job["root"], format=job.get("format", "fpk"), incremental=True)
    for step in job["steps"]:
        try:
            ck.save(step, state(step, job.get("saver", 0)))
            outcome = "ok"
        except CkptioError as e:  # another saver's save of this step won (any other error fails the process)
            if not job.get("saved"):
                raise
            outcome = type(e).__name__
        if job.get("saved"):
            with open(job["saved"], "a") as f:
                f.write(f"{step} {outcome}\n")
    if job.get("done"):
        touch(job["done"])


if __name__ == "__main__":
    main()

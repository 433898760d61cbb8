"""A fuzzer of savers of one root (run by test_two_savers in a child).

``python savers_fuzz.py SECONDS [SEED] [shared|distinct]``: for SECONDS, rounds of two or three
Checkpointers (``pt`` or ``fpk``, incremental or not; ``distinct``: or tiered, sharing one local tier)
on a fresh root, each in its own thread (a saver of its own: each Checkpointer knows only its own
saves), saving random steps of a small pool: ``shared`` (the default), most steps saved by several of
them; ``distinct``, each step by one. Every storage call sleeps 0-2 ms and every commit marker waits
0-20 ms, so one's save starts while another's is about to commit. In some rounds one saver dies right
after clearing the way for one of its steps (it raises, writing nothing more). Every save either
commits or raises a ckptio error on a step another saver saves too (the first marker wins); every
committed step loads bitwise as one of the savers that saved it. Prints ``checked N rounds``.
"""

from __future__ import annotations

import random
import shutil
import sys
import tempfile
import threading
import time
import warnings

import torch

from ckptio.backends.local import LocalBackend
from ckptio.checkpointer import Checkpointer
from ckptio.checkpointer.manifest import Layout
from ckptio.errors import CkptioError
from saver_worker import state

local = threading.local()  # per saver thread: its rng, and after which preparation it dies


class Died(BaseException):
    """A saver killed between clearing the way for a step and writing it."""


def hooks() -> None:
    def slowed(real):
        def call(self, *a, **kw):
            rng = getattr(local, "rng", None)
            if rng is not None:
                time.sleep(rng.random() * 0.002)
            return real(self, *a, **kw)

        return call

    for name in ("open_writer", "write", "delete", "rmtree", "list", "stat"):
        setattr(LocalBackend, name, slowed(getattr(LocalBackend, name)))
    real_commit, real_prepare = Layout.commit, Checkpointer._prepare

    def commit(self, *a, **kw):
        rng = getattr(local, "rng", None)
        if rng is not None:
            time.sleep(rng.random() * 0.02)
        return real_commit(self, *a, **kw)

    def prepare(self, *a, **kw):
        real_prepare(self, *a, **kw)
        local.prepared = getattr(local, "prepared", 0) + 1
        if local.prepared == getattr(local, "die_after", None):
            raise Died

    Layout.commit, Checkpointer._prepare = commit, prepare  # type: ignore[method-assign]


def one(rng: random.Random, root: str, shared: bool) -> None:
    n, fmt, incremental = rng.choice([2, 3]), rng.choice(["pt", "fpk"]), rng.random() < 0.5
    tier = None if shared or incremental or rng.random() < 0.5 else f"{root}-tier"
    pool = rng.sample(range(1, 10), 3 * n)
    steps = [sorted(rng.sample(range(1, 7), 3)) if shared else sorted(pool[i::n]) for i in range(n)]
    victim = rng.randrange(n) if rng.random() < 0.5 else None
    die_after = rng.randrange(1, 4)
    outcomes: list[dict[int, str]] = [{} for _ in range(n)]
    seeds = [rng.randrange(1 << 30) for _ in range(n)]

    def saver(i: int) -> None:
        local.rng, local.prepared = random.Random(seeds[i]), 0
        local.die_after = die_after if i == victim else None
        ck = Checkpointer(root, format=fmt, incremental=incremental, local_tier=tier)  # content_grace: one hour
        try:
            for step in steps[i]:
                try:
                    ck.save(step, state(step, i))
                    outcomes[i][step] = "ok"
                except Died:
                    outcomes[i][step] = "died"
                    return
                except CkptioError as e:
                    outcomes[i][step] = type(e).__name__
                except BaseException as e:  # noqa: BLE001 - reported below
                    outcomes[i][step] = f"raw {type(e).__name__}: {e}"
            ck.wait()  # tiered: replicated
        except BaseException as e:  # noqa: BLE001 - reported below
            outcomes[i][-1] = f"raw {type(e).__name__}: {e}"
        finally:
            ck.close()

    threads = [threading.Thread(target=saver, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    savers = {s: [i for i in range(n) if s in steps[i]] for s in range(1, 10)}
    case = f"{fmt} incremental={incremental} tier={tier} steps={steps} victim={victim} after={die_after} {outcomes}"
    for mine in outcomes:
        for step, outcome in mine.items():
            assert outcome in ("ok", "died") or (len(savers.get(step, ())) > 1 and "raw" not in outcome), case
    committed = Checkpointer(root).list()
    for step, mine in ((s, [i for i in savers[s] if outcomes[i].get(s) == "ok"]) for s in savers):
        assert step in committed or not mine, f"step {step} saved by {mine} is not committed: {case}"
    for where in [root] + ([tier] if tier else []):  # the local tier: what eviction left
        committed = Checkpointer(where).list()
        for step in committed:
            got: dict = {"model": {}, "trainer": {}}
            try:
                assert Checkpointer(where).load(got, step=step, strict=False) == step
            except Exception as e:
                raise AssertionError(f"{where}: committed step {step} does not load ({e!r}): {case}") from e
            wants = [state(step, i)["model"] for i in savers[step]]
            assert any(all(torch.equal(got["model"][k], v) for k, v in w.items()) for w in wants), (step, case)


def main() -> None:
    seconds = float(sys.argv[1])
    seed = int(sys.argv[2]) if len(sys.argv) > 2 else random.randrange(1 << 30)
    shared = (sys.argv[3] if len(sys.argv) > 3 else "shared") == "shared"
    rng = random.Random(seed)
    warnings.simplefilter("ignore")
    hooks()
    tmp = tempfile.mkdtemp(prefix="savers-fuzz-")
    count, deadline = 0, time.monotonic() + seconds
    try:
        while time.monotonic() < deadline or count < 2:
            try:
                one(rng, f"{tmp}/r{count}", shared)
            except BaseException:
                print(f"seed {seed} round {count} failed", flush=True)
                raise
            count += 1
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"checked {count} rounds (seed {seed})")


if __name__ == "__main__":
    main()

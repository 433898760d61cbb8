"""gloo rank groups for the multi-process tests (forked from a forkserver), each group under a deadline."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import traceback

import torch.multiprocessing as mp

import zygote
from servers import free_port

TIMEOUT = 120


def run_ranks(fn, world: int, *args, timeout: float = TIMEOUT) -> None:
    """Start ``world`` ranks of ``fn(rank, world, port, *args)``; kill them all after ``timeout`` seconds.

    The ranks are forked from the forkserver of :mod:`zygote` (torch imported once per test process; a
    spawned rank spent ~3 s importing it on the cores the other test worker needs). Each rank takes the
    parent's environment as it is at the call (the forkserver's is the one it started with)."""
    zygote.context()
    ctx = mp.start_processes(
        _rank_main,
        args=(dict(os.environ), fn, world, free_port(), *args),
        nprocs=world,
        join=False,
        start_method="forkserver",
    )
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{fn.__name__} on {world} ranks did not finish within {timeout}s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()


def _rank_main(rank: int, env: dict, fn, *args) -> None:
    """``fn(rank, *args)``; once it has returned, the rank exits without the interpreter's teardown.

    A rank's result is in by then (asserted in ``fn`` or written to its file). In the teardown, a gloo
    process group that a device mesh still references is destroyed, and gloo aborted there now and then
    (SIGABRT, "terminate called without an active exception", about 1 run in 25 of a DCP test), which
    failed a test whose ranks had all passed. An exception from ``fn`` takes the usual way out (torch
    reports it to the parent). Threads the rank left running are ended first, as at an exit: the
    interpreter's own step for that (it stops idle pool workers, then joins every non-daemon thread)."""
    os.environ.clear()
    os.environ.update(env)
    fn(rank, *args)
    threading._shutdown()  # type: ignore[attr-defined]  # what Py_Finalize calls first
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def results(out_dir: str, world: int) -> list[str]:
    """What each rank wrote to ``out_dir/rank<r>.txt``."""
    out = []
    for r in range(world):
        with open(os.path.join(out_dir, f"rank{r}.txt")) as f:
            out.append(f.read())
    return out


def record(out_dir: str, rank: int, fn, *args) -> None:
    """Run ``fn(*args)`` and write ``ok`` or its traceback to ``out_dir/rank<r>.txt`` (see :func:`results`)."""
    result = "ok"
    try:
        fn(*args)
    except BaseException:
        result = traceback.format_exc()
    with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as f:
        f.write(result)


def forked(body, timeout: float) -> bool:
    """Run ``body()`` in a forked child (exit 0; 1 with the traceback printed when it raises); wait up to
    ``timeout`` seconds. Returns whether the child was SIGKILLed; any other failure raises."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            body()
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    deadline = time.monotonic() + timeout
    while not (got := os.waitpid(pid, os.WNOHANG))[0]:
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise TimeoutError(f"forked child did not finish within {timeout}s")
        time.sleep(0.005)
    status = got[1]
    killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    assert killed or (os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0), f"child failed: status {status}"
    return killed

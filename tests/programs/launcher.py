"""The job launcher: one process per test session that imports torch and ckptio once, then forks the ranks
of each job (a fork costs milliseconds; a fresh interpreter importing torch costs seconds per rank).

Protocol: one JSON job per line on stdin: ``entry`` (``module:function``, called as ``function(rank, world,
port, job)`` in each rank, ``port`` free for the job's TCP store), ``world``, ``timeout``, ``out`` (a
directory) and what the entry reads (:mod:`.train`'s keys); one JSON reply per line on stdout:
``{"codes": [per rank: exit code, or -signal], "ended": [ranks the launcher killed], "seconds": ...}``.
A job whose rank is SIGKILLed is torn down (its other ranks SIGKILLed), as a cluster scheduler ends a
job that lost a process; a rank that fails ends the job too; past ``timeout`` every rank is killed and
the reply says ``"timeout": true``. Each rank's stdout and stderr go to ``out/rank<r>.log``.

The launcher forks only while it runs one thread, with torch on one thread (``warm_up``), so a child
inherits no lock held by a thread that does not exist in it.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
import time
import traceback


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, port: int, job: dict) -> None:
    """In the forked child: run the rank, exit without the interpreter's teardown."""
    code = 1
    try:
        fd = os.open(os.path.join(job["out"], f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
        sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)
        import importlib

        module, name = job["entry"].split(":")
        getattr(importlib.import_module(module), name)(rank, world, port, job)
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _status(status: int) -> int:
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def run_job(job: dict) -> dict:
    world, port = job["world"], free_port()
    if threading.active_count() != 1:
        raise RuntimeError(f"the launcher must fork with one thread, it runs {threading.enumerate()}")
    t0 = time.monotonic()
    pids: dict[int, int] = {}
    for rank in range(world):
        pid = os.fork()
        if pid == 0:
            _rank(rank, world, port, job)
        pids[pid] = rank
    codes: list[int | None] = [None] * world
    ended: list[int] = []  # the ranks the launcher killed

    def end_the_rest() -> None:
        for p, r in pids.items():
            if codes[r] is None and r not in ended:
                os.kill(p, signal.SIGKILL)
                ended.append(r)

    def reap() -> bool:
        """Record every rank that has ended; whether one failed."""
        failed = False
        while None in codes and (got := os.waitpid(-1, os.WNOHANG))[0]:
            codes[pids[got[0]]] = _status(got[1])
            failed = failed or codes[pids[got[0]]] != 0
        return failed

    deadline = t0 + job["timeout"]
    timed_out = False
    while None in codes:
        if reap():  # the job lost a rank: end the others, once a peer that died first is reaped too
            time.sleep(0.05)
            reap()
            end_the_rest()
            continue
        if time.monotonic() > deadline and not timed_out:
            timed_out = True
            end_the_rest()
        time.sleep(0.005)
    return {"codes": codes, "ended": sorted(ended), "seconds": round(time.monotonic() - t0, 3), "timeout": timed_out}


def main() -> None:
    import torch

    torch.set_num_threads(1)
    from programs import train

    train.warm_up()
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        print(json.dumps(run_job(json.loads(line))), flush=True)


if __name__ == "__main__":
    main()

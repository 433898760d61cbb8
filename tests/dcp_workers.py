"""Child-process code for the DCP tests: spawned gloo ranks, save-then-SIGKILL scripts and racing saves.

Kept out of the test modules so children import only this (not pytest fixtures). Run as a
script for the crash tests: ``python dcp_workers.py crash POINT URI [OVERWRITE]``, for the
race tests: ``python dcp_workers.py race SYNC_DIR JSON_ARGS`` (see :func:`race`), and for crafted
checkpoints: ``python dcp_workers.py load_capped JSON_ARGS`` (see :func:`load_capped`).
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys
import time
import traceback
import warnings

import torch

warnings.filterwarnings("ignore", message="torch.distributed is disabled")

ROWS, COLS = 11, 6  # 11 rows: uneven shards over 2 and 3 ranks


def full_state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(ROWS, COLS, generator=g),
        "b": torch.arange(ROWS * 2, dtype=torch.int64),
        "h": torch.randn(ROWS, 3, generator=g).to(torch.bfloat16),
    }


def _configure(backends: dict | None) -> None:
    """Route remote schemes to the parent's test servers (``ckptio.configure(backends=...)`` options)."""
    if backends:
        import ckptio

        ckptio.configure(backends=backends)


def _init(rank: int, world: int, port: int):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    return init_device_mesh("cpu", (world,))


def _sharded(mesh, state: dict[str, torch.Tensor]):
    from torch.distributed.tensor import Shard, distribute_tensor

    return {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in state.items()}


def save_rank(
    rank: int, world: int, port: int, uri: str, backends: dict | None, fail_rank: int | None, result_dir: str
) -> None:
    """Save ``full_state(1)`` sharded over ``world`` ranks; with ``fail_rank``, that rank's second data object fails."""

    import ckptio.dcp as cd

    _configure(backends)
    mesh = _init(rank, world, port)
    try:
        if fail_rank == rank:
            _fail_on_object(f"__{rank}_1.")
        sd = _sharded(mesh, full_state(1))
        sd["extra"] = {"step": 7, "rank_count": world}
        outcomes = []
        two = {"thread_count": 2, "min_object_bytes": 1}  # two data objects per rank, however small
        saves = [lambda: cd.save(sd, uri, **two)]
        if fail_rank is not None:  # torch's own save with ckptio's writer too
            import torch.distributed.checkpoint as dcp

            saves.insert(0, lambda: dcp.save(sd, storage_writer=cd.StorageWriter(uri, **two)))
        for save in saves:
            try:
                save()
                outcomes.append("ok")
            except BaseException as e:  # CheckpointException is a BaseException
                outcomes.append(f"{type(e).__name__}\n{''.join(traceback.format_exception(e))}")
        with open(os.path.join(result_dir, f"rank{rank}.txt"), "w") as f:
            f.write("\n=====\n".join(outcomes))
    finally:
        _shutdown()


def load_rank(rank: int, world: int, port: int, uri: str, backends: dict | None, result_dir: str) -> None:
    """Load into ``world`` Shard(0) DTensors and compare the local shards exactly with ``full_state(1)``."""

    import ckptio.dcp as cd

    _configure(backends)
    mesh = _init(rank, world, port)
    try:
        expected = _sharded(mesh, full_state(1))
        sd = {k: _sharded(mesh, {k: torch.zeros_like(v)})[k] for k, v in full_state(1).items()}
        sd["extra"] = {"step": 0, "rank_count": 0}
        cd.load(sd, uri)
        bad = [k for k in expected if not torch.equal(sd[k].to_local(), expected[k].to_local())]
        if sd["extra"] != {"step": 7, "rank_count": 2}:
            bad.append(f"extra={sd['extra']}")
        with open(os.path.join(result_dir, f"rank{rank}.txt"), "w") as f:
            f.write("ok" if not bad else f"mismatch {bad}")
    except BaseException:
        with open(os.path.join(result_dir, f"rank{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
    finally:
        _shutdown()


def _describe(e: BaseException) -> dict:
    """What a rank saw, as JSON: torch's ``CheckpointException`` gives each failed rank's error, as pickled to us."""
    failures = getattr(e, "failures", None)
    if failures is not None:
        return {"type": type(e).__name__, "failures": {str(r): _describe(x) for r, (x, _tb) in failures.items()}}
    return {
        "type": type(e).__name__,
        "errno": getattr(e, "errno", None),
        "uri": getattr(e, "uri", None),
        "str": str(e),
        "notes": getattr(e, "__notes__", []),
    }


def refused_rank(rank: int, world: int, port: int, uri: str, result_dir: str) -> None:
    """Save, then a second save without ``overwrite`` (refused on the coordinator) and a load with rank 1's data
    objects deleted (fails on rank 1), each through torch's function and ckptio's; what each rank saw, as JSON."""
    import json

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import ckptio.dcp as cd

    mesh = _init(rank, world, port)
    outcomes: dict = {}
    try:
        sd = _sharded(mesh, full_state(1))
        cd.save(sd, uri, thread_count=2)
        attempts = {
            "torch_save": lambda: dcp.save(sd, storage_writer=cd.StorageWriter(uri, thread_count=2)),
            "ckptio_save": lambda: cd.save(sd, uri, thread_count=2),
            "torch_load": lambda: dcp.load(sd, storage_reader=cd.StorageReader(uri)),
            "ckptio_load": lambda: cd.load(sd, uri),
        }
        for name, attempt in attempts.items():
            if name == "torch_load":
                dist.barrier()
                if rank == 0:
                    for f in os.listdir(uri):
                        if f.startswith(f"__{world - 1}_"):
                            os.remove(os.path.join(uri, f))
                dist.barrier()
            try:
                attempt()
                outcomes[name] = "ok"
            except BaseException as e:  # CheckpointException is a BaseException
                outcomes[name] = _describe(e)
    except BaseException:
        outcomes["crash"] = traceback.format_exc()
    finally:
        with open(os.path.join(result_dir, f"rank{rank}.txt"), "w") as f:
            json.dump(outcomes, f)
        _shutdown()


def _shutdown() -> None:
    """Leave together: a rank that tears gloo down while a peer is still in a collective can abort
    (the rank then exits without the interpreter's teardown: ``multiproc.run_ranks``)."""
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()


def _fail_on_object(prefix: str) -> None:
    from ckptio.backends import local

    original = local.LocalWriter.write

    def write(self, data):
        if os.path.basename(self._path).startswith(prefix):
            raise OSError(5, "injected I/O error")
        return original(self, data)

    local.LocalWriter.write = write


# ---- crash scripts: save, SIGKILL ourselves at POINT -----------------------------------------


def big_state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"t{i}": torch.randn(64, 1024, generator=g) for i in range(8)}  # 8 x 256 KiB


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def crash(point: str, uri: str, overwrite: bool) -> None:
    import ckptio.dcp as cd
    from ckptio.backends import local

    if point == "data":  # after a few data writes, mid-object
        original = local.LocalWriter.write
        count = [0]

        def write(self, data):
            if self._path.endswith(".distcp"):
                count[0] += 1
                if count[0] == 5:
                    _die()
            return original(self, data)

        local.LocalWriter.write = write
    elif point == "before_metadata":  # every data object committed, no metadata yet
        cd.StorageWriter.finish = lambda self, metadata, results: _die()
    elif point == "before_uncommit":  # the coordinator checked the old checkpoint but did not delete it yet
        original_delete = local.LocalBackend.delete

        def delete(self, uri):
            if uri.endswith(cd.METADATA_NAME):
                _die()
            return original_delete(self, uri)

        local.LocalBackend.delete = delete
    else:
        raise SystemExit(f"unknown crash point {point}")
    cd.save(big_state(2), uri, thread_count=2, min_object_bytes=1, overwrite=overwrite)  # two data objects
    raise SystemExit("the save finished but should have been killed")


# ---- racing saves: two processes save to one URI ---------------------------------------------


def _wait_for(path: str, timeout: float = 60.0, pause: float = 0.001) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"gave up waiting for {path}")
        if pause:
            time.sleep(pause)


def _touch(path: str) -> None:
    with open(path, "w"):
        pass


def _interleave(sync: str, me: str, other: str) -> None:
    """Force the order: ``first`` writes its data, ``second`` writes its data, ``first`` commits, ``second`` commits."""
    import ckptio.dcp as cd

    write_data, finish = cd.StorageWriter.write_data, cd.StorageWriter.finish

    def gated_write(self, plan, planner):
        if me == "second":
            _wait_for(os.path.join(sync, "first-written"))
        return write_data(self, plan, planner)

    def gated_finish(self, metadata, results):
        _touch(os.path.join(sync, f"{me}-written"))
        _wait_for(os.path.join(sync, f"{other}-written"))
        if me == "second":
            _wait_for(os.path.join(sync, "first-done"))
        try:
            return finish(self, metadata, results)
        finally:
            _touch(os.path.join(sync, f"{me}-done"))

    cd.StorageWriter.write_data, cd.StorageWriter.finish = gated_write, gated_finish


def race(sync: str, args: dict) -> None:
    """One racer. ``args``: kind ("dcp" or "checkpointer"), uri, seed (its state is ``big_state(seed)``),
    role ("free": start at the shared barrier and run; "first"/"second": :func:`_interleave`),
    overwrite, backends. Writes ``result-<seed>``: "ok", or the exception's type and message."""
    import ckptio.dcp as cd
    from ckptio.checkpointer import Checkpointer

    warnings.simplefilter("ignore")
    _configure(args.get("backends"))
    seed, uri = args["seed"], args["uri"]
    state = big_state(seed)
    cd.save({"warm": torch.ones(4)}, f"{uri}-warm-{seed}")  # import and connect before the start line
    if args["role"] != "free":
        _interleave(sync, args["role"], "second" if args["role"] == "first" else "first")
    _touch(os.path.join(sync, f"ready-{seed}"))
    _wait_for(os.path.join(sync, f"ready-{3 - seed}"))  # sleeping: a spin here slows the other's start-up
    _wait_for(os.path.join(sync, "go"), pause=0)  # spin: both racers leave the start line together
    try:
        if args["kind"] == "checkpointer":
            Checkpointer(uri).save(1, {"model": state})
        else:
            cd.save(state, uri, thread_count=2, overwrite=args.get("overwrite", False))
        outcome = "ok"
    except Exception as e:
        outcome = f"{type(e).__name__}: {e}"
    with open(os.path.join(sync, f"result-{seed}"), "w") as f:
        f.write(outcome)


def load_capped(args: dict) -> None:
    """Load (crafted) checkpoints with the address space capped; print what happened to each as one JSON line.

    ``args``: ``jobs``, each with ``uri``, ``state`` (a ``torch.save`` file holding the state dict to
    load into), ``kind`` (``ckptio``: ``ckptio.dcp.load``; ``torch``: torch's ``dcp.load`` with
    ckptio's reader; ``checkpointer``: ``Checkpointer(root).load(step=uri)``; ``verify``: what
    ``ckptio verify`` runs) and ``options`` for it; ``backends``; ``headroom``: bytes of address space
    allowed beyond what the process uses once set up, so that a huge allocation fails here instead
    of exhausting the machine.
    """
    import resource

    import torch.distributed.checkpoint as dcp

    import ckptio
    import ckptio.dcp as cd
    from ckptio.checkpointer import Checkpointer

    _configure(args.get("backends"))
    jobs = args["jobs"]
    for job in jobs:
        job["state"] = torch.load(job["state"], weights_only=False)  # the test's own files
        ckptio.exists(job["uri"])  # set up backends (clients, threads) before the cap
    with open("/proc/self/statm") as f:
        used = int(f.read().split()[0]) * resource.getpagesize()
    limit = used + args.get("headroom", 2 << 30)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    outcomes = []
    for job in jobs:
        state, uri, opts = job["state"], job["uri"], job.get("options", {})
        try:
            if job["kind"] == "ckptio":
                cd.load(state, uri, **opts)
            elif job["kind"] == "torch":
                dcp.load(state, storage_reader=cd.StorageReader(uri, **opts))
            elif job["kind"] == "verify":
                cd.verify(uri)
            else:
                Checkpointer(job["root"]).load(state, step=uri, **opts)
            outcomes.append({"outcome": "ok", "types": []})
        except BaseException as e:  # noqa: BLE001 - CheckpointException is a BaseException
            outcomes.append({"outcome": f"{type(e).__name__}: {e}", "types": [t.__name__ for t in type(e).__mro__]})
        del state, job["state"]
    print(json.dumps(outcomes), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "load_capped":
        load_capped(json.loads(sys.argv[2]))
    elif sys.argv[1] == "crash":
        crash(sys.argv[2], sys.argv[3], len(sys.argv) > 4 and sys.argv[4] == "overwrite")
    elif sys.argv[1] == "race":
        race(sys.argv[2], json.loads(sys.argv[3]))

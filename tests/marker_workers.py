"""A child process that damages one marker, pointer, recipe or cache entry's metadata and runs one
operation on what holds it, with its memory capped.

``python marker_workers.py JOBS.json`` runs each job after setting ``RLIMIT_AS`` to what the process
uses once warmed up plus ``headroom``, each under a wall-clock ``alarm``, and prints one ``RESULT`` JSON
line per job: the outcome (``ok``; ``ckptio``: a ckptio error; ``timeout``; or the exception's type
name), its message, the warnings raised, and how far the peak RSS grew during the operation (its setup
excluded). :func:`run_jobs` is the parent's side.

A job: ``target`` (what is damaged, :data:`TARGETS`), ``op`` (:data:`OPS`), ``where`` (``local``,
``memory``, ``s3``: the root's storage), ``fmt`` (``pt``, ``fpk``, ``dcp``), ``incremental``, and
``mutation``, which says what the target holds afterwards (:func:`mutated`).
"""

from __future__ import annotations

import base64
import json
import os
import signal
import sys
import tempfile
import uuid
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import zygote  # noqa: E402

TARGETS = (
    "latest.txt",  # the latest pointer of a root with steps 1 and 2
    "checkpoint.json",  # the marker of step 2, the latest
    "checkpoint.json@1",  # the marker of step 1 (retention reads it for keep_best)
    "kept.json",  # step 1 kept by name
    "tier.json",  # a local tier's binding
    "recipe",  # the data file of step 2 of an incremental root
    "cache-meta",  # a node-cache entry's metadata
    "cosmos-pointer",  # a Cosmos root's latest_checkpoint.txt
    "cosmos-names",  # a Cosmos root's step 10, and step files named with other digits beside it
)
OPS = ("load", "load_model", "save", "is_complete", "catalog", "info", "cached_load")


def run_jobs(
    jobs: list[dict], s3: dict | None = None, headroom: int = 768 << 20, alarm: int = 30, timeout: float = 600
) -> list[dict]:
    """Run ``jobs`` in one capped child (``s3``: its S3 settings); the result of each, in order."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"jobs": jobs, "headroom": headroom, "alarm": alarm, "s3": s3}, f)
    try:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "MALLOC_ARENA_MAX": "2"}
        proc = zygote.run([sys.executable, __file__, f.name], timeout=timeout, env=env)
    finally:
        os.unlink(f.name)
    results = [json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and len(results) == len(jobs), (
        proc.returncode,
        proc.stdout[-2000:],
        proc.stderr[-4000:],
    )
    return results


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


# ---- the child ---------------------------------------------------------------------------------
def mutated(original: bytes, m: dict) -> bytes:
    """What the target holds after mutation ``m`` of its ``original`` bytes (a recipe keeps its magic:
    without it, it is a data file, not a recipe)."""
    from ckptio.incremental import MAGIC

    magic = MAGIC if original.startswith(MAGIC) else b""
    text = original[len(magic) :]
    if "bytes" in m:
        return magic + base64.b64decode(m["bytes"])
    if "fill" in m:
        unit = base64.b64decode(m["fill"])
        whole, rest = divmod(m["size"], len(unit))
        return magic + (unit * whole + unit[:rest] if rest else unit * whole)
    if "deep" in m:
        return magic + b"[" * m["deep"] + b"]" * m["deep"]
    if "blocks" in m:  # a recipe of that many blocks, none of them stored
        blocks = [[f"{i:032x}", 1 << 20] for i in range(m["blocks"])]
        return MAGIC + json.dumps({"hash": "xxh3_128", "size": len(blocks) << 20, "blocks": blocks}).encode()
    if "truncate" in m:
        return magic + text[: m["truncate"] % max(1, len(text))]
    if "flip" in m:
        i = m["flip"] % max(1, len(text))
        return magic + text[:i] + bytes([text[i] ^ m.get("mask", 1)]) + text[i + 1 :]
    body = json.loads(text)
    if "claim" in m:  # a recipe's last block claims more bytes than its content object holds
        body["blocks"][-1][1] = m["claim"]
        body["size"] = sum(n for _, n in body["blocks"])
    if "set" in m:  # one value of the JSON replaced (a path of keys/indices; [] is the whole value)
        *path, last = m["set"] or [None]
        node = body
        for k in path:
            node = node[k]
        if last is None:
            body = m["value"]
        else:
            node[last] = m["value"]
    return magic + json.dumps(body).encode()


class Scene:
    """A root holding what ``job`` damages; ``path`` is the target's file, ``uri`` what ops read."""

    def __init__(self, job: dict, tmp: str) -> None:
        import torch

        import ckptio
        from ckptio import Checkpointer

        self.job, self.tmp = job, tmp
        self.fmt, self.inc = job.get("fmt", "pt"), bool(job.get("incremental"))
        where = job.get("where", "local")
        base = {"local": tmp, "memory": f"memory://{uuid.uuid4().hex}", "s3": f"s3://{job.get('bucket')}"}[where]
        base = f"{base}/{uuid.uuid4().hex[:8]}"
        self.root = f"{base}/run"
        self.tier = None
        target = job["target"]
        torch.manual_seed(0)
        n = 640 if target == "recipe" else 8  # a recipe's blocks are 1 MiB or more
        self.model = torch.nn.Linear(n, n)
        if target.startswith("cosmos"):
            self.root = f"{base}/checkpoints"
            self._cosmos()
            return
        if target == "cache-meta":
            self.uri = f"{tmp}/remote/x.{self.fmt if self.fmt != 'dcp' else 'pt'}"
            ckptio.dump({"w": torch.arange(1000)}, self.uri)
            self.cache = f"{tmp}/cache"
            ckptio.load(self.uri, cache=self.cache)
            import glob

            [self.path] = [p for p in glob.glob(f"{self.cache}/data/*/*.json") if os.path.basename(p)[:40].isalnum()]
            return
        if target == "tier.json":
            self.tier = f"{tmp}/tier"
        kw = self._kw()
        ck = Checkpointer(self.root, **kw)
        for step in (1, 2):
            ck.save(step, {"model": self.model}, metrics={"loss": float(step)})
        ck.close()
        if target == "kept.json":
            Checkpointer(self.root, **kw).keep(1, "best")
        d2 = ck.uri(2)
        self.uri = {"latest.txt": self.root, "checkpoint.json@1": ck.uri(1)}.get(target, d2)
        if target == "recipe":
            from ckptio.incremental import MAGIC

            self.path = next(u for u in ckptio.ls(d2, recursive=True) if ckptio.get(u)[: len(MAGIC)] == MAGIC)
            return
        name = target.split("@")[0]
        at = {"latest.txt": self.root, "kept.json": self.root, "tier.json": self.tier, "checkpoint.json@1": ck.uri(1)}
        self.path = f"{at.get(target, d2)}/{name}"

    def _kw(self) -> dict:
        kw: dict = {"format": self.fmt, "incremental": self.inc}
        if self.tier is not None:
            kw["local_tier"] = self.tier
        return kw

    def _cosmos(self) -> None:
        import torch

        import ckptio

        name = "iter_000000010"
        states = {"model": self.model.state_dict(), "optim": {}, "scheduler": {}, "trainer": {"iteration": 10}}
        for k, v in states.items():
            ckptio.dump(v, f"{self.root}/{name}.pt" if k == "trainer" else f"{self.root}/{name}_{k}.pt")
        ckptio.put_text(f"{name}.pt\n", f"{self.root}/latest_checkpoint.txt")
        self.path, self.uri = f"{self.root}/latest_checkpoint.txt", self.root
        digits = self.job["mutation"].get("digits")
        if digits is not None:  # the other step's files, all four keys: complete by their names
            other = f"iter_{digits}"
            for k, v in states.items():
                ckptio.dump(v, f"{self.root}/{other}.pt" if k == "trainer" else f"{self.root}/{other}_{k}.pt")
            ckptio.remove(self.path)
        del torch

    def damage(self) -> None:
        import ckptio

        m = self.job["mutation"]
        if "digits" in m:
            return
        try:
            original = ckptio.get(self.path)
        except FileNotFoundError:
            original = b"{}"
        data = mutated(original, m)
        backend, path = ckptio.resolve(self.path)
        with backend.open_writer(path) as w:  # in pieces: a large one is not copied whole (the memory cap)
            for i in range(0, len(data), 1 << 20):
                w.write(data[i : i + (1 << 20)])

    def run(self, op: str) -> object:
        import torch

        import ckptio
        from ckptio import Checkpointer
        from ckptio.checkpointer import is_complete, load_model
        from ckptio.checkpointer.catalog import catalog

        model = torch.nn.Linear(*self.model.weight.shape)
        if op == "load":
            if self.job["target"].startswith("cosmos"):
                return Checkpointer(self.root).load({"model": model}, strict=False)
            step = Checkpointer(self.root, **self._kw()).load({"model": model})
            if step is not None and step == 2:  # what was loaded is what was saved
                assert torch.equal(model.weight, self.model.weight)
            return step
        if op == "load_model":
            return load_model(model, self.root)
        if op == "save":
            ck = Checkpointer(self.root, keep_last=1, keep_best=1, best_metric="loss", **self._kw())
            ck.save(3, {"model": model}, metrics={"loss": 0.5})
            ck.close()
            return ck.list()
        if op == "is_complete":
            got = is_complete(self.uri)
            assert type(got) is bool
            return got
        if op == "catalog":
            return catalog(self.root)["latest"]
        if op == "info":
            return ckptio.info(self.uri).get("format")
        if op == "cached_load":
            for _ in range(2):  # the damaged entry is fetched again; so is the next load's
                got = ckptio.load(self.uri, cache=self.cache)
                assert torch.equal(got["w"], torch.arange(1000))
            return "ok"
        raise ValueError(op)


def _child(args: dict) -> None:
    import resource

    import ckptio
    from ckptio.errors import CkptioError

    if args.get("s3"):
        ckptio.configure(backends={"s3": args["s3"]})
    tmp = tempfile.mkdtemp(prefix="markers-")
    kinds = {(j.get("where", "local"), j.get("bucket"), bool(j.get("incremental"))) for j in args["jobs"]}
    for i, (where, bucket, inc) in enumerate(sorted(kinds | {("local", None, False)}, key=str)):
        warm = {"target": "checkpoint.json", "fmt": "fpk", "where": where, "bucket": bucket, "incremental": inc}
        Scene(warm, os.path.join(tmp, f"warm{i}")).run("load")  # imports, clients and pools, before the cap
    with open("/proc/self/statm") as f:
        used = int(f.read().split()[0]) * resource.getpagesize()
    limit = used + args["headroom"]
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    def on_alarm(signum, frame):
        raise TimeoutError("alarm")

    signal.signal(signal.SIGALRM, on_alarm)
    for i, job in enumerate(args["jobs"]):
        signal.alarm(args["alarm"])
        caught: list[warnings.WarningMessage] = []
        grew = 0
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                scene = Scene(job, os.path.join(tmp, str(i)))
                scene.damage()
                peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10
                try:
                    value = scene.run(job["op"])
                finally:
                    grew = max(0, (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10) - peak)
            outcome, msg = "ok", repr(value)[:300]
        except CkptioError as e:
            outcome, msg = "ckptio", f"{type(e).__name__}: {e}"[:2000]
        except TimeoutError:
            outcome, msg = "timeout", f"still running after {args['alarm']}s"
        except BaseException as e:  # noqa: BLE001 - reported to the test
            import traceback

            outcome, msg = type(e).__name__, traceback.format_exc()[-6000:]
        finally:
            signal.alarm(0)
        said = [f"{w.category.__name__}: {w.message}"[:500] for w in caught]
        result = {"job": job, "outcome": outcome, "msg": msg, "warnings": said, "grew": grew}
        print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        _child(json.load(f))

"""A child process that hands crafted pickles to every unpickler ckptio owns, with its memory capped.

``python pickle_workers.py JOBS.json`` runs each job (``kind``, ``path``) after setting ``RLIMIT_AS`` to
what the process uses once warmed up plus ``headroom``, each under a wall-clock ``alarm``, and prints
one ``RESULT`` JSON line per job: the outcome (``ok``, ``format``: a ckptio FormatError, ``timeout``,
or the exception's type name), its message, how far the peak RSS grew, and which shared objects
(admitted classes and functions) changed. :func:`run_jobs` is the parent's side.

Kinds: ``pkl`` (``ckptio.load`` of a ``.pkl``), ``metadata`` (``ckptio.dcp.loads_metadata``), ``pt``
(``ckptio.load`` of a ``.pt``), ``info`` (``ckptio.info``), ``item`` (``ckptio.dcp.checks`` on a DCP
non-tensor item's bytes), ``load`` (``ckptio.load`` of any file, with the job's ``kw``), ``memory``
(the same, the bytes put under the same name in ``memory://``), ``verify`` (``ckptio.verify``).
"""

from __future__ import annotations

import json
import os
import signal
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import zygote  # noqa: E402


def run_jobs(jobs: list[dict], headroom: int = 512 << 20, alarm: int = 20, timeout: float = 600) -> list[dict]:
    """Run ``jobs`` in one capped child; the result of each, in order."""
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"jobs": jobs, "headroom": headroom, "alarm": alarm}, f)
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


def _shared_objects() -> dict[str, object]:
    """Objects a crafted pickle must not change: every class and function the unpicklers admit."""
    import collections
    import datetime
    import decimal
    import pathlib

    import torch
    import torch.distributed.checkpoint.metadata as md
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    from ckptio.formats import safepickle
    from ckptio.formats import torch as fmt_torch

    objs: dict[str, object] = {
        f"pathlib.{c.__name__}": c
        for c in (pathlib.PurePath, pathlib.PurePosixPath, pathlib.Path, pathlib.PosixPath, pathlib.PureWindowsPath)
    }
    for name in ("Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
                 "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING"):  # fmt: skip
        objs[f"dcp.{name}"] = getattr(md, name)
    for m in md._MEM_FORMAT_ENCODING:
        objs[f"dcp.{m}"] = m
    objs["_StorageInfo"] = _StorageInfo
    objs["torch.serialization._get_layout"] = torch.serialization._get_layout
    objs["decimal.Decimal"] = decimal.Decimal
    objs["datetime.datetime"] = datetime.datetime
    objs["collections.OrderedDict"] = collections.OrderedDict
    for name, value in vars(safepickle._Checks).items():
        if callable(value):
            objs[f"safepickle._Checks.{name}"] = value
    for name, value in vars(fmt_torch).items():
        if callable(value) and getattr(value, "__module__", None) == fmt_torch.__name__:
            objs[f"formats.torch.{name}"] = value
    for name, value in vars(fmt_torch._TorchInspector).items():
        if callable(value) or isinstance(value, staticmethod):
            objs[f"_TorchInspector.{name}"] = value
    return objs


def _snapshot(objs: dict[str, object]) -> dict[str, dict]:
    out = {}
    for key, obj in objs.items():
        state = dict(getattr(obj, "__dict__", {}) or {})
        for attr in ("__defaults__", "__kwdefaults__", "__code__"):
            if hasattr(obj, attr):
                state[attr] = getattr(obj, attr)
        out[key] = state
    return out


def _changed(before: dict[str, dict], after: dict[str, dict]) -> list[str]:
    changed = []
    for key, old in before.items():
        new = after[key]
        if old.keys() != new.keys() or any(old[k] is not new[k] and old[k] != new[k] for k in old):
            changed.append(key)
    return changed


def _run(kind: str, path: str, kw: dict | None = None) -> object:
    import ckptio

    if kind in ("pkl", "pt", "load"):
        return ckptio.load(path, **(kw or {}))
    if kind == "memory":  # the same bytes and name, from memory://
        uri = f"memory://fuzz/{os.path.basename(path)}"
        with open(path, "rb") as f:
            ckptio.put(f.read(), uri)
        return ckptio.load(uri, **(kw or {}))
    if kind == "fileobj":  # the same bytes from an open file, behind a prefix it was read past (torch reads from there)
        with open(path, "rb") as f:
            data = f.read()
        with open(f"{path}.off", "wb") as f:
            f.write(b"a prefix read past\n" + data)
        with open(f"{path}.off", "rb") as f:
            f.seek(19)
            return ckptio.load(f, file_format="pt", **(kw or {}))
    if kind == "verify":
        return ckptio.verify(path)
    if kind == "metadata":
        import ckptio.dcp as cd

        with open(path, "rb") as f:
            return cd.loads_metadata(f.read(), path)
    if kind == "info":
        return ckptio.info(path)
    if kind == "item":
        from ckptio.dcp.checks import pickle_problem, zip_problem

        with open(path, "rb") as f:
            data = f.read()
        return zip_problem(data) or pickle_problem(data)
    raise ValueError(kind)


def _child(args: dict) -> None:
    import resource

    import torch

    from ckptio.errors import FormatError

    objs = _shared_objects()
    warm = os.path.join(os.path.dirname(args["jobs"][0]["path"]) if args["jobs"] else ".", "warm")
    import ckptio

    ckptio.dump({"a": [1, 2]}, warm + ".pkl")
    torch.save({"t": torch.ones(2)}, warm + ".pt")
    for kind, p in (("pkl", warm + ".pkl"), ("pt", warm + ".pt"), ("info", warm + ".pt")):
        _run(kind, p)
    with open("/proc/self/statm") as f:
        used = int(f.read().split()[0]) * resource.getpagesize()
    limit = used + args["headroom"]
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    def on_alarm(signum, frame):
        raise TimeoutError("alarm")

    signal.signal(signal.SIGALRM, on_alarm)
    for job in args["jobs"]:
        before = _snapshot(objs)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10
        signal.alarm(args["alarm"])
        try:
            value = _run(job["kind"], job["path"], job.get("kw"))
            outcome, msg = "ok", repr(value)[:300]
        except FormatError as e:
            outcome, msg = "format", str(e)
        except TimeoutError:
            outcome, msg = "timeout", f"still running after {args['alarm']}s"
        except BaseException as e:  # noqa: BLE001 - reported to the test
            outcome, msg = type(e).__name__, str(e)[:1000]
        finally:
            signal.alarm(0)
        grew = max(0, (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10) - peak)
        changed = _changed(before, _snapshot(objs))
        result = {"path": job["path"], "outcome": outcome, "msg": msg, "grew": grew, "changed": changed}
        print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        _child(json.load(f))

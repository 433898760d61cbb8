"""Ctrl-C, and any other exception raised while a dump writes, reaches the caller as itself and leaves
nothing behind (issue 51, item 9).

torch.save's zip writer closes the archive in a ``finally``; after a failed write that close raised
``RuntimeError: [enforce fail at inline_container.cc]`` in place of the ``KeyboardInterrupt`` (or
MemoryError, or ckptio error) the write raised (``ckptio.formats.torch_files``). The dumps run in
children (``interrupt_workers.py``) that get a real SIGINT; the parent lists what is left: the file,
a temporary file, the object, a multipart upload. The fuzzer interrupts .pt and .fpk dumps at random
points, on a local disk and on S3 (moto).
"""

from __future__ import annotations

import json
import os
import random
import sys

import pytest
import torch

import ckptio
import zygote
from ckptio.errors import IntegrityError
from conftest import S3_TEST_OPTIONS

MiB = 1 << 20
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "interrupt_workers.py")

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _root(where: str, request, tmp_path) -> tuple[str, dict | None]:
    """A fresh, empty root and the S3 options a child needs to reach it (None: local)."""
    if where == "local":
        root = tmp_path / "out"
        root.mkdir()
        return str(root), None
    opts = {"endpoint_url": request.getfixturevalue("s3_endpoint"), "part_size": 5 * MiB, **S3_TEST_OPTIONS}
    return request.getfixturevalue("s3_uri"), opts


def _left(root: str) -> list[str]:
    """Everything under ``root``: objects or files (temporary ones included) and unfinished uploads."""
    if "://" not in root:
        return [os.path.join(d, f) for d, _, files in os.walk(root) for f in files]
    backend, resolved = ckptio.resolve(root)
    return [i.uri for i in backend.list(resolved)] + [w.uri for w in backend.list_pending_writes(resolved)]


def _child(spec: dict):
    return zygote.run([sys.executable, WORKER, json.dumps(spec)], capture_output=True, text=True, timeout=180)


@pytest.mark.parametrize("at", [1, 12 * MiB, 32 * MiB], ids=["first-write", "middle", "last-record"])
@pytest.mark.parametrize("where", ["local", "s3"])
def test_ctrl_c_during_a_pt_dump_is_a_keyboard_interrupt_and_leaves_nothing(tmp_path, request, where, at):
    root, s3 = _root(where, request, tmp_path)
    proc = _child({"uri": f"{root}/x.pt", "s3": s3, "mib": 32, "how": "bytes", "at": at})
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and lines and lines[-1] == "KeyboardInterrupt", proc.stderr[-3000:]
    assert not any(line.startswith("RuntimeError") for line in lines), proc.stderr[-3000:]
    assert "inline_container" not in proc.stderr and "During handling" not in proc.stderr, proc.stderr[-3000:]
    assert _left(root) == []


def _raising(exc: BaseException):
    def progress(done: int, total: int) -> None:  # called from the writer's write
        if done > 2 * MiB:
            raise exc

    return progress


@pytest.mark.parametrize(
    "exc",
    [
        OSError(28, "No space left on device"),
        IntegrityError("a ckptio error raised by the writer"),
        MemoryError("no memory for the next part"),
    ],
    ids=["ENOSPC", "ckptio-error", "MemoryError"],
)
@pytest.mark.parametrize("where", ["local", "memory", "s3"])
def test_an_error_raised_by_a_pt_write_reaches_the_caller_as_itself(tmp_path, request, where, exc):
    root = str(tmp_path / "out") if where == "local" else request.getfixturevalue(f"{where}_uri")
    os.makedirs(tmp_path / "out", exist_ok=True)
    state = {f"t{i}": torch.full((1 << 18,), float(i)) for i in range(8)}
    with pytest.raises(type(exc)) as e:
        ckptio.dump(state, f"{root}/x.pt", progress=_raising(exc))
    assert e.value is exc
    assert not ckptio.exists(f"{root}/x.pt") and (where != "local" or _left(root) == [])


@pytest.mark.parametrize("ext", [".pt", ".fpk"])
def test_ctrl_c_while_a_multipart_upload_begins_leaves_no_upload(s3_uri, monkeypatch, ext):
    """The request that begins the upload goes on after an interrupted wait for it: the abort waits
    for it and aborts the upload it made (the writer did not know it had one, and left it)."""
    import _thread
    import asyncio
    import threading

    from ckptio.objectstore.s3_multipart import S3Writer

    real = S3Writer.begin

    async def slow_begin(self):
        await asyncio.sleep(0.5)  # Ctrl-C comes while the request is out
        return await real(self)

    monkeypatch.setattr(S3Writer, "begin", slow_begin)
    timer = threading.Timer(0.25, _thread.interrupt_main)  # as a SIGINT would, in the main thread
    state = {f"t{i}": torch.full((1 << 18,), float(i)) for i in range(12)}
    with pytest.raises(KeyboardInterrupt):
        timer.start()
        ckptio.dump(state, f"{s3_uri}/x{ext}")
    timer.join()
    assert _left(s3_uri) == []


# ---- the fuzzer: random interrupts of .pt and .fpk dumps ------------------------------------------------------

EXPECTED = {None: "KeyboardInterrupt", "ENOSPC": "OSError", "integrity": "IntegrityError", "memory": "MemoryError"}


def _fuzz(request, tmp_path, seed: int, cases: int) -> None:
    rng = random.Random(seed)
    bases = {where: _root(where, request, tmp_path) for where in ("local", "s3")}
    for case in range(cases):
        where, ext, mib = rng.choice(["local", "s3"]), rng.choice([".pt", ".fpk"]), rng.choice([4, 12, 24])
        base, s3 = bases[where]
        root = f"{base}/{case}"
        if where == "local":
            os.makedirs(root)
        spec = {"uri": f"{root}/x{ext}", "s3": s3, "mib": mib, "catch": True}
        if rng.random() < 0.4:  # a SIGINT that lands anywhere: torch's or ckptio's Python code, a writer's thread
            spec.update(how="timer", at=round(rng.uniform(0.0, 1.5), 3))
        else:  # in the writer's write: SIGINT, or an exception raised there
            spec.update(how="bytes", at=rng.randrange(1, mib * MiB))
            spec["raise"] = rng.choice([None, None, "ENOSPC", "integrity", "memory"])
        proc = _child(spec)
        out = proc.stdout.split()
        what = f"seed {seed} case {case}: {spec}: {proc.stdout[-500:]} {proc.stderr[-3000:]}"
        assert proc.returncode == 0 and out, what
        if out[0] == "FINISHED":  # the dump won the race
            assert spec["how"] == "timer", what
        else:
            assert out[:2] == ["RAISED", EXPECTED[spec.get("raise")]], what
        if ckptio.exists(spec["uri"]):  # committed (a SIGINT may land after that): complete and readable
            assert spec["how"] == "timer" and len(ckptio.load(spec["uri"])) == mib, what
            ckptio.remove(spec["uri"])
        assert _left(root) == [], what


def test_interrupted_dumps_fuzz(request, tmp_path):
    _fuzz(request, tmp_path, seed=51, cases=8)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(2))
def test_interrupted_dumps_fuzz_long(request, tmp_path, seed):
    _fuzz(request, tmp_path, seed=1000 + seed, cases=40)


class _Refuses:
    def __reduce__(self):
        raise RuntimeError("this object refuses to be pickled")


def test_a_dump_inside_an_except_block_keeps_its_own_error(tmp_path):
    """The write's exception is the context of torch's closing error; an exception the caller was
    handling when it called dump is the context of every error, and never replaces one."""
    try:
        raise KeyError("the caller's own error")
    except KeyError:
        with pytest.raises(RuntimeError, match="refuses to be pickled"):
            ckptio.dump({"x": _Refuses(), "w": torch.ones(1000)}, str(tmp_path / "x.pt"))
    assert os.listdir(tmp_path) == []


class _RefusesWhileHandling:
    def __reduce__(self):
        try:
            {}["missing"]
        except KeyError:
            raise RuntimeError("this object refuses to be pickled")  # noqa: B904 - its context: the KeyError


@pytest.mark.parametrize("where", ["local", "memory"])
def test_a_runtime_error_raised_while_pickling_is_not_replaced_by_its_context(tmp_path, request, where):
    """An object's own RuntimeError, raised while it handles another exception, reaches the caller as
    itself: only torch's closing error after a failed write stands for the write's exception."""
    root = str(tmp_path) if where == "local" else request.getfixturevalue("memory_uri")
    with pytest.raises(RuntimeError, match="refuses to be pickled"):
        ckptio.dump({"x": _RefusesWhileHandling(), "w": torch.ones(1000)}, f"{root}/x.pt")
    assert not ckptio.exists(f"{root}/x.pt") and (where != "local" or os.listdir(tmp_path) == [])


# ---- the fuzzer: which exception a failing .pt dump raises ------------------------------------------------------

_ERRORS_CHILD = r"""
import json, random, sys, torch, ckptio
from ckptio.errors import IntegrityError
TYPES = {"RuntimeError": RuntimeError, "ValueError": ValueError, "KeyError": KeyError, "OSError": OSError,
         "IntegrityError": IntegrityError, "MemoryError": MemoryError, "TypeError": TypeError}
root, seed, cases = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
rng = random.Random(seed)

class Raises:
    def __init__(self, exc, context, style):
        self.exc, self.context, self.style = exc, context, style
    def __reduce__(self):
        if self.context is None:
            raise self.exc
        try:
            raise self.context
        except BaseException as c:
            if self.style == "from":
                raise self.exc from c
            raise self.exc

for case in range(cases):
    token = f"token-{seed}-{case}"
    exc = TYPES[rng.choice(sorted(TYPES))](token)
    state = {f"t{i}": torch.full((1 << 14,), float(i)) for i in range(rng.randrange(1, 6))}
    kw = {"_use_new_zipfile_serialization": rng.random() < 0.8}
    if rng.random() < 0.5:  # the pickled object raises, maybe while handling another exception
        context = rng.choice([None, KeyError("k"), OSError(5, "io"), RuntimeError("r"), ValueError("v")])
        state[rng.choice(["a", "z"])] = Raises(exc, context, rng.choice(["plain", "from"]))
    else:  # the write raises, once some bytes are written
        at = rng.randrange(1, 64 << 10)
        def progress(done, total, exc=exc, at=at):
            if done >= at:
                raise exc
        kw["progress"] = progress
    uri = f"{root}/{case}.pt"
    try:
        if rng.random() < 0.5:
            try:
                raise LookupError("the caller's own")
            except LookupError:
                ckptio.dump(state, uri, **kw)
        else:
            ckptio.dump(state, uri, **kw)
        got = "FINISHED"
    except BaseException as e:
        same = e is exc or (type(e) is TypeError and e.__cause__ is exc)  # dump names the file in a TypeError
        got = f"{type(exc).__name__}:{exc}" if same else f"OTHER {type(e).__name__}: {str(e)[:300]}"
    want = f"{type(exc).__name__}:{exc}"
    if got != want and not (got == "FINISHED" and "progress" in kw):
        print(f"case {case} {kw} wanted {want} got {got}", flush=True)
        sys.exit(1)
print("OK", flush=True)
"""


def _errors_fuzz(tmp_path, seed: int, cases: int) -> None:
    for root in (str(tmp_path), "memory://fuzz-errors"):
        proc = zygote.run(
            [sys.executable, "-c", _ERRORS_CHILD, root, str(seed), str(cases)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0 and proc.stdout.strip() == "OK", (root, proc.stdout[-2000:], proc.stderr[-3000:])
    assert [f for f in os.listdir(tmp_path) if not f[0].isdigit()] == []


def test_failing_dump_errors_fuzz(tmp_path):
    _errors_fuzz(tmp_path, seed=5, cases=40)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(2))
def test_failing_dump_errors_fuzz_long(tmp_path, seed):
    _errors_fuzz(tmp_path, seed=100 + seed, cases=300)

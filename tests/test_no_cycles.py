"""Saves and loads leave no reference cycles behind.

Memory in a cycle is freed only when Python's cyclic gc next runs: a save whose frames stay in a cycle
(an error caught inside it, whose traceback holds the frame that kept it) keeps the caller's state
alive after the save returns, and the gc then frees it, a GiB at a time, in the middle of whatever runs
next (a restore measured 80 ms without, 300-500 ms when it met that collection). Each case runs once
to import what it uses, then again with the gc off; what a collection then finds must hold nothing of
ckptio's: no frame, traceback, exception, tensor, buffer or object of a ckptio class.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Callable, Iterator

import pytest
import torch

import ckptio
from ckptio.checkpointer import Checkpointer

pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
    pytest.mark.filterwarnings("ignore::ckptio.checkpointer.CheckpointWarning"),
]


def _state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"model": {f"w{i}": torch.randn(256, 256, generator=g) for i in range(4)}, "step": step}


def _suspects(garbage: list) -> Iterator[str]:
    import types

    for o in garbage:
        if isinstance(o, types.FrameType):
            yield f"frame {o.f_code.co_filename}:{o.f_code.co_name}"
        elif isinstance(o, BaseException) and type(o).__module__.startswith("aiohttp"):
            continue  # aiohttp's own: a connection lost mid-body keeps its error in its protocol's cycle
        elif isinstance(o, (types.TracebackType, BaseException, torch.Tensor, memoryview, bytearray)):
            yield type(o).__name__
        elif type(o).__module__.startswith("ckptio"):
            yield f"{type(o).__module__}.{type(o).__qualname__}"


def _cycles_of(run: Callable[[int], None]) -> list[str]:
    run(1)  # imports, caches, the first save's own objects
    gc.collect()
    was = gc.isenabled()
    gc.disable()
    try:
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        gc.garbage.clear()
        for step in (2, 3):
            run(step)
        gc.collect()
        return sorted(set(_suspects(gc.garbage)))
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        if was:
            gc.enable()


@pytest.mark.parametrize(
    "fmt, incremental, keep_last",
    [("fpk", False, None), ("fpk", True, 1), ("pt", False, None), ("dcp", False, 1), ("dcp", True, None)],
)
def test_checkpointer_saves_and_loads_leave_no_cycles(fmt, incremental, keep_last, tmp_path):
    roots = iter(range(1000))

    def run(step: int) -> None:
        # a fresh root each time: the first save's look-ups of what is not there yet (errors caught inside)
        ck = Checkpointer(str(tmp_path / f"r{next(roots)}"), format=fmt, incremental=incremental, keep_last=keep_last)
        for s in (step, step + 1):
            ck.save(s, _state(s))
        target = _state(0)
        assert ck.load(target) == step + 1
        assert torch.equal(target["model"]["w0"], _state(step + 1)["model"]["w0"])

    found = _cycles_of(run)
    assert found == [], "\n".join(found)


@pytest.mark.parametrize("ext", ["fpk", "pt", "safetensors"])
@pytest.mark.parametrize("where", ["local", "memory"])
def test_dump_and_load_leave_no_cycles(ext, where, tmp_path, memory_uri):
    base = str(tmp_path) if where == "local" else memory_uri

    def run(step: int) -> None:
        state = _state(step)["model"]
        uri = f"{base}/s{step}.{ext}"
        ckptio.dump(state, uri)
        back = ckptio.load(uri)
        assert torch.equal(back["w1"], state["w1"])
        assert not ckptio.exists(f"{base}/missing-{step}.{ext}")

    found = _cycles_of(run)
    assert found == [], "\n".join(found)


def test_a_failed_load_leaves_nothing_but_its_error(tmp_path):
    """The error a caller catches holds its traceback (the caller's to drop); once dropped, nothing of the
    load stays in a cycle."""

    def run(step: int) -> None:
        try:
            ckptio.load(str(tmp_path / f"nothing-{step}.fpk"))
        except FileNotFoundError:
            pass

    found = _cycles_of(run)
    assert found == [], "\n".join(found)


@pytest.mark.parametrize("where", ["s3", "gcs"])
@pytest.mark.parametrize("fmt", ["fpk", "dcp"])
def test_remote_saves_and_loads_leave_no_cycles(where, fmt, request):
    base = request.getfixturevalue(f"{where}_uri")
    roots = iter(range(1000))

    def run(step: int) -> None:
        ck = Checkpointer(f"{base}/r{next(roots)}", format=fmt, keep_last=1)
        for s in (step, step + 1):
            ck.save(s, _state(s))
        target = _state(0)
        assert ck.load(target) == step + 1
        uri = f"{base}/one-{step}.fpk"
        ckptio.dump(_state(step), uri)
        assert ckptio.load(uri)["step"] == step
        assert not ckptio.exists(f"{base}/missing-{step}.fpk")

    found = _cycles_of(run)
    assert found == [], "\n".join(found)


def test_multipart_and_resumable_uploads_leave_no_cycles(faults):
    """Parts of 256 KiB (GCS) or 5 MiB (S3): a writer's part futures keep their done callbacks, which hold
    the writer; the writer lets them go when it completes or aborts."""
    big = {"w": torch.zeros(3 << 20, dtype=torch.uint8)}  # 3 MiB: parts on GCS; S3 writes it at once

    def run(step: int) -> None:
        ckptio.dump(big, f"{faults.uri}/u{step}.fpk")
        with ckptio.open(f"{faults.uri}/s{step}.bin", "wb") as f:  # a streaming writer, part by part
            for _ in range(12):
                f.write(bytes(1 << 20))

    found = _cycles_of(run)
    assert found == [], "\n".join(found)


def _given_up(faults, kind: str, uri: str) -> None:
    """Every GET of ``uri`` failing (``kind``), ``load`` and ``get`` with one attempt give up."""
    from faultproxy import Fault

    faults.clear()
    faults.add(Fault(kind, method="GET", fraction=1.0))
    for read in (ckptio.load, ckptio.get):
        with pytest.raises(ckptio.errors.TransferError):
            read(uri, backend_args={"max_attempts": 1})
    faults.clear()


@pytest.mark.parametrize("kind", ["status", "truncate"])
def test_remote_loads_read_in_parts_leave_no_cycles_whether_they_succeed_or_give_up(faults, kind):
    """1 MiB through the fault fixtures' small parts (256 KiB on GCS): the head, the middle in parallel
    ranges, the end; then every GET failing and the load given up (the parallel reads' errors, the tasks
    and futures that hold them, and the stall timers)."""

    for step in (1, 2, 3):
        ckptio.dump(_state(step), f"{faults.uri}/p{step}.fpk")

    def run(step: int) -> None:
        uri = f"{faults.uri}/p{step}.fpk"
        faults.clear()
        assert ckptio.load(uri)["step"] == step
        _given_up(faults, kind, uri)

    found = _cycles_of(run)
    assert found == [], "\n".join(found)


@pytest.mark.parametrize("kind", ["status", "truncate"])
def test_a_first_get_that_fails_on_the_callers_thread_leaves_no_cycles(gcs_faults, kind):
    """A GCS load's first GET, sent from the caller's thread (objectstore.here), fails before its body
    (503) or in it (a short body): retried on the IO loop, or given up, nothing stays in a cycle."""
    from faultproxy import Fault

    for step in (1, 2, 3):  # small: the first GET holds each whole
        ckptio.dump({"w": torch.ones(100), "step": step}, f"{gcs_faults.uri}/h{step}.fpk")

    def run(step: int) -> None:
        uri = f"{gcs_faults.uri}/h{step}.fpk"
        gcs_faults.clear()
        gcs_faults.add(Fault(kind, method="GET", nth=1))
        assert ckptio.load(uri)["step"] == step  # the IO loop's retry
        _given_up(gcs_faults, kind, uri)  # the attempt made here was the only one

    found = _cycles_of(run)
    assert found == [], "\n".join(found)


def test_async_and_tiered_saves_leave_no_cycles(tmp_path, memory_uri):
    roots = iter(range(1000))

    def run(step: int) -> None:
        n = next(roots)
        for ck in (
            Checkpointer(str(tmp_path / f"a{n}"), async_save=True),
            Checkpointer(f"{memory_uri}/t{n}", local_tier=str(tmp_path / f"tier{n}")),
        ):
            for s in (step, step + 1):
                ck.save(s, _state(s))
            ck.wait()
            target = _state(0)
            assert ck.load(target) == step + 1
            ck.close()

    found = _cycles_of(run)
    assert found == [], "\n".join(found)


def test_close_frees_the_staging_buffers_and_a_later_save_still_works(tmp_path):
    ck = Checkpointer(str(tmp_path / "r"), async_save=True)
    ck.save(1, _state(1))
    ck.wait()
    assert ck._stager.nbytes >= 4 * 256 * 256 * 4  # a CPU copy of the state, kept for the next save
    ck.close()
    assert ck._stager.nbytes == 0
    ck.save(2, _state(2))  # allocates anew
    ck.close()
    target = _state(0)
    assert Checkpointer(str(tmp_path / "r")).load(target) == 2
    assert torch.equal(target["model"]["w3"], _state(2)["model"]["w3"])


def test_a_dropped_unclosed_tiered_checkpointer_still_replicates(tmp_path, memory_uri):
    """The tier holds its owner weakly only once closed: dropped without close(), the replicator's thread
    keeps it (and its retention rules) and replicates what was saved."""
    import time

    remote = f"{memory_uri}/remote"
    ck = Checkpointer(remote, local_tier=str(tmp_path / "tier"), keep_last=1)
    replicator = ck._tier.replicator
    for s in (1, 2):
        ck.save(s, _state(s))
    del ck
    gc.collect()
    deadline = time.monotonic() + 30
    while Checkpointer(remote).list() != [2] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert Checkpointer(remote).list() == [2]  # replicated, step 1 pruned by the owner's rules
    replicator.close()


def test_a_failed_async_save_leaves_nothing_once_its_error_is_dropped(tmp_path, monkeypatch):
    """Training goes on after a background save fails: the error the next wait() raises, once the caller
    drops it, keeps nothing of that save (its frames and what they staged) alive."""
    from ckptio.checkpointer import staging

    # the failure is logged at once; pytest's log capture would keep the record (and the error) alive
    monkeypatch.setattr(staging.log, "error", lambda *a, **kw: None)
    roots = iter(range(1000))

    def run(step: int) -> None:
        ck = Checkpointer(str(tmp_path / f"r{next(roots)}"), async_save=True)

        def fail(*a, **kw):
            raise OSError(28, "No space left on device")

        ck._persist = fail  # type: ignore[method-assign]
        ck.save(step, _state(step))
        try:  # as a training loop catches it (not pytest.raises, which lets go of the traceback itself)
            ck.wait()
        except OSError as e:
            assert "No space left" in str(e)
        else:
            raise AssertionError("the failed save was not raised")
        ck.close()

    found = _cycles_of(run)
    assert found == [], "\n".join(found)


def test_a_failed_checkpointer_load_leaves_nothing_once_its_error_is_dropped(tmp_path):
    """A job that catches a damaged checkpoint's error and resumes from an older step keeps nothing of the
    failed load alive."""
    import glob

    from ckptio.errors import IntegrityError
    from conftest import flip_byte

    roots = iter(range(1000))

    def run(step: int) -> None:
        root = str(tmp_path / f"r{next(roots)}")
        ck = Checkpointer(root, format="fpk")
        ck.save(step, _state(step))
        ck.save(step + 1, _state(step + 1))
        (newest,) = glob.glob(f"{root}/{step + 1:012d}/*.fpk")
        flip_byte(newest, os.path.getsize(newest) // 2)
        target = _state(0)
        try:  # as a training loop catches it
            ck.load(target, step=step + 1)
        except IntegrityError:
            assert ck.load(target, step=step) == step
        else:
            raise AssertionError("the damaged step loaded")

    found = _cycles_of(run)
    assert found == [], "\n".join(found)

"""ckptio.Checkpointer in one process: round trips per format and backend, resume rules, recovery,
retention, sibling-prefix safety, async staging and failures."""

from __future__ import annotations

import os
import random
import threading
import time

import pytest
import torch

import ckptio
from ckptio.checkpointer import MARKER_NAME, POINTER_NAME, Checkpointer, CheckpointWarning, RNGState

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
FORMATS = ["pt", "fpk", "dcp"]


def make_trainer(seed: int = 0, lr: float = 0.1):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    optim = torch.optim.AdamW(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=2, gamma=0.5)
    return model, optim, sched


def train(model, optim, sched, steps: int) -> None:
    for _ in range(steps):
        loss = model(torch.randn(3, 4)).pow(2).mean()
        optim.zero_grad()
        loss.backward()
        optim.step()
        sched.step()


def state_of(model, optim, sched, step=0):
    return {"model": model, "optim": optim, "sched": sched, "rng": RNGState(), "trainer": {"step": step}}


def assert_same_training(a, b) -> None:
    (ma, oa, sa), (mb, ob, sb) = a, b
    for (ka, va), (kb, vb) in zip(ma.state_dict().items(), mb.state_dict().items(), strict=True):
        assert ka == kb and torch.equal(va, vb), ka
    sda, sdb = oa.state_dict(), ob.state_dict()
    assert sda["param_groups"] == sdb["param_groups"]
    assert sda["state"].keys() == sdb["state"].keys()
    for i in sda["state"]:
        for k in sda["state"][i]:
            assert torch.equal(sda["state"][i][k], sdb["state"][i][k]), (i, k)
    assert sa.state_dict() == sb.state_dict()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("backend", ["local", "memory", "s3", "gcs"])
def test_round_trip_resumes_training_exactly(fmt, backend, request):
    root = request.getfixturevalue(f"{backend}_uri") + "/run"
    a = make_trainer(0)
    train(*a, 3)
    ck = Checkpointer(root, format=fmt)
    ck.save(3, state_of(*a, step=3), metrics={"loss": 1.0})
    train(*a, 2)  # the reference continues

    b = make_trainer(1, lr=0.7)  # different init and hyper-parameters, fresh optimizer
    st = state_of(*b)
    torch.manual_seed(123)
    assert Checkpointer(root).load(st) == 3  # the format comes from the checkpoint, not the constructor
    assert st["trainer"] == {"step": 3}
    train(*b, 2)  # same RNG state, hence the same batches: identical training
    assert_same_training(a, b)
    assert ck.list() == [3] and ck.latest() == 3
    assert ck.manifest(3)["metrics"] == {"loss": 1.0} and ck.manifest(3)["format"] == fmt


def test_rng_state_round_trip(memory_uri):
    ck = Checkpointer(memory_uri, format="pt")
    random.seed(1)
    torch.manual_seed(1)
    ck.save(0, {"rng": RNGState()})
    expect = (torch.rand(3), random.random())
    random.seed(2)
    torch.manual_seed(2)
    ck.load({"rng": RNGState()})
    assert torch.equal(torch.rand(3), expect[0]) and random.random() == expect[1]


def test_layout_and_pointer(local_uri):
    ck = Checkpointer(local_uri, format="pt")
    ck.save(7, {"x": torch.ones(2)})
    assert sorted(os.listdir(local_uri)) == ["000000000007", POINTER_NAME]
    assert sorted(os.listdir(os.path.join(local_uri, "000000000007"))) == [MARKER_NAME, "state.pt"]
    assert open(os.path.join(local_uri, POINTER_NAME)).read() == "000000000007\n"


def test_no_checkpoint_yet_returns_none(memory_uri, caplog):
    ck = Checkpointer(memory_uri + "/nothing")
    assert ck.latest() is None and ck.list() == []
    with caplog.at_level("WARNING", logger="ckptio.checkpointer"):
        assert ck.load({"x": torch.zeros(1)}) is None
    assert "no checkpoint" in caplog.text


@pytest.mark.parametrize("fmt", ["pt", "dcp"])
def test_keys_and_strict(fmt, memory_uri):
    src = make_trainer(0)
    train(*src, 1)
    ck = Checkpointer(memory_uri, format=fmt)
    ck.save(1, {"model": src[0], "optim": src[1], "trainer": {"step": 1}})

    m, o, _ = make_trainer(1)
    o_before = o.state_dict()
    assert ck.load({"model": m, "optim": o}, keys=["model"]) == 1  # fine-tuning: weights only
    assert torch.equal(m[0].weight, src[0][0].weight)
    assert o.state_dict() == o_before

    other = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))  # head differs
    with pytest.raises(KeyError, match="missing keys"):
        ck.load({"model": other.state_dict(), "absent": {}}, keys=["absent"])
    with pytest.raises((KeyError, RuntimeError)):
        ck.load({"model": other})
    m2 = make_trainer(2)[0]
    with pytest.warns(CheckpointWarning, match="unexpected keys"):
        ck.load({"model": m2, "extra": {"a": torch.zeros(1)}}, strict=False)
    assert torch.equal(m2[0].weight, src[0][0].weight)
    assert ck.last_load.missing_keys == ["extra"]
    assert set(ck.last_load.unexpected_keys) == {"optim", "trainer"}


@pytest.mark.parametrize("fmt", ["pt", "dcp"])
def test_load_plain_state_dict_in_place(fmt, memory_uri):
    ck = Checkpointer(memory_uri, format=fmt)
    ck.save(4, {"model": {"w": torch.arange(6.0).reshape(2, 3)}, "step": 4})
    target = {"model": {"w": torch.zeros(2, 3)}, "step": 0}
    w = target["model"]["w"]
    assert ck.load(target) == 4
    assert target["model"]["w"] is w and torch.equal(w, torch.arange(6.0).reshape(2, 3))
    assert target["step"] == 4


def test_load_by_step_and_by_uri(memory_uri):
    ck = Checkpointer(memory_uri + "/a", format="pt")
    for s in (1, 2):
        ck.save(s, {"v": torch.full((2,), float(s))})
    t = {"v": torch.zeros(2)}
    assert ck.load(t, step=1) == 1 and t["v"][0] == 1
    other = Checkpointer(memory_uri + "/b", format="dcp")
    assert other.load(t, step=ck.uri(2)) == 2 and t["v"][0] == 2  # another run's checkpoint
    with pytest.raises(FileNotFoundError):
        ck.load(t, step=9)


@pytest.mark.parametrize("fmt", ["pt", "dcp"])
def test_load_through_node_local_cache(fmt, memory_uri, tmp_path):
    ck = Checkpointer(memory_uri, format=fmt)
    ck.save(1, {"v": torch.arange(4.0)})
    cache = str(tmp_path / "cache")
    for _ in range(2):
        t = {"v": torch.zeros(4)}
        assert ck.load(t, cache=cache) == 1 and torch.equal(t["v"], torch.arange(4.0))
    assert any(files for _, _, files in os.walk(os.path.join(cache, "data")))


def test_fallback_when_pointer_missing_or_incomplete(local_uri):
    ck = Checkpointer(local_uri, format="pt")
    for s in (1, 2, 3):
        ck.save(s, {"v": torch.full((1,), float(s))})
    os.remove(os.path.join(local_uri, "000000000003", MARKER_NAME))  # step 3 torn: pointer names it
    with pytest.warns(CheckpointWarning, match="step 2"):
        assert ck.latest() == 2
    t = {"v": torch.zeros(1)}
    with pytest.warns(CheckpointWarning):
        assert Checkpointer(local_uri).load(t) == 2
    assert t["v"][0] == 2
    os.remove(os.path.join(local_uri, POINTER_NAME))
    with pytest.warns(CheckpointWarning, match="missing"):
        assert ck.latest() == 2
    assert ck.list() == [1, 2]
    # a fresh Checkpointer continues: the torn step is rewritten and committed
    ck2 = Checkpointer(local_uri, format="pt")
    ck2.save(3, {"v": torch.full((1,), 3.0)})
    assert ck2.latest() == 3 and ck2.list() == [1, 2, 3]


def test_save_existing_step(memory_uri):
    ck = Checkpointer(memory_uri, format="pt")
    ck.save(1, {"v": torch.zeros(1)})
    ck.save(2, {"v": torch.zeros(1)})
    with pytest.raises(FileExistsError, match="latest"):
        ck.save(2, {"v": torch.ones(1)})
    with pytest.warns(CheckpointWarning, match="replacing"):
        ck.save(1, {"v": torch.ones(1)})  # an abandoned older step may be replaced
    t = {"v": torch.zeros(1)}
    ck.load(t, step=1)
    assert t["v"][0] == 1


def test_delete(memory_uri):
    ck = Checkpointer(memory_uri, format="pt")
    for s in (1, 2, 3):
        ck.save(s, {"v": torch.zeros(1)})
    ck.delete(2)
    assert ck.list() == [1, 3]
    ck.delete(3)  # the latest: the pointer moves to the newest remaining one
    assert ck.latest() == 1
    ck.delete(1)
    assert ck.latest() is None and not ckptio.exists(f"{memory_uri}/{POINTER_NAME}")
    with pytest.raises(FileNotFoundError):
        ck.delete(5)


# ---- retention -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw, losses, expect",
    [
        ({}, None, list(range(1, 11))),
        ({"keep_last": 2}, None, [9, 10]),
        ({"keep_every": 4}, None, [4, 8, 10]),
        ({"keep_last": 2, "keep_every": 3}, None, [3, 6, 9, 10]),
        ({"keep_best": 2, "best_metric": "loss"}, [5, 1, 7, 2, 9, 9, 9, 9, 9, 9], [2, 4, 10]),
        (
            {"keep_best": 1, "best_metric": "acc", "best_mode": "max", "keep_last": 1},
            [5, 1, 7, 2, 9, 3, 1, 1, 1, 1],
            [5, 10],
        ),
    ],
)
def test_retention(kw, losses, expect, memory_uri):
    root = memory_uri + "/run"
    sibling = memory_uri + "/run-2"  # a neighbouring run whose prefix starts with ours
    Checkpointer(sibling, format="pt").save(1, {"v": torch.zeros(1)})
    ckptio.put(b"x", f"{root}0/000000000001/{MARKER_NAME}")  # and one with no separator at all
    ck = Checkpointer(root, format="pt", **kw)
    metric = kw.get("best_metric", "loss")
    for s in range(1, 11):
        ck.save(s, {"v": torch.full((1,), float(s))}, metrics={metric: losses[s - 1]} if losses else None)
    assert ck.list() == expect
    assert ck.latest() == 10
    assert Checkpointer(sibling).list() == [1]
    assert ckptio.exists(f"{root}0/000000000001/{MARKER_NAME}")


def test_retention_removes_debris_and_only_step_dirs(local_uri):
    os.makedirs(os.path.join(local_uri, "000000000001"))
    open(os.path.join(local_uri, "000000000001", "state.pt"), "wb").write(b"torn")  # crashed save
    long_ago = time.time() - 7 * 3600  # older than stale_after: no save in progress elsewhere
    for p in (os.path.join(local_uri, "000000000001", "state.pt"), os.path.join(local_uri, "000000000001")):
        os.utime(p, (long_ago, long_ago))
    os.makedirs(os.path.join(local_uri, "notes"))
    open(os.path.join(local_uri, "notes", "keep.txt"), "w").write("mine")
    ck = Checkpointer(local_uri, format="pt", keep_last=1)
    ck.save(2, {"v": torch.zeros(1)})
    ck.save(3, {"v": torch.zeros(1)})
    assert sorted(os.listdir(local_uri)) == ["000000000003", POINTER_NAME, "notes"]


def test_validation():
    with pytest.raises(ValueError):
        Checkpointer("memory://x", format="zip")
    with pytest.raises(ValueError):
        Checkpointer("memory://x", keep_last=0)
    with pytest.raises(ValueError, match="best_metric"):
        Checkpointer("memory://x", keep_best=2)
    with pytest.raises(ValueError):
        Checkpointer("memory://x").save(-1, {"a": 1})


# ---- async -----------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
def test_async_snapshot_is_taken_at_save_time(fmt, memory_uri):
    model, optim, sched = make_trainer(0)
    ck = Checkpointer(memory_uri, format=fmt, async_save=True, keep_last=2)
    expected = {}
    for s in range(1, 4):
        train(model, optim, sched, 1)
        expected[s] = {k: v.clone() for k, v in model.state_dict().items()}
        ck.save(s, {"model": model, "optim": optim})
        with torch.no_grad():  # mutate right after save returns, while it persists
            for p in model.parameters():
                p.add_(100.0)
    ck.wait()
    assert ck.list() == [2, 3]
    for s in (2, 3):
        m = make_trainer(1)[0]
        ck.load({"model": m}, step=s, keys=["model"])
        for k, v in m.state_dict().items():
            assert torch.equal(v, expected[s][k]), (s, k)


def test_async_staging_buffers_are_reused(memory_uri):
    ck = Checkpointer(memory_uri, format="pt", async_save=True)
    w = torch.randn(64, 64)
    ck.save(1, {"w": w})
    ck.wait()
    buf = ck._stager._bufs[("w",)]
    ck.save(2, {"w": w})
    assert ck._stager._bufs[("w",)] is buf and ck._stager.nbytes == w.numel() * 4
    ck.save(3, {"u": torch.randn(8)})  # the old buffers are dropped: memory stays bounded
    ck.wait()
    assert list(ck._stager._bufs) == [("u",)]
    ck.close()  # and close frees the rest
    assert not ck._stager._bufs and ck._stager.nbytes == 0


class FlakyError(OSError):
    pass


def test_async_failure_raises_on_next_call(memory_uri, monkeypatch):
    ck = Checkpointer(memory_uri, format="pt", async_save=True)
    ck.save(1, {"v": torch.zeros(4)})
    ck.wait()
    backend, _ = ckptio.resolve(memory_uri)
    gate = threading.Event()
    real = type(backend).open_writer

    def failing(self, uri, **kw):
        gate.wait(5)
        if "000000000002" in uri:
            raise FlakyError(f"injected failure writing {uri}")
        return real(self, uri, **kw)

    monkeypatch.setattr(type(backend), "open_writer", failing)
    ck.save(2, {"v": torch.ones(4)})  # returns: the failure happens in the background
    gate.set()
    with pytest.raises(FlakyError, match="injected"):
        ck.save(3, {"v": torch.ones(4)})
    assert ck.latest() == 1 and ck.list() == [1]  # the failed step never became visible
    ck.save(3, {"v": torch.ones(4)})  # the error was reported once; later saves work
    ck.wait()
    monkeypatch.undo()
    assert ck.latest() == 3

    monkeypatch.setattr(type(backend), "open_writer", failing)
    ck.save(2, {"v": torch.ones(4)})
    with pytest.raises(FlakyError):
        ck.wait()


def test_failed_background_save_is_reported_even_if_the_program_just_ends(tmp_path):
    import subprocess
    import sys

    code = (
        "import torch, ckptio\n"
        f"ck = ckptio.Checkpointer({str(tmp_path / 'ck')!r}, format='fpk', async_save=True)\n"
        "ck.save(1, {'m': {'w': torch.ones(3)}, 't': {'o': object()}})\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "background save" in r.stderr and "failed" in r.stderr, r.stderr


@pytest.mark.parametrize("async_save", [False, True])
def test_dcp_failures_are_ckptio_errors_not_checkpoint_exceptions(tmp_path, monkeypatch, async_save):
    """torch's CheckpointException is a BaseException; Checkpointer raises the storage error itself."""
    from torch.distributed.checkpoint.api import CheckpointException

    from ckptio.backends import local

    ck = Checkpointer(str(tmp_path / "run"), format="dcp", async_save=async_save)
    ck.save(1, {"m": {"w": torch.ones(4)}})
    ck.wait()
    real = local.LocalWriter.write

    def write(self, data):
        if "000000000002" in self._path and self._path.endswith(".distcp"):
            raise FlakyError(5, "injected disk failure")
        return real(self, data)

    monkeypatch.setattr(local.LocalWriter, "write", write)
    try:
        ck.save(2, {"m": {"w": torch.zeros(4)}})
        ck.wait()
    except Exception as e:  # noqa: BLE001 - the point: `except Exception` sees it
        err = e
    else:
        pytest.fail("the save did not fail")
    assert isinstance(err, FlakyError) and isinstance(err.__cause__, CheckpointException)
    assert "rank 0" in "".join(err.__notes__)
    monkeypatch.undo()
    assert ck.list() == [1] and ck.latest() == 1


def test_dcp_load_errors_are_ckptio_errors(tmp_path):
    import pickle

    from ckptio.errors import FormatError, IntegrityError

    ck = Checkpointer(str(tmp_path / "run"), format="dcp")
    ck.save(1, {"m": {"w": torch.randn(1000)}})
    d = tmp_path / "run" / "000000000001"
    (data,) = d.glob("*.distcp")
    raw = bytearray(data.read_bytes())
    raw[-200] ^= 0xFF  # inside the tensor bytes (the zip trailer follows them)
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(IntegrityError, match="checksum mismatch"):
        ck.load({"m": {"w": torch.zeros(1000)}})

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'PWNED'}",))

    (d / ".metadata").write_bytes(pickle.dumps(Evil()))
    for step in (1, str(d)):
        with pytest.raises(FormatError, match="system"):
            Checkpointer(str(tmp_path / "run"), format="dcp").load({"m": {"w": torch.zeros(1000)}}, step=step)
    assert not (tmp_path / "PWNED").exists()


def test_unicode_digit_names_are_not_steps(tmp_path):
    """'²'.isdigit() is True but int('²') fails: a stray directory or pointer named so is ignored."""
    ck = Checkpointer(str(tmp_path), format="fpk")
    ck.save(3, {"x": torch.ones(2)})
    (tmp_path / "\u00b2").mkdir()
    (tmp_path / "1\u00b2").mkdir()
    assert ck.list() == [3]
    (tmp_path / "latest.txt").write_text("\u00b2\n")
    with pytest.warns(Warning):
        assert Checkpointer(str(tmp_path), format="fpk").latest() == 3

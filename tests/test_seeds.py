"""ckptio.checkpointer.seeds: the DINOv3 and Cosmos layouts, written the way each seed writes them (a tiny
model, DINOv3's DCP state and temporary-directory rename, Cosmos's torch.save per key and its pointer),
recognised on local storage and S3 (moto): steps, latest, targets, parts read, incomplete steps ignored."""

from __future__ import annotations

import os
import shutil
import tempfile
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.state_dict as dcpsd
from torch.distributed.checkpoint.filesystem import FileSystemWriter

import ckptio
import ckptio.dcp
from ckptio.checkpointer import CheckpointWarning
from ckptio.checkpointer.seeds import KEYS, find, read_parts
from ckptio.errors import IncompleteCheckpointError, NotFoundError

pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
    pytest.mark.filterwarnings("ignore:.*single process:UserWarning"),
    pytest.mark.filterwarnings("ignore:.*torch.distributed.*not initialized:UserWarning"),
]
BACKENDS = ["local", "s3"]


def trained(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda it: 1.0 / (1 + it))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** (seed % 40))
    for _ in range(2):
        model(torch.randn(3, 4)).pow(2).mean().backward()
        optim.step()
        sched.step()
        optim.zero_grad()
    return model, optim, sched, scaler


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))


# ---- DINOv3: save_checkpoint's sequence --------------------------------------------------------------
def dino_state(model, optim, iteration: int) -> dict:
    return {
        "iteration": iteration,
        "model": dcpsd.get_model_state_dict(model),
        "optimizer": dcpsd.get_optimizer_state_dict(model, optim),
    }


def dino_save(root: str, iteration: int, model, optim) -> None:
    """Local: DCP into ``mkdtemp(prefix=str(iteration))`` beside the step, then a rename, as DINOv3 does;
    an object store: ckptio.dcp at ``root/<iteration>`` (DINOv3 itself writes local paths only)."""
    state = dino_state(model, optim, iteration)
    if "://" in root:
        ckptio.dcp.save(state, f"{root}/{iteration}")
        return
    os.makedirs(root, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=root, prefix=str(iteration))
    dcp.save(state, storage_writer=FileSystemWriter(tmp))
    os.rename(tmp, os.path.join(root, str(iteration)))


def dino_keep(root: str, iteration: int) -> None:
    """keep_checkpoint_copy: ``cp --recursive --link`` to ``<iteration>_keep`` (local only)."""
    shutil.copytree(os.path.join(root, str(iteration)), os.path.join(root, f"{iteration}_keep"), copy_function=os.link)


@pytest.mark.parametrize("backend", BACKENDS)
def test_dinov3_steps_latest_and_target_restore_the_model(backend, request):
    out = request.getfixturevalue(f"{backend}_uri") + "/job"
    root = out + "/ckpt"
    models = {it: trained(it) for it in (99, 199, 299)}
    for it, (m, o, _, _) in models.items():
        dino_save(root, it, m, o)
    ckptio.put(b"torn", f"{root}/399/__0_0.distcp")  # a save killed before .metadata: incomplete
    ckptio.dcp.save({"x": torch.zeros(1)}, f"{root}/000000000500")  # ckptio-style padded name: not DINOv3's
    ckptio.dcp.save({"x": torch.zeros(1)}, f"{root}/1")  # ckptio's own hand-named step (has the marker)
    ckptio.put(b"{}", f"{root}/1/checkpoint.json")

    for where in (root, out):  # the ckpt directory, or the job directory above it
        s = find(where)
        assert s is not None and s.kind == "dinov3" and s.layout == "dcp"
        assert s.uri == root
        assert s.steps() == [99, 199, 299]
        assert s.latest() == 299
        t = s.target(199)
        assert (t.step, t.fmt, t.uri, dict(t.files)) == (199, "dcp", f"{root}/199", {})

    fresh, fresh_o, _, _ = trained(7)
    state = dino_state(fresh, fresh_o, -1)
    ckptio.dcp.load(state, s.target(199).uri)
    dcpsd.set_model_state_dict(fresh, state["model"])
    assert state["iteration"] == 199 and same_weights(fresh, models[199][0])

    with pytest.raises(IncompleteCheckpointError, match="399"):
        s.target(399)
    with pytest.raises(NotFoundError, match="no dinov3 checkpoint of step 5"):
        s.target(5)


def test_dinov3_keep_copies_and_temporary_directories(tmp_path):
    root = str(tmp_path / "ckpt")
    m, o, _, _ = trained(0)
    dino_save(root, 99, m, o)
    dino_keep(root, 99)
    dino_save(root, 199, m, o)
    shutil.rmtree(os.path.join(root, "99"))  # keep_last_n_checkpoints(ckpt_dir, 1): the _keep copy stays
    # a save killed between dcp.save and the rename: a complete DCP checkpoint under the temporary name
    tmp = tempfile.mkdtemp(dir=root, prefix="299")
    dcp.save(dino_state(m, o, 299), storage_writer=FileSystemWriter(tmp))

    s = find(root)
    assert s is not None and s.steps() == [199] and s.kept() == [99] and s.latest() == 199
    assert s.target(99).uri == f"{root}/99_keep"  # only the kept copy holds step 99


def test_not_a_seed_root(tmp_path, s3_uri):
    assert find(str(tmp_path / "nothing")) is None
    ckpt = ckptio.Checkpointer(str(tmp_path / "ours"), format="dcp")
    ckpt.save(3, {"w": torch.ones(2)})
    assert find(str(tmp_path / "ours")) is None  # ckptio's own checkpoints are not a seed's
    ckptio.put(b"x", f"{s3_uri}/run/7/__0_0.distcp")  # an integer directory with no complete DCP checkpoint
    assert find(f"{s3_uri}/run") is None


# ---- Cosmos: the DDP checkpointer's files, and the other two variants -----------------------------------
def cosmos_states(seed: int, iteration: int) -> dict:
    model, optim, sched, scaler = trained(seed)
    return {
        "model": model.state_dict(),
        "optim": optim.state_dict(),
        "scheduler": sched.state_dict(),
        "trainer": {"grad_scaler": scaler.state_dict(), "iteration": iteration},
    }


def put_pt(obj, uri: str) -> None:
    if "://" in uri:
        ckptio.dump(obj, uri)
    else:
        os.makedirs(os.path.dirname(uri), exist_ok=True)
        torch.save(obj, uri)


def cosmos_save(root: str, iteration: int, layout: str = "flat", keys=KEYS, pointer: bool = True) -> dict:
    """Each key's state torch.save'd in Cosmos's order (model, optim, scheduler, trainer), then the pointer."""
    states = cosmos_states(iteration, iteration)
    name = f"iter_{iteration:09d}"
    for k in keys:
        if layout == "flat":
            put_pt(states[k], f"{root}/{name}.pt" if k == "trainer" else f"{root}/{name}_{k}.pt")
        elif layout == "by-key":
            put_pt(states[k], f"{root}/{k}/{name}.pt")
        else:
            ckptio.dcp.save(states[k], f"{root}/{name}/{k}")
    if pointer:
        ckptio.put_text(f"{name}.pt\n" if layout != "dcp" else f"{name}\n", f"{root}/latest_checkpoint.txt")
    return states


def assert_same_tree(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same_tree(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same_tree(x, y)
    else:
        assert a == b


@pytest.mark.parametrize("backend", BACKENDS)
def test_cosmos_flat_steps_latest_target_and_parts(backend, request):
    job = request.getfixturevalue(f"{backend}_uri") + "/proj/group/name"
    root = job + "/checkpoints"
    states = {it: cosmos_save(root, it) for it in (10, 20)}
    ckptio.put_text('{"image": 0}', f"{root}/iter_000000020_trained_data_record.json")  # ignored
    cosmos_save(root, 30, keys=("model", "optim"), pointer=False)  # killed mid-save: no scheduler, trainer

    for where in (root, job):
        s = find(where)
        assert s is not None and (s.kind, s.layout, s.uri) == ("cosmos", "flat", root)
        assert s.steps() == [10, 20] and s.pointer() == 20 and s.latest() == 20

    t = s.target(20)
    assert (t.step, t.fmt, t.uri) == (20, "pt-parts", root)
    assert t.files == {
        "model": f"{root}/iter_000000020_model.pt",
        "optim": f"{root}/iter_000000020_optim.pt",
        "scheduler": f"{root}/iter_000000020_scheduler.pt",
        "trainer": f"{root}/iter_000000020.pt",
    }
    parts = read_parts(t, KEYS)
    for k in KEYS:
        assert_same_tree(parts[k], states[20][k])
    assert parts["trainer"]["iteration"] == 20

    model, optim, sched, scaler = trained(99)  # what a resume does with them
    model.load_state_dict(parts["model"])
    optim.load_state_dict(parts["optim"])
    sched.load_state_dict(parts["scheduler"])
    scaler.load_state_dict(parts["trainer"]["grad_scaler"])
    assert same_weights(model, trained(20)[0]) and scaler.get_scale() == 2.0**20

    with pytest.raises(IncompleteCheckpointError, match="30"):
        s.target(30)
    with pytest.raises(KeyError, match="ema"):
        read_parts(t, ["ema"])


@pytest.mark.parametrize("backend", BACKENDS)
def test_cosmos_parts_read_only_the_requested_files(backend, request):
    root = request.getfixturevalue(f"{backend}_uri") + "/checkpoints"
    states = cosmos_save(root, 10)
    ckptio.put(b"PK\x03\x04 not a torch file", f"{root}/iter_000000010_optim.pt")  # reading it would fail
    t = find(root).target(10)
    parts = read_parts(t, ["model", "trainer"])
    assert sorted(parts) == ["model", "trainer"]
    assert_same_tree(parts["model"], states["model"])
    with pytest.raises(Exception, match="iter_000000010_optim.pt"):
        read_parts(t, ["optim"])


@pytest.mark.parametrize("backend", BACKENDS)
def test_cosmos_pointer_to_an_incomplete_or_torn_step_falls_back(backend, request):
    root = request.getfixturevalue(f"{backend}_uri") + "/checkpoints"
    cosmos_save(root, 10)
    cosmos_save(root, 20, keys=("model",))  # pointer written, the rest of the step never came
    s = find(root)
    assert s.steps() == [10] and s.pointer() == 20
    with pytest.warns(CheckpointWarning, match="names step 20.*using step 10"):
        assert s.latest() == 10

    cosmos_save(root, 30, pointer=False)
    data = ckptio.get(f"{root}/iter_000000030.pt")
    ckptio.put(data[: len(data) // 2], f"{root}/iter_000000030.pt")  # the trainer file torn mid-write
    s = find(root)
    assert s.steps() == [10, 30]  # present, so listed ...
    with pytest.warns(CheckpointWarning, match="using step 10"):
        assert s.latest() == 10  # ... but not resumed from

    ckptio.put_text("garbage\n", f"{root}/latest_checkpoint.txt")
    s = find(root)
    with pytest.warns(CheckpointWarning, match="malformed"):
        assert s.pointer() is None


def test_cosmos_legacy_torch_files_count_as_whole(tmp_path):
    root = str(tmp_path)
    cosmos_save(root, 10)
    torch.save({"iteration": 10}, f"{root}/iter_000000010.pt", _use_new_zipfile_serialization=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CheckpointWarning)
        assert find(root).latest() == 10


@pytest.mark.parametrize("backend", BACKENDS)
def test_cosmos_by_key_layout(backend, request):
    """cosmos-predict2's checkpointer: checkpoints/<key>/iter_<09d>.pt, the pointer written after each key."""
    root = request.getfixturevalue(f"{backend}_uri") + "/checkpoints"
    states = cosmos_save(root, 5, layout="by-key")
    cosmos_save(root, 10, layout="by-key", keys=("model", "optim"))
    s = find(root)
    assert (s.kind, s.layout, s.steps()) == ("cosmos", "by-key", [5])
    with pytest.warns(CheckpointWarning, match="names step 10"):
        assert s.latest() == 5
    t = s.target(5)
    assert t.fmt == "pt-parts" and t.files == {k: f"{root}/{k}/iter_000000005.pt" for k in KEYS}
    assert_same_tree(read_parts(t, ["scheduler"])["scheduler"], states["scheduler"])


@pytest.mark.parametrize("backend", BACKENDS)
def test_cosmos_dcp_layout(backend, request):
    """The imaginaire DCP checkpointer: checkpoints/iter_<09d>/<key>/ DCP directories, pointer 'iter_<09d>'."""
    root = request.getfixturevalue(f"{backend}_uri") + "/checkpoints"
    states = cosmos_save(root, 1000, layout="dcp")
    cosmos_save(root, 2000, layout="dcp", keys=("model", "optim", "scheduler"), pointer=False)
    s = find(root)
    assert (s.kind, s.layout, s.steps(), s.latest()) == ("cosmos", "dcp", [1000], 1000)
    t = s.target(1000)
    assert (t.fmt, t.uri) == ("dcp-parts", f"{root}/iter_000001000")
    assert t.files == {k: f"{root}/iter_000001000/{k}" for k in KEYS}
    model = trained(3)[0]
    sd = model.state_dict()
    ckptio.dcp.load(sd, t.files["model"])
    assert_same_tree(sd, states["model"])
    with pytest.raises(ValueError, match="ckptio.dcp.load"):
        read_parts(t, ["model"])


def test_cosmos_pointer_alone(tmp_path):
    ckptio.put_text("iter_000000010.pt\n", str(tmp_path / "latest_checkpoint.txt"))
    s = find(str(tmp_path))
    assert s is not None and s.kind == "cosmos" and s.steps() == [] and s.latest() is None


def test_checkpointer_in_a_dinov3_root_leaves_the_seed_steps_alone(tmp_path):
    """A Checkpointer saving into DINOv3's ckpt directory (no retention rule: 'nothing is deleted')
    must not delete DINOv3's step directories (it did: its first commit discarded every all-digit
    directory below the latest without checkpoint.json as debris). More: tests/test_retention.py."""
    root = str(tmp_path / "ckpt")
    m, o, _, _ = trained(0)
    for it in (99, 199):
        dino_save(root, it, m, o)
    ckptio.Checkpointer(root, format="dcp").save(299, {"w": torch.ones(2)})
    s = find(root)
    assert s is not None and s.steps() == [99, 199]

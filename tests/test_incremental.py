"""Incremental checkpoints (``Checkpointer(incremental=True)``): unchanged content is stored once.

Real storage throughout (local, memory, S3 on moto): bytes written per save, exact loads of every
kept step, the sweep after retention and its grace period, damaged content objects, crafted recipes,
and ``ckptio du`` (saves killed anywhere: test_incremental_kill.py)."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch

import ckptio
from ckptio.checkpointer import Checkpointer, usage
from ckptio.cli import main as cli_main
from ckptio.errors import FormatError, IntegrityError
from ckptio.incremental import CONTENT_DIR, MAGIC, recipe
from conftest import flip_byte

pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
    pytest.mark.filterwarnings("ignore::ckptio.checkpointer.CheckpointWarning"),
]
FROZEN = 8  # 1 MiB tensors that never change


def make_state(step: int, frozen_seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(frozen_seed)
    model = {f"backbone.{i}": torch.randn(512, 512, generator=g) for i in range(FROZEN)}
    model["head"] = torch.full((64, 64), float(step))
    return {"model": model, "trainer": {"step": step}}


def check(ck: Checkpointer, step: int, frozen_seed: int = 0) -> None:
    st: dict = {"model": {}, "trainer": {}}
    assert ck.load(st, step=step, strict=False) == step
    want = make_state(step, frozen_seed)
    assert st["trainer"] == want["trainer"]
    assert st["model"].keys() == want["model"].keys()
    for k, v in want["model"].items():
        assert torch.equal(st["model"][k], v), (step, k)


def content_files(root: str) -> list[str]:
    out = []
    for d, _, files in os.walk(os.path.join(root, CONTENT_DIR)):
        out += [os.path.join(d, f) for f in files]
    return sorted(out)


@pytest.mark.parametrize("fmt", ["fpk", "pt", "dcp"])
@pytest.mark.parametrize("where", ["local", "memory"])
def test_round_trip_writes_only_what_changed(fmt, where, tmp_path, memory_uri):
    root = str(tmp_path / "run") if where == "local" else memory_uri + "/run"
    ck = Checkpointer(root, format=fmt, incremental=True)
    for step in range(1, 6):
        ck.save(step, make_state(step))
        res = ck.last_save
        assert res is not None and res.step == step and res.logical_bytes > FROZEN << 20
        if step == 1:
            assert res.bytes_written >= res.logical_bytes
        else:  # the head, the metadata and the recipe: a few hundred KiB of 8 MiB
            assert res.bytes_written < res.logical_bytes * 0.1, (step, res)
    assert ck.list() == [1, 2, 3, 4, 5]
    for step in ck.list():
        check(ck, step)
        check(Checkpointer(root, format=fmt), step)  # a Checkpointer without incremental=True reads them too
    report = usage(root)
    assert [r["step"] for r in report["steps"]] == [1, 2, 3, 4, 5]
    assert all(r["incremental"] and r["own_bytes"] < r["logical_bytes"] * 0.1 for r in report["steps"])
    assert report["unreferenced_content_bytes"] == 0
    assert report["physical_bytes"] < 2 * report["steps"][0]["logical_bytes"]


def test_async_save(tmp_path):
    root = str(tmp_path)
    with Checkpointer(root, format="fpk", incremental=True, async_save=True, keep_last=2, content_grace=0) as ck:
        for step in range(1, 5):
            ck.save(step, make_state(step))
        ck.wait()
        assert ck.last_save.step == 4 and ck.last_save.bytes_written < ck.last_save.logical_bytes * 0.1
        for step in ck.list():
            check(ck, step)


def test_retention_sweeps_unreferenced_content(tmp_path):
    root = str(tmp_path)
    ck = Checkpointer(root, format="fpk", incremental=True, keep_last=2, content_grace=0)
    ck.save(1, make_state(1, frozen_seed=1))
    old = {p for p in content_files(root) if os.path.getsize(p) == 1 << 20}  # step 1's backbone
    assert len(old) == FROZEN
    ck.save(2, make_state(2, frozen_seed=2))  # new backbone: step 1's content is kept while step 1 is
    assert old <= set(content_files(root))
    ck.save(3, make_state(3, frozen_seed=2))  # step 1 deleted: its backbone is referenced by nothing
    assert ck.list() == [2, 3]
    assert not old & set(content_files(root))
    check(ck, 2, frozen_seed=2)
    check(ck, 3, frozen_seed=2)
    assert usage(root)["unreferenced_content_bytes"] == 0


def test_grace_period_keeps_young_content(tmp_path):
    root = str(tmp_path)
    ck = Checkpointer(root, format="fpk", incremental=True, keep_last=1)  # content_grace: one hour
    ck.save(1, make_state(1, frozen_seed=1))
    ck.save(2, make_state(2, frozen_seed=2))
    assert ck.list() == [2]
    assert usage(root)["unreferenced_content_bytes"] >= FROZEN << 20  # step 1's backbone: too young to go
    Checkpointer(root, format="fpk", incremental=True, keep_last=1, content_grace=0).save(3, make_state(3, 2))
    assert usage(root)["unreferenced_content_bytes"] == 0


def test_damaged_content_fails_every_step_using_it(tmp_path):
    root = str(tmp_path)
    ck = Checkpointer(root, format="fpk", incremental=True)
    for step in (1, 2, 3):
        ck.save(step, make_state(step))
    sizes = {p: os.path.getsize(p) for p in content_files(root)}
    victim = next(p for p, n in sizes.items() if n == 1 << 20)  # a backbone tensor's block
    flip_byte(victim, 12345)
    for step in (1, 2, 3):
        with pytest.raises(IntegrityError, match=os.path.basename(victim)) as e:
            check(ck, step)
        assert f"{step:012d}" in str(e.value)  # and the step's file
    os.remove(victim)
    with pytest.raises(IntegrityError, match="missing"):
        check(ck, 2)


@pytest.mark.parametrize("fmt", ["fpk", "dcp"])
@pytest.mark.parametrize("where", ["local", "memory"])
def test_short_or_damaged_content_object_is_named(fmt, where, tmp_path, memory_uri):
    """Both read paths (a local file read and hashed in pieces, other storages whole): a content object
    cut short or with one byte changed fails the load with an IntegrityError naming it."""
    root = str(tmp_path / "r") if where == "local" else memory_uri + "/r"
    ck = Checkpointer(root, format=fmt, incremental=True)
    ck.save(1, make_state(1))
    backend, resolved = ckptio.resolve(root)
    blocks = [i for i in backend.list(resolved + "/" + CONTENT_DIR, recursive=True) if i.size == 1 << 20]
    assert blocks
    victim = blocks[0].uri
    good = backend.read(victim)
    for bad in (good[:-1], good[:4096] + bytes([good[4096] ^ 1]) + good[4097:]):
        backend.write(victim, bad)
        with pytest.raises(IntegrityError, match=victim.rsplit("/", 1)[-1]):
            check(ck, 1)
    backend.write(victim, good)
    check(ck, 1)


@pytest.mark.parametrize("fmt", ["fpk", "dcp"])
@pytest.mark.parametrize("kind", ["directory", "fifo", "file_for_folder", "denied", "io_error"])
def test_a_content_object_that_cannot_be_read_is_named(fmt, kind, tmp_path, monkeypatch):
    """A local content object replaced by a directory or a pipe (read as empty, never waited on), its
    folder by a file, one the OS refuses to open, or a read failing with EIO: the load fails with an
    error naming the content object's URI (made only for the error) and the step file; nothing hangs."""
    import errno
    import shutil

    from ckptio.errors import AccessDeniedError
    from ckptio.incremental import store

    root = str(tmp_path / "r")
    ck = Checkpointer(root, format=fmt, incremental=True)
    ck.save(1, make_state(1))
    victim = next(p for p in content_files(root) if os.path.getsize(p) == 1 << 20)
    name = os.path.basename(victim)
    expect: type[Exception] = IntegrityError
    if kind == "directory":
        os.remove(victim)
        os.mkdir(victim)
        match = f"{name} is a directory"
    elif kind == "fifo":
        os.remove(victim)
        os.mkfifo(victim)
        match = f"{name} is not a regular file"
    elif kind == "file_for_folder":
        folder = os.path.dirname(victim)
        shutil.rmtree(folder)
        open(folder, "wb").close()
        match = f"{name} is missing"
    elif kind == "denied":
        real = store.open_for_reading

        def refuse(path: str) -> int:
            if os.path.basename(path) == name:
                raise OSError(errno.EACCES, "Permission denied", path)
            return real(path)

        monkeypatch.setattr(store, "open_for_reading", refuse)
        expect, match = AccessDeniedError, name
    else:  # the read itself fails: an OSError naming neither the object nor the file
        for fn in ("preadinto", "preadinto_each"):  # read whole (checked), or in pieces (the caller checks)
            real_read = getattr(store, fn)

            def fail(fd, mv, *rest, _real=real_read):
                if os.fstat(fd).st_ino == os.stat(victim).st_ino:
                    raise OSError(errno.EIO, "Input/output error")
                return _real(fd, mv, *rest)

            monkeypatch.setattr(store, fn, fail)
        # DCP's reader raises it wrapped in torch's CheckpointException, whose text carries it
        expect, match = Exception, f"{CONTENT_DIR}.*{name}: Input/output error"
    with pytest.raises(expect, match=match) as e:
        check(ck, 1)
    if kind in ("denied", "io_error"):  # and the step file using it
        assert "000000000001" in str(e.value) + "".join(getattr(e.value, "__notes__", []))


@pytest.mark.parametrize("fmt", ["fpk", "dcp"])
def test_recipe_reads_are_checked_by_their_blocks_and_the_format(fmt, tmp_path):
    """A recipe's bytes are checked against the blocks' 128-bit names as they are read, and by the
    format's own payload checksums (a block's name does not say it is the tensor's: test_incremental_trust);
    a damaged block fails the load naming it."""
    from ckptio.incremental import BlockStore, IncrementalBackend

    root = str(tmp_path / "r")
    ck = Checkpointer(root, format=fmt, incremental=True)
    ck.save(1, make_state(1))
    check(ck, 1)
    backend, resolved = ckptio.resolve(root)
    inc = IncrementalBackend(backend, BlockStore(backend, resolved + "/" + CONTENT_DIR))
    names = [i.uri for i in backend.list(resolved, recursive=True) if not i.is_dir and CONTENT_DIR not in i.uri]
    assert any(inc.assembled(u) for u in names)  # the data file: a recipe
    assert not all(inc.assembled(u) for u in names)  # small files are stored plainly
    victim = next(p for p in content_files(root) if os.path.getsize(p) == 1 << 20)
    flip_byte(victim, 777)
    with pytest.raises(IntegrityError, match=os.path.basename(victim)):
        check(ck, 1)


@pytest.mark.parametrize("fmt", ["fpk", "dcp"])
def test_what_a_save_references_is_what_its_recipes_name(fmt, s3_uri):
    """A commit takes the blocks this process just wrote as the step's references without reading its
    recipes back: they must be exactly what a fresh reader finds (else a sweep could delete live content)."""
    from ckptio.checkpointer.content import Content

    root = s3_uri + "/refs"
    ck = Checkpointer(root, format=fmt, incremental=True)
    for step in (1, 2):
        ck.save(step, make_state(step))
    fresh = Content(ck._layout, grace=0)
    for step in (1, 2):
        assert ck._content._refs[step] == fresh.referenced([step])[0]
    assert ck._layout.committed_among([0, 1, 2, 3]) == [1, 2]


def test_unchanged_dcp_state_writes_no_content_again(tmp_path):
    """Tensor items frame identically at every save (their torch archive id is named by the item), so
    saving the same tensors again stores no new content object."""
    ck = Checkpointer(str(tmp_path), format="dcp", incremental=True)
    state = make_state(1)
    ck.save(1, state)
    before = set(content_files(str(tmp_path)))
    ck.save(2, state)
    assert set(content_files(str(tmp_path))) == before
    assert ck.last_save.bytes_written < 64 << 10
    st: dict = {"model": {}, "trainer": {}}
    assert ck.load(st, step=2, strict=False) == 2
    assert all(torch.equal(st["model"][k], v) for k, v in state["model"].items())


H = "0" * 32


@pytest.mark.parametrize(
    "body",
    [
        {"hash": "xxh3_128", "size": 4, "blocks": [["../../../../etc/passwd", 4]]},
        {"hash": "xxh3_128", "size": 4, "blocks": [["../" + H[3:], 4]]},
        {"hash": "xxh3_128", "size": 4, "blocks": [[H.upper().replace("0", "A"), 4]]},
        {"hash": "xxh3_128", "size": 4, "blocks": [[H + "0", 4]]},
        {"hash": "xxh3_128", "size": 5, "blocks": [[H, 4]]},
        {"hash": "xxh3_128", "size": 0, "blocks": [[H, 0]]},
        {"hash": "xxh3_128", "size": -4, "blocks": [[H, -4]]},
        {"hash": "xxh3_128", "size": 1 << 40, "blocks": [[H, 1 << 40]]},
        {"hash": "xxh3_128", "size": 4, "blocks": [[H, 4.0]]},
        {"hash": "sha1", "size": 4, "blocks": [[H, 4]]},
        {"hash": "xxh3_128", "size": 4, "blocks": [[H, 4]], "path": "/etc"},
        {"hash": "xxh3_128", "size": 4, "blocks": {"a": 1}},
        [1, 2],
    ],
)
def test_crafted_recipe_is_refused(tmp_path, body):
    root = str(tmp_path / "run")
    ck = Checkpointer(root, format="fpk", incremental=True)
    ck.save(1, make_state(1))
    outside = tmp_path / "etc"
    outside.mkdir()
    (outside / "passwd").write_bytes(b"root")
    data = os.path.join(ck.uri(1), "state.fpk")
    with open(data, "wb") as f:
        f.write(MAGIC + json.dumps(body).encode())
    with pytest.raises(FormatError, match="not a valid ckptio recipe"):
        check(ck, 1)


def test_recipe_block_count_is_bounded(monkeypatch):
    monkeypatch.setattr(recipe, "MAX_BLOCKS", 3)
    body = {"hash": "xxh3_128", "size": 4, "blocks": [[H, 1]] * 4}
    with pytest.raises(FormatError, match="at most 3"):
        recipe.parse_recipe(MAGIC + json.dumps(body).encode(), "x")
    with pytest.raises(FormatError, match="not JSON"):
        recipe.parse_recipe(MAGIC + b"{", "x")


def test_s3_round_trip(s3_uri):
    root = s3_uri + "/run"
    ck = Checkpointer(root, format="fpk", incremental=True, keep_last=2, content_grace=0)
    for step in range(1, 5):
        ck.save(step, make_state(step, frozen_seed=0 if step < 3 else 1))
        if step in (2, 4):
            assert ck.last_save.bytes_written < ck.last_save.logical_bytes * 0.1
    assert ck.list() == [3, 4]
    for step in ck.list():
        check(ck, step, frozen_seed=1)
    assert usage(root)["unreferenced_content_bytes"] == 0


def test_du_cli(tmp_path, capsys):
    root = str(tmp_path)
    ck = Checkpointer(root, format="fpk", incremental=True)
    for step in (1, 2):
        ck.save(step, make_state(step))
    assert cli_main(["du", "--json", root]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [r["step"] for r in data["steps"]] == [1, 2] and data["physical_bytes"] > FROZEN << 20
    assert cli_main(["du", root]) == 0
    assert "physical" in capsys.readouterr().out


@pytest.mark.parametrize("fmt", ["fpk", "pt", "dcp"])
def test_direct_access_to_a_step_reads_through_the_roots_content(fmt, tmp_path, capsys):
    """``ckptio.load``, ``ckptio info`` and ``ckptio verify`` on an incremental step's data (recipes)."""
    root = str(tmp_path / "run")
    ck = Checkpointer(root, format=fmt, incremental=True)
    for step in (1, 2):
        ck.save(step, make_state(step))
    target = ck.uri(2) if fmt == "dcp" else os.path.join(ck.uri(2), f"state.{fmt}")
    if fmt != "dcp":
        with open(target, "rb") as f:
            assert f.read(len(MAGIC)) == MAGIC
        got = ckptio.load(target, **({"weights_only": True} if fmt == "pt" else {}))
        for k, v in make_state(2)["model"].items():
            assert torch.equal(got["model"][k], v), k
    info = ckptio.info(target)
    assert sum(t["nbytes"] for t in info["tensors"]) >= FROZEN << 20
    assert ckptio.verify(target)["ok"]
    assert cli_main(["verify", target]) == 0
    capsys.readouterr()
    victim = next(p for p in content_files(root) if os.path.getsize(p) == 1 << 20)
    flip_byte(victim, 7)
    with pytest.raises(IntegrityError):
        ckptio.verify(target)


@pytest.mark.parametrize("fmt", ["fpk", "dcp"])
def test_gcs_round_trip_and_load_through_the_node_cache(fmt, gcs_uri, tmp_path):
    root = gcs_uri + "/run"
    ck = Checkpointer(root, format=fmt, incremental=True, keep_last=2, content_grace=0)
    for step in (1, 2, 3):
        ck.save(step, make_state(step))
        if step > 1:
            assert ck.last_save.bytes_written < ck.last_save.logical_bytes * 0.1
    assert ck.list() == [2, 3]
    cache_dir = str(tmp_path / "cache")
    for _ in range(2):  # fills the cache, then reads from it
        for step in ck.list():
            want = make_state(step)
            st = {"model": {k: torch.zeros_like(v) for k, v in want["model"].items()}, "trainer": {"step": 0}}
            assert ck.load(st, step=step, cache=cache_dir) == step
            assert st["trainer"] == want["trainer"]
            for k, v in want["model"].items():
                assert torch.equal(st["model"][k], v), (step, k)
    cached = [os.path.join(d, f) for d, _, fs in os.walk(cache_dir) for f in fs]
    assert sum(os.path.getsize(p) for p in cached) >= FROZEN << 20  # the content objects are cached
    assert usage(root)["unreferenced_content_bytes"] == 0


@pytest.mark.parametrize("where", ["local", "memory"])
def test_ranged_reads_through_recipes_from_many_threads(where, tmp_path, memory_uri):
    """Parts of blocks read at once from several threads (DCP resharding does), local content (read in
    the caller's thread) and not: exact bytes."""
    from concurrent.futures import ThreadPoolExecutor

    from ckptio.incremental import BlockStore, IncrementalBackend

    backend, root = ckptio.resolve(str(tmp_path / "r") if where == "local" else memory_uri + "/r")
    store = BlockStore(backend, root + "/.content", min_block=1000, max_block=4096)
    inc = IncrementalBackend(backend, store)
    data = os.urandom(50_000)
    with inc.open_writer(root + "/f") as w:
        for i in range(0, len(data), 7000):
            w.write(data[i : i + 7000])
    assert inc.stat(root + "/f").size == len(data)
    spans = [(a, a + n) for a in range(0, len(data), 1234) for n in (1, 333, 5000)]
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda s: inc.read_range(root + "/f", *s), spans))
    assert got == [data[a:b] for a, b in spans]
    inc.close()


def test_sweep_lists_content_only_when_something_can_be_due(tmp_path, monkeypatch):
    from ckptio.incremental import BlockStore

    root = str(tmp_path)
    ck = Checkpointer(root, format="fpk", incremental=True, content_grace=0)
    ck.save(1, make_state(1))  # a new Checkpointer sweeps at its first commit (killed processes' leftovers)
    listings = []
    real_entries, real_put = BlockStore._entries, BlockStore.put
    monkeypatch.setattr(BlockStore, "_entries", lambda self: listings.append(1) or real_entries(self))
    ck.save(2, make_state(2))
    assert listings == []  # nothing deleted, nothing failed: no listing of .content

    def failing_put(self, h, data, durable=True):
        if failing_put.calls == 2:
            raise OSError("injected")
        failing_put.calls += 1
        return real_put(self, h, data, durable)

    failing_put.calls = 0
    monkeypatch.setattr(BlockStore, "put", failing_put)
    with pytest.raises(OSError, match="injected"):
        ck.save(3, make_state(3, frozen_seed=5))
    monkeypatch.setattr(BlockStore, "put", real_put)
    assert usage(root)["unreferenced_content_bytes"] >= 2 << 20  # the failed save's blocks
    time.sleep(0.01)
    ck.save(3, make_state(3))
    assert listings and usage(root)["unreferenced_content_bytes"] == 0
    for step in ck.list():
        check(ck, step)


def test_sweep_uses_the_steps_retention_found(tmp_path, monkeypatch):
    """The commit's retention lists the steps once; the content sweep takes them from it (no second
    listing and marker checks per step, each a request on object stores)."""
    from ckptio.checkpointer.manifest import Layout

    ck = Checkpointer(str(tmp_path), format="fpk", incremental=True, keep_last=2, content_grace=0)
    ck.save(1, make_state(1, frozen_seed=1))
    calls = []
    real = Layout.list
    monkeypatch.setattr(Layout, "list", lambda self: calls.append(1) or real(self))
    ck.save(2, make_state(2, frozen_seed=2))
    ck.save(3, make_state(3, frozen_seed=2))  # step 1 deleted by retention, its content swept
    assert calls == []
    monkeypatch.undo()
    assert ck.list() == [2, 3]
    assert usage(str(tmp_path))["unreferenced_content_bytes"] == 0
    check(ck, 3, frozen_seed=2)

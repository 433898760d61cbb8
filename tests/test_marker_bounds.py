"""Markers, pointers, recipes and a cache entry's metadata that are damaged, crafted or oversized (issue 51,
items 2 and 5): reading one allocates no more than its cap and what the storage holds, and ends in a
success, the documented fallback, or a ckptio error naming the file; never a raw exception.

The memory checks run in a capped child (``marker_workers``): how far the peak RSS grew during the
operation. The class around these cases is fuzzed in test_marker_fuzz.py.
"""

from __future__ import annotations

import json
import os
import sys
import warnings

import pytest
import torch

import ckptio
from ckptio.checkpointer import Checkpointer, CheckpointWarning, is_complete, load_model
from ckptio.checkpointer.catalog import catalog
from ckptio.errors import CkptioError, FormatError

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from conftest import S3_TEST_OPTIONS  # noqa: E402
from marker_workers import b64, run_jobs  # noqa: E402
from servers import make_s3_bucket  # noqa: E402

MIB = 1 << 20
DEEP = {"deep": 100_000}


def _s3(request, where: str) -> tuple[dict | None, str | None]:
    """(the child's S3 settings, a fresh bucket) for ``where == "s3"``."""
    if where != "s3":
        return None, None
    endpoint = request.getfixturevalue("s3_endpoint")
    bucket = f"m{os.urandom(6).hex()}"
    make_s3_bucket(endpoint, bucket)
    return {"endpoint_url": endpoint, **S3_TEST_OPTIONS}, bucket


# ---- item 2: allocations bounded by what the storage holds ------------------------------------------
@pytest.mark.parametrize("where", ["local", "memory", "s3"])
def test_a_recipe_claiming_more_than_its_blocks_hold_allocates_nothing_for_it(where, request):
    """A 207-byte recipe whose last block claims 1 GiB grew a load by 1 GiB before its IntegrityError (the
    block's buffer came from the claim), and a claim of 500 MiB made a .pt load allocate the whole file's
    claimed size; now each block's stored size is confirmed before anything is sized from the recipe."""
    s3, bucket = _s3(request, where)
    jobs = [
        {
            "target": "recipe",
            "op": op,
            "fmt": fmt,
            "incremental": True,
            "where": where,
            "bucket": bucket,
            "mutation": {"claim": claim},
        }
        for fmt in ("fpk", "pt", "dcp")
        for op in ("load", "load_model")
        for claim in (1 << 30, 500 * MIB)
    ]
    for r in run_jobs(jobs, s3=s3, headroom=1536 * MIB):
        assert r["outcome"] == "ckptio" and "IntegrityError" in r["msg"], r
        assert ".content/" in r["msg"] and "bytes where its recipe says" in r["msg"], r
        assert r["grew"] < 64 * MIB, r


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_recipe_past_its_first_read_is_read_by_its_size(where, request):
    """A recipe over 64 KiB was read on with a ranged read to 128 MiB, whose buffer an object store
    allocated whole; now to the size the storage gives. Its blocks are looked up a few rounds at a time,
    stopping at the first missing one."""
    s3, bucket = _s3(request, where)
    job = {
        "target": "recipe",
        "op": "load",
        "fmt": "fpk",
        "incremental": True,
        "where": where,
        "bucket": bucket,
        "mutation": {"blocks": 3000},
    }
    [r] = run_jobs([job], s3=s3)
    assert r["outcome"] == "ckptio" and "is missing" in r["msg"] and "state.fpk" in r["msg"], r
    assert r["grew"] < 48 * MIB, r


@pytest.mark.parametrize("where", ["local", "s3"])
def test_oversized_markers_are_refused_before_they_are_read(where, request):
    """A 64 MiB checkpoint.json cost 184 MiB of RSS on load; each marker now has a cap, checked against the
    size the storage gives before its bytes are read. A pointer past its cap is malformed (the fallback);
    a cache entry's metadata past its cap is a miss."""
    s3, bucket = _s3(request, where)
    big = {"fill": b64(b" "), "size": 64 * MIB}
    jobs = [
        {"target": t, "op": op, "fmt": "pt", "where": where, "bucket": bucket, "mutation": big}
        for t, op in [
            ("checkpoint.json", "load"),
            ("checkpoint.json", "is_complete"),
            ("latest.txt", "load"),
            ("kept.json", "save"),
            ("tier.json", "load"),
        ]
    ]
    jobs.append({"target": "cache-meta", "op": "cached_load", "fmt": "pt", "mutation": big})
    for r in run_jobs(jobs, s3=s3, headroom=1024 * MIB):
        target, op = r["job"]["target"], r["job"]["op"]
        if target in ("latest.txt", "cache-meta") or op == "is_complete":
            assert r["outcome"] == "ok", r
        else:
            assert r["outcome"] == "ckptio" and "67108864 bytes, more than" in r["msg"], r
            assert f"{target}: 67108864" in r["msg"] or f"{target}: damaged (67108864" in r["msg"], r
        if target == "latest.txt":
            assert any("latest.txt" in w and "more than" in w for w in r["warnings"]), r
        assert r["grew"] < 24 * MIB, r


def test_a_marker_ckptio_could_not_read_back_is_not_written(tmp_path):
    ck = Checkpointer(str(tmp_path), format="pt")
    ck.save(1, {"w": torch.ones(2)})
    metrics = {f"m{i}": float(i) for i in range(400_000)}
    with pytest.raises(ValueError, match=r"000000000002/checkpoint.json: would hold .*nothing was written"):
        ck.save(2, {"w": torch.ones(2)}, metrics=metrics)
    assert ck.list() == [1] and ck.load({"w": torch.zeros(2)}) == 1


# ---- item 5: pointers that fall back, markers that fail naming themselves ----------------------------
POINTERS = {"not UTF-8": b"\xff\xfe\x00\n", "5000 digits": b"9" * 5000 + b"\n", "deep": b"[" * 100_000}


@pytest.mark.parametrize("content", list(POINTERS.values()), ids=list(POINTERS))
def test_a_malformed_latest_pointer_falls_back_for_load_and_save(content, tmp_path):
    """latest.txt holding invalid UTF-8 or 5,000 digits made load and the next save raise
    UnicodeDecodeError/ValueError naming no file; the docs promise the newest complete step."""
    root = str(tmp_path / "run")
    ck = Checkpointer(root, format="pt")
    for step in (1, 2):
        ck.save(step, {"w": torch.full((2,), float(step))})
    with open(os.path.join(root, "latest.txt"), "wb") as f:
        f.write(content)
    state = {"w": torch.zeros(2)}
    with pytest.warns(CheckpointWarning, match="latest.txt") as caught:
        assert Checkpointer(root, format="pt").load(state) == 2
    assert any("newest complete checkpoint, step 2" in str(w.message) for w in caught)
    assert torch.equal(state["w"], torch.full((2,), 2.0))
    with pytest.warns(CheckpointWarning, match="latest.txt"):
        assert load_model(torch.nn.Module(), root, key=None, strict=False) == 2
    with pytest.warns(CheckpointWarning, match="latest.txt"):
        Checkpointer(root, format="pt", keep_last=1).save(3, {"w": torch.full((2,), 3.0)})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the save wrote a good pointer
        assert Checkpointer(root, format="pt").load(state) == 3


COSMOS_POINTERS = {"not UTF-8": b"iter_\xff000000020.pt\n", "5000 digits": b"iter_" + b"9" * 5000 + b".pt\n"}


@pytest.mark.parametrize("content", list(COSMOS_POINTERS.values()), ids=list(COSMOS_POINTERS))
def test_a_malformed_cosmos_pointer_falls_back(content, tmp_path):
    from ckptio.checkpointer.seeds import find
    from test_seeds import cosmos_save

    root = str(tmp_path / "checkpoints")
    cosmos_save(root, 10)
    cosmos_save(root, 20, pointer=False)
    with open(os.path.join(root, "latest_checkpoint.txt"), "wb") as f:
        f.write(content)
    with pytest.warns(CheckpointWarning, match="latest_checkpoint.txt"):
        assert find(root).latest() == 20
    with pytest.warns(CheckpointWarning, match="latest_checkpoint.txt"):
        assert Checkpointer(root).load({"model": torch.nn.Module()}, strict=False) == 20


def test_cosmos_files_named_with_other_digits_are_not_steps(tmp_path):
    """int() and str.isdigit take '٠' and other digits: iter_٠٠٠٠٠٠٠٢٠*.pt beside a complete step 10 was
    step 20, and the load failed naming iter_000000020_model.pt, which never existed."""
    from ckptio.checkpointer.seeds import find
    from test_seeds import cosmos_save

    root = str(tmp_path / "checkpoints")
    cosmos_save(root, 10, pointer=False)
    for name in os.listdir(root):
        with open(os.path.join(root, name), "rb") as f:
            data = f.read()
        for digits in ("٠٠٠٠٠٠٠٢٠", "0" * 200 + "20", "１２３４５６７８９"):
            with open(os.path.join(root, name.replace("000000010", digits)), "wb") as f:
                f.write(data)
    assert find(root).steps() == [10]
    assert Checkpointer(root).load({"model": torch.nn.Module()}, strict=False) == 10


def test_deep_json_in_a_commit_marker(tmp_path):
    """JSON nested 100,000 deep in checkpoint.json raised a raw RecursionError from load, load_model,
    is_complete (which must say False) and retention after a committed save."""
    root = str(tmp_path / "run")
    ck = Checkpointer(root, format="pt")
    for step in (1, 2):
        ck.save(step, {"w": torch.ones(2)}, metrics={"loss": float(step)})
    for step in (1, 2):
        with open(os.path.join(ck.uri(step), "checkpoint.json"), "wb") as f:
            f.write(b"[" * 100_000 + b"]" * 100_000)
    where = r"000000000002/checkpoint.json: not valid JSON \(nested more than 32 deep\)"
    with pytest.raises(FormatError, match=where):
        Checkpointer(root, format="pt").load({"w": torch.zeros(2)})
    with pytest.raises(FormatError, match=where):
        load_model(torch.nn.Module(), root, key=None, strict=False)
    assert is_complete(ck.uri(2)) is False
    assert catalog(root)["steps"][1]["state"] == "damaged"
    keeper = Checkpointer(root, format="pt", keep_last=1, keep_best=1, best_metric="loss")
    with pytest.warns(CheckpointWarning, match="retention keeps step 1: .*000000000001/checkpoint.json"):
        keeper.save(3, {"w": torch.ones(2)}, metrics={"loss": 0.5})
    assert keeper.list() == [1, 2, 3]  # never deleted for a score it cannot read


@pytest.mark.parametrize("name", ["kept.json", "tier.json"])
def test_deep_json_in_kept_or_tier_json_is_an_error_naming_it(name, tmp_path):
    root, tier = str(tmp_path / "run"), str(tmp_path / "tier")
    kw = {"local_tier": tier} if name == "tier.json" else {}
    ck = Checkpointer(root, format="pt", keep_last=1, **kw)
    ck.save(1, {"w": torch.ones(2)})
    ck.keep(1, "first")
    ck.close()
    with open(os.path.join(tier if name == "tier.json" else root, name), "wb") as f:
        f.write(b"{" + b'"a":{' * 50_000 + b"}" * 50_001)
    with pytest.raises(CkptioError, match=name):
        Checkpointer(root, format="pt", keep_last=1, **kw).save(2, {"w": torch.ones(2)})


def test_deep_json_in_a_recipe_is_an_error_naming_it(tmp_path):
    from ckptio.incremental import MAGIC

    root = str(tmp_path / "run")
    ck = Checkpointer(root, format="fpk", incremental=True)
    ck.save(1, {"w": torch.ones(1 << 19)})
    data = os.path.join(ck.uri(1), "state.fpk")
    with open(data, "wb") as f:
        f.write(MAGIC + b"[" * 100_000 + b"]" * 100_000)
    with pytest.raises(FormatError, match=r"state.fpk: not a valid ckptio recipe \(not JSON: nested more than 32"):
        Checkpointer(root, format="fpk").load({"w": torch.zeros(1 << 19)})


@pytest.mark.parametrize("content", [b"[" * 100_000, b"\xff" * 10, b'{"block_size": ' + b"9" * 5000 + b"}"])
def test_a_damaged_cache_entrys_metadata_is_a_miss(content, tmp_path):
    """A cache entry's metadata nested 100,000 deep raised RecursionError from every later cached load of
    that object; a damaged entry is a miss: fetched again."""
    import glob

    uri, cache = str(tmp_path / "remote" / "x.pt"), str(tmp_path / "cache")
    ckptio.dump({"w": torch.arange(10)}, uri)
    ckptio.load(uri, cache=cache)
    for _ in range(2):
        [meta] = [p for p in glob.glob(f"{cache}/data/*/*.json")]
        with open(meta, "wb") as f:
            f.write(content)
        assert torch.equal(ckptio.load(uri, cache=cache)["w"], torch.arange(10))
    backend, _ = ckptio.resolve(uri, cache=cache)
    assert backend.stats()["misses"] == 3  # the first load's, then each damaged entry's


# ---- the shared reader ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "data, why",
    [
        (b"[" * 33 + b"]" * 33, "nested more than 32 deep"),
        (b"[" + b"[]," * 200_000 + b"[]]", "more than 300000 values"),
        (b"[" + b"0," * 400_000 + b"0]", "more than 300000 values"),
        (b"9" * 5000, "an integer of 5000 digits"),
        (b'{"a": "\xff"}', "not UTF-8 text"),
        (b'{"a": ', "Expecting value"),
    ],
)
def test_the_marker_reader_refuses_with_the_file_named(data, why):
    from ckptio import markers

    with pytest.raises(FormatError, match=f"^x/m.json: not valid JSON \\({why}"):
        markers.loads(data, "x/m.json")


def test_the_marker_reader_takes_what_ckptio_writes():
    from ckptio import markers

    value = {"step": 5, "files": ["a[b{c"] * 40, "metrics": {"loss": 1.5, '"[': 2}, "sizes": {"x": 1 << 62}}
    data = markers.dumps(value, "m.json", indent=1, sort_keys=True)
    assert markers.loads(data, "m.json") == value
    assert markers.loads(json.dumps([[[1]]] * 1000).encode(), "m.json")  # 3,000 arrays, 3 deep


def test_a_recipe_over_its_cap_is_refused_before_it_is_read(tmp_path, monkeypatch):
    from ckptio.incremental import MAGIC
    from ckptio.incremental import backend as inc_backend

    root = str(tmp_path / "run")
    ck = Checkpointer(root, format="fpk", incremental=True)
    ck.save(1, {"w": torch.ones(1 << 19)})
    with open(os.path.join(ck.uri(1), "state.fpk"), "wb") as f:
        f.write(MAGIC + b" " * (200 << 10))
    monkeypatch.setattr(inc_backend, "MAX_RECIPE_BYTES", 100 << 10)
    with pytest.raises(FormatError, match=r"state.fpk: not a valid ckptio recipe \(204816 bytes, more than 102400\)"):
        Checkpointer(root, format="fpk").load({"w": torch.zeros(1 << 19)})

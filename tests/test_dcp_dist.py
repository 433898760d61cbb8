"""ckptio.dcp across processes: gloo ranks with DTensor Shard(0), resharding between world sizes,
and a backend failure on one rank. Every child group runs under a timeout."""

from __future__ import annotations

import errno
import json
import os
import re

import pytest
import torch

import ckptio.dcp as cd
import dcp_workers as W
from multiproc import results, run_ranks

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def save_2_load_1_and_3(uri: str, tmp_path, backends: dict | None = None, load_3: bool = True) -> None:
    """``backends``: ckptio backend options the children need to reach the test servers."""
    out_dir = str(tmp_path)
    run_ranks(W.save_rank, 2, uri, backends, None, out_dir)
    assert results(out_dir, 2) == ["ok", "ok"]
    assert cd.is_complete(uri)

    full = {k: torch.zeros_like(v) for k, v in W.full_state(1).items()}  # world size 1, plain tensors
    full["extra"] = {"step": 0, "rank_count": 0}
    cd.load(full, uri)
    for k, v in W.full_state(1).items():
        assert torch.equal(full[k], v), k
    assert full["extra"] == {"step": 7, "rank_count": 2}

    if not load_3:
        return
    run_ranks(W.load_rank, 3, uri, backends, out_dir)  # world size 3: uneven Shard(0)
    assert results(out_dir, 3) == ["ok", "ok", "ok"]


def test_dtensor_save_2_load_1_and_3_local(tmp_path):
    save_2_load_1_and_3(str(tmp_path / "ckpt"), tmp_path)


def test_failure_on_one_rank_names_rank_and_object(tmp_path):
    uri = str(tmp_path / "ckpt")
    run_ranks(W.save_rank, 2, uri, None, 1, str(tmp_path))
    outcomes = results(str(tmp_path), 2)
    for text in outcomes:  # every rank sees the failure
        direct, ours = text.split("\n=====\n")
        assert direct.startswith("CheckpointException"), direct  # torch's dcp.save: torch's exception
        assert "RANK 1" in direct and "injected I/O error" in direct and "__1_1." in direct
        assert ours.startswith("OSError"), ours  # ckptio.dcp.save: rank 1's own error, named
        assert "failed on rank 1" in ours and "injected I/O error" in ours and "__1_1." in ours
    assert not cd.is_complete(uri)
    assert not os.path.exists(os.path.join(uri, ".metadata"))


def test_one_ranks_ckptio_error_reaches_every_rank_intact(tmp_path):
    """torch gathers rank errors by pickling them: each rank must see rank 0's AlreadyExistsError (a second save
    without overwrite, as torch's test_fsspec test_overwrite) and rank 1's NotFoundError (its data deleted),
    with class, errno and URI; not a TypeError from unpickling."""
    uri = str(tmp_path / "ckpt")
    run_ranks(W.refused_rank, 2, uri, str(tmp_path))
    meta = os.path.join(uri, ".metadata")
    lost = re.compile(re.escape(os.path.join(uri, "__1_")) + r"\d+\.[0-9a-f]{16}\.distcp")  # rank 1's objects
    for text in results(str(tmp_path), 2):
        seen = json.loads(text)
        assert "crash" not in seen, seen.get("crash")
        exists = {"type": "AlreadyExistsError", "errno": errno.EEXIST, "uri": meta}
        missing = {"type": "NotFoundError", "errno": errno.ENOENT}
        assert lost.fullmatch(seen["ckptio_load"]["uri"]), seen["ckptio_load"]
        assert lost.fullmatch(seen["torch_load"]["failures"]["1"]["uri"]), seen["torch_load"]
        assert seen["torch_save"]["type"] == "CheckpointException"
        assert list(seen["torch_save"]["failures"]) == ["0"]
        assert exists.items() <= seen["torch_save"]["failures"]["0"].items()
        assert "overwrite=True" in seen["torch_save"]["failures"]["0"]["str"]
        assert exists.items() <= seen["ckptio_save"].items()
        assert "failed on rank 0" in seen["ckptio_save"]["notes"][0]
        assert seen["torch_load"]["type"] == "CheckpointException"
        assert list(seen["torch_load"]["failures"]) == ["1"]
        assert missing.items() <= seen["torch_load"]["failures"]["1"].items()
        assert missing.items() <= seen["ckptio_load"].items()
        assert "failed on rank 1" in seen["ckptio_load"]["notes"][0]
    assert cd.is_complete(uri)  # the refused save left the first checkpoint committed

"""Incremental checkpoints under torch.distributed: 2 gloo ranks save ``fpk`` (rank 0 writes) and ``dcp``
(each rank dedups its own Shard(0) shards); saves after the first write a small part of the logical
bytes, and the steps load exactly on 2 ranks and, resharded, in one process. Children run under a timeout."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch

from multiproc import record, results, run_ranks

pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
    pytest.mark.filterwarnings("ignore::ckptio.checkpointer.CheckpointWarning"),
]
FROZEN = 6  # 2 MiB tensors that never change: 1 MiB shards on 2 ranks


def full_state(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {f"backbone.{i}": torch.randn(1024, 512, generator=g) for i in range(FROZEN)}
    out["head"] = torch.full((64, 32), float(step))
    return out


def _worker(rank: int, world: int, port: int, roots: dict[str, str], out_dir: str) -> None:
    record(out_dir, rank, _save_and_load, rank, world, port, roots)


def _save_and_load(rank: int, world: int, port: int, roots: dict[str, str]) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from ckptio.checkpointer import Checkpointer

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    mesh = init_device_mesh("cpu", (world,))
    for fmt, root in roots.items():
        ck = Checkpointer(root, format=fmt, incremental=True, keep_last=3, content_grace=0, timeout=60)
        for step in range(1, 5):
            model = full_state(step)
            if fmt == "dcp":
                model = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in model.items()}
            ck.save(step, {"model": model, "trainer": {"step": step}})
            res = ck.last_save
            if rank == 0 and step == 1:
                assert res.bytes_written > 0.9 * res.logical_bytes > 0.9 * (FROZEN << 21), res
            elif rank == 0:  # the head, the metadata and the recipes
                assert res.bytes_written < res.logical_bytes * 0.1, (fmt, res)
        assert ck.list() == [2, 3, 4], ck.list()
        for step in ck.list():  # load on the same world size
            want = full_state(step)
            model = {k: torch.zeros_like(v) for k, v in want.items()}
            if fmt == "dcp":
                model = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in model.items()}
            trainer = {"step": 0}
            assert ck.load({"model": model, "trainer": trainer}, step=step) == step
            assert trainer == {"step": step}
            for k, v in model.items():
                got = v.full_tensor() if fmt == "dcp" else v
                assert torch.equal(got, want[k]), (fmt, step, k)
    dist.barrier()
    dist.destroy_process_group()


def test_two_ranks_fpk_and_dcp_dedup_and_reshard_on_load(tmp_path):
    from ckptio.checkpointer import Checkpointer, usage

    roots = {fmt: str(tmp_path / fmt) for fmt in ("fpk", "dcp")}
    run_ranks(_worker, 2, roots, str(tmp_path))
    assert results(str(tmp_path), 2) == ["ok", "ok"]
    for fmt, root in roots.items():
        ck = Checkpointer(root, format=fmt)
        assert ck.list() == [2, 3, 4]
        assert ck.manifest(4)["world_size"] == 2
        for step in ck.list():  # one process: the dcp shards of 2 ranks resharded into whole tensors
            want = full_state(step)
            model = {k: torch.zeros_like(v) for k, v in want.items()}
            assert ck.load({"model": model}, step=step, strict=False) == step
            for k, v in want.items():
                assert torch.equal(model[k], v), (fmt, step, k)
        report = usage(root)
        assert report["unreferenced_content_bytes"] == 0
        assert report["physical_bytes"] < 1.5 * report["steps"][0]["logical_bytes"], report

"""Checkpointer under torch.distributed: 2 gloo ranks save (sync and async) and resume in DCP format;
rank 0 alone writes the pointer and runs retention. Every child group runs under a timeout."""

from __future__ import annotations

import os
import traceback
from datetime import timedelta

import pytest
import torch

from multiproc import results, run_ranks

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))


def _worker(rank: int, world: int, port: int, roots: list[str], out_dir: str, backends: dict | None) -> None:
    import torch.distributed as dist

    import ckptio

    result = "ok"
    try:
        if backends:
            ckptio.configure(backends=backends)
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
        )
        for root in roots:
            _save_and_resume(rank, root)
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        result = traceback.format_exc()
    with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as f:
        f.write(result)


def _save_and_resume(rank: int, root: str) -> None:
    from ckptio.checkpointer import Checkpointer

    model = _model(0)  # replicated, as under DDP
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    ck = Checkpointer(root, format="dcp", keep_last=2, timeout=60)
    for step in range(1, 4):
        model(torch.ones(2, 8)).sum().backward()
        optim.step()
        ck.save(step, {"model": model, "optim": optim, "trainer": {"step": step}}, metrics={"loss": step})
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    exp_avg = optim.state_dict()["state"][0]["exp_avg"].clone()
    assert ck.list() == [2, 3], ck.list()

    async_ck = Checkpointer(root, format="dcp", keep_last=2, async_save=True, timeout=60)
    async_ck.save(4, {"model": model, "optim": optim, "trainer": {"step": 4}})
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # after save returned: not part of step 4
    async_ck.wait()
    assert async_ck.list() == [3, 4], async_ck.list()

    fresh = _model(rank + 10)  # different on each rank
    fresh_optim = torch.optim.Adam(fresh.parameters(), lr=0.5)
    trainer = {"step": 0}
    resumed = Checkpointer(root, format="dcp", timeout=60)
    assert resumed.load({"model": fresh, "optim": fresh_optim, "trainer": trainer}) == 4
    assert trainer == {"step": 4}, trainer
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, expected[k]), k
    assert torch.equal(fresh_optim.state_dict()["state"][0]["exp_avg"], exp_avg)
    assert fresh_optim.param_groups[0]["lr"] == 0.01


def test_two_ranks_dcp_save_resume_local_and_s3(tmp_path, s3_uri, s3_endpoint):
    from ckptio.checkpointer import Checkpointer
    from conftest import S3_TEST_OPTIONS

    root = str(tmp_path / "run")
    backends = {"s3": {"endpoint_url": s3_endpoint, **S3_TEST_OPTIONS}}
    run_ranks(_worker, 2, [root, s3_uri + "/run"], str(tmp_path), backends)
    assert results(str(tmp_path), 2) == ["ok", "ok"]
    assert sorted(os.listdir(root)) == ["000000000003", "000000000004", "latest.txt"]
    assert Checkpointer(root).manifest(4)["world_size"] == 2
    assert Checkpointer(s3_uri + "/run").list() == [3, 4]

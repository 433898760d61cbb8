"""Ranks agree on a load's outcome: a read failing on one rank fails the load on every rank (a rank that
restored and went on would wait at the training's next collective for a peer that raised)."""

from __future__ import annotations

import pytest
import torch

from ckptio.checkpointer import Checkpointer

pytestmark = [pytest.mark.filterwarnings("ignore:.*single process:UserWarning")]


def _init(rank: int, world: int, port: int) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )


def _load_failing_on_rank1(rank: int, world: int, port: int, root: str) -> None:
    import torch.distributed as dist

    from ckptio.checkpointer import formats
    from ckptio.errors import CkptioError

    _init(rank, world, port)
    ck = Checkpointer(root, format="pt", timeout=60)
    ck.save(1, {"model": {"w": torch.ones(4)}})
    if rank == 1:

        def unreadable(*a, **k):
            raise OSError(5, "Input/output error")

        formats.read_file = unreadable  # this rank only: a flaky mount on its node
    st = {"model": {"w": torch.zeros(4)}}
    try:
        ck.load(st)
    except OSError as e:
        assert rank == 1, e
    except CkptioError as e:
        assert rank == 0 and "rank 1 failed: OSError" in str(e), e
    else:
        raise AssertionError(f"rank {rank}: the load returned though rank 1's failed")
    dist.barrier()
    dist.destroy_process_group()


def _ranks(rank: int, world: int, port: int, root: str, out: str) -> None:
    from multiproc import record

    record(out, rank, _load_failing_on_rank1, rank, world, port, root)


def test_a_read_failing_on_one_rank_fails_the_load_on_every_rank(tmp_path):
    from multiproc import results, run_ranks

    out = tmp_path / "out"
    out.mkdir()
    run_ranks(_ranks, 2, str(tmp_path / "root"), str(out))
    assert results(str(out), 2) == ["ok", "ok"]


def _kept_on_rank0_only(rank: int, world: int, port: int, root: str) -> None:
    import torch.distributed as dist

    from ckptio.errors import CkptioError

    _init(rank, world, port)
    ck = Checkpointer(root, format="pt", timeout=5)
    ck.save(1, {"model": {"w": torch.ones(4)}})
    if rank == 0:
        ck.kept()  # a misuse: on rank 0 only
        with pytest.raises(Exception):  # noqa: B017 - its peer never calls a matching list(): a timeout
            ck.list()
    else:
        with pytest.raises(CkptioError, match="kept.*list|list.*kept"):  # not {} (kept's answer) taken for list()
            ck.list()
    dist.destroy_process_group()


def _ranks_kept(rank: int, world: int, port: int, root: str, out: str) -> None:
    from multiproc import record

    record(out, rank, _kept_on_rank0_only, rank, world, port, root)


def test_a_method_called_on_rank0_only_is_not_answered_to_another_method(tmp_path):
    """Every rank calls a Checkpointer's methods; one called on rank 0 alone must not hand its answer to the
    next method the other ranks call (their collectives would stay shifted by one: list() returned kept's {})."""
    from multiproc import results, run_ranks

    out = tmp_path / "out"
    out.mkdir()
    run_ranks(_ranks_kept, 2, str(tmp_path / "root"), str(out))
    assert results(str(out), 2) == ["ok", "ok"]


def _latest_during_async_saves(rank: int, world: int, port: int, root: str) -> None:
    import torch.distributed as dist

    _init(rank, world, port)
    ck = Checkpointer(root, format="pt", async_save=True, timeout=20)
    for s in range(1, 6):
        ck.save(s, {"model": {"w": torch.full((256, 256), float(s))}})
        got = ck.latest()  # while the background persist runs its own collectives on the same group
        assert got is None or isinstance(got, int), got
    ck.close()
    assert ck.latest() == 5
    dist.destroy_process_group()


def _ranks_async(rank: int, world: int, port: int, root: str, out: str) -> None:
    from multiproc import record

    record(out, rank, _latest_during_async_saves, rank, world, port, root)


def test_latest_during_an_async_save_on_two_ranks(tmp_path):
    """A query (latest, list, kept, status) while an async save persists: both run collectives on the
    Checkpointer's group, from two threads, in an order each rank picks on its own."""
    from multiproc import results, run_ranks

    out = tmp_path / "out"
    out.mkdir()
    run_ranks(_ranks_async, 2, str(tmp_path / "root"), str(out), timeout=90)
    assert results(str(out), 2) == ["ok", "ok"]

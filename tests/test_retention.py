"""Retention (``checkpointer/retention.py``): what a Checkpointer deletes and what it never deletes.

Foreign step directories (DINOv3's unpadded ``99/``, ``199/``) are left alone, locally, on S3 (moto) and
at the remote root of a tiered Checkpointer."""

from __future__ import annotations

import logging

import pytest
import torch

from ckptio.checkpointer import Checkpointer
from test_seeds import dino_save, trained

pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
    pytest.mark.filterwarnings("ignore:.*single process:UserWarning"),
    pytest.mark.filterwarnings("ignore:.*torch.distributed.*not initialized:UserWarning"),
]
BACKENDS = ["local", "s3"]


def state(step: int) -> dict:
    return {"model": {"w": torch.full((4, 4), float(step))}, "trainer": {"step": step}}


# ---- what ckptio did not write -------------------------------------------------------------------------


@pytest.mark.parametrize("tiered", [False, True], ids=["plain", "tiered"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_foreign_step_dirs_survive_retention_and_a_save_of_the_same_step(backend, tiered, request, tmp_path, caplog):
    """A ckptio run in DINOv3's ``ckpt/`` (same step numbers, keep_last=1): DINOv3's unmarked step directories
    are neither deleted as debris nor reused for ckptio's own step 199; ckptio logs once that it ignores them."""
    from ckptio.checkpointer.seeds import find

    root = request.getfixturevalue(f"{backend}_uri") + "/ckpt"
    m, o, _, _ = trained(0)
    for it in (99, 199):
        dino_save(root, it, m, o)
    tier = {"local_tier": str(tmp_path / "tier")} if tiered else {}
    with caplog.at_level(logging.INFO, logger="ckptio.checkpointer"):
        with Checkpointer(root, format="fpk", keep_last=1, **tier) as ck:
            for s in (199, 299, 399):
                ck.save(s, state(s))
                ck.wait()
            assert ck.list() == ([299, 399] if tiered else [399])  # tiered: the local tier keeps 2
    assert Checkpointer(root).list() == [399]
    s = find(root)
    assert s is not None and s.kind == "dinov3" and s.steps() == [99, 199]
    ignored = [r for r in caplog.records if "did not write" in r.getMessage()]
    assert len(ignored) == 1 and "99, 199" in ignored[0].getMessage()

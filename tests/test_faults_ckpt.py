"""DCP save/load and Checkpointer save/resume on S3 and GCS with faults injected by a proxy.

Transient faults (503, 500, resets, stalls, truncated bodies, an expired token) end in a correct
round trip; a permanent fault makes the save fail with a clear error once its attempts run out, and the
last committed checkpoint stays the latest and loads exactly, with nothing of the failed step
visible as committed.
"""

from __future__ import annotations

import traceback

import pytest
import torch

import ckptio
from ckptio import dcp
from ckptio.checkpointer import Checkpointer
from ckptio.errors import TransferError
from faultproxy import FAST, Fault

pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
    pytest.mark.filterwarnings("ignore::ckptio.checkpointer.CheckpointWarning"),
]


def make_state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {
        "model": {"w": torch.randn(256, 256, generator=g), "b": torch.randn(256, generator=g)},
        "trainer": {"step": step},
    }


def blank() -> dict:
    return {"model": {"w": torch.zeros(256, 256), "b": torch.zeros(256)}, "trainer": {"step": -1}}


def same(a: dict, b: dict) -> bool:
    return (
        torch.equal(a["model"]["w"], b["model"]["w"])
        and torch.equal(a["model"]["b"], b["model"]["b"])
        and a["trainer"] == b["trainer"]
    )


def transient_mix(p) -> None:
    """One of each transient fault, early enough to hit a small checkpoint's requests."""
    p.add(Fault("status", status=503, nth=1))
    p.add(Fault("reset", method="PUT", nth=1))
    p.add(Fault("status", status=500, method="GET", nth=1))
    p.add(Fault("truncate", method="GET", path="alt=media" if p.flavor == "gcs" else "", nth=2))
    p.add(Fault("stall", method="GET", nth=3))
    p.add(Fault("reset", method="GET", nth=4))
    p.add(Fault("status", status=503, fraction=0.05))


def writes_fail(p) -> None:
    p.add(Fault("status", status=503, method="PUT", fraction=1.0))
    p.add(Fault("status", status=503, method="POST", fraction=1.0))


def test_dcp_save_load_under_transient_faults(faults):
    uri = faults.uri + "/dcp/step1"
    state = make_state(1)
    transient_mix(faults)
    dcp.save(state, uri)
    out = blank()
    dcp.load(out, uri)
    assert same(out, state)
    assert faults.fired() >= 4


def test_dcp_permanent_fault_leaves_no_commit(faults):
    good, bad = faults.uri + "/dcp/good", faults.uri + "/dcp/bad"
    dcp.save(make_state(1), good)
    writes_fail(faults)
    with pytest.raises(BaseException) as ei:  # torch's CheckpointException is a BaseException
        dcp.save(make_state(2), bad)
    text = "".join(traceback.format_exception(ei.value))
    # torch wraps it; the cause names object and attempts; it ran out of attempts, well within the deadline
    assert f"gave up after {FAST['max_attempts']} attempt(s)" in text and bad in text
    faults.clear()
    assert not dcp.is_complete(bad) and dcp.is_complete(good)
    out = blank()
    dcp.load(out, good)
    assert same(out, make_state(1))


@pytest.mark.parametrize("store,fmt", [("s3", "dcp"), ("gcs", "dcp"), ("s3", "fpk"), ("gcs", "pt")])
def test_checkpointer_save_resume_under_transient_faults(request, store, fmt):
    faults = request.getfixturevalue(f"{store}_faults")
    root = faults.uri + "/run"
    ck = Checkpointer(root, format=fmt, keep_last=2)
    ck.save(1, make_state(1))
    transient_mix(faults)
    ck.save(2, make_state(2))
    ck.save(3, make_state(3))
    out = blank()
    assert Checkpointer(root, format=fmt).load(out) == 3
    assert same(out, make_state(3)) and faults.fired() >= 3


@pytest.mark.parametrize("store,fmt", [("s3", "dcp"), ("gcs", "dcp"), ("s3", "fpk"), ("gcs", "pt")])
def test_checkpointer_permanent_fault_keeps_last_commit(request, store, fmt):
    faults = request.getfixturevalue(f"{store}_faults")
    root = faults.uri + "/run"
    ck = Checkpointer(root, format=fmt)
    ck.save(1, make_state(1))
    writes_fail(faults)
    with pytest.raises(BaseException) as ei:  # dcp: torch's CheckpointException (a BaseException) wraps it
        ck.save(2, make_state(2))
    text = "".join(traceback.format_exception(ei.value))
    assert isinstance(ei.value, TransferError) or "TransferError" in text
    assert root in text and f"gave up after {FAST['max_attempts']} attempt(s)" in text  # not the deadline
    faults.clear()
    fresh = Checkpointer(root, format=fmt)
    assert fresh.latest() == 1 and fresh.list() == [1]
    out = blank()
    assert fresh.load(out) == 1 and same(out, make_state(1))
    fresh.save(2, make_state(2))  # and the run continues
    out = blank()
    assert Checkpointer(root, format=fmt).load(out) == 2 and same(out, make_state(2))


def test_checkpointer_resume_with_expired_token_and_provider(s3_faults):
    calls = []

    def provider():
        calls.append(1)
        return {"access_key_id": "testing", "secret_access_key": "testing", "session_token": f"t{len(calls)}"}

    ckptio.configure(backends={"s3": {"credential_provider": provider}})
    root = s3_faults.uri + "/run"
    ck = Checkpointer(root, format="dcp")
    ck.save(1, make_state(1))
    s3_faults.add(Fault("expired", method="PUT", nth=1))
    s3_faults.add(Fault("expired", method="GET", nth=2))
    ck.save(2, make_state(2))
    out = blank()
    assert Checkpointer(root, format="dcp").load(out) == 2 and same(out, make_state(2))
    assert s3_faults.fired("expired") == 2 and len(calls) >= 3  # one per backend instance + 2 refreshes


def test_checkpointer_without_permission_to_list_uploads_warns_and_saves(s3_faults):
    """Listing multipart uploads is a permission of its own (s3:ListBucketMultipartUploads): without it
    the start-up cleanup is skipped with a warning that says what to grant, and saves work."""
    from ckptio.checkpointer import CheckpointWarning

    root = s3_faults.uri + "/run"
    s3_faults.add(Fault("status", status=403, method="GET", path="uploads", fraction=1.0))
    ck = Checkpointer(root, format="fpk", stale_after=0)
    with pytest.warns(CheckpointWarning, match="s3:ListBucketMultipartUploads"):
        ck.save(1, make_state(1))
    assert s3_faults.fired() == 1 and ck.list() == [1]

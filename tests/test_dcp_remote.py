"""ckptio.dcp on every backend (the conftest ``any_uri`` fixture), interop with torch's
FsspecWriter/FsspecReader on S3, and multi-rank DTensor saves on S3 and GCS."""

from __future__ import annotations

import io

import pytest
import torch
import torch.distributed.checkpoint as dcp

import ckptio.dcp as cd
import dcp_workers as W
from ckptio.errors import AlreadyExistsError, IncompleteCheckpointError
from test_dcp import assert_same, blank, sample
from test_dcp_dist import save_2_load_1_and_3

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def test_round_trip_every_backend(any_uri):
    uri = f"{any_uri}/run/step-1"
    assert not cd.is_complete(uri)
    sd = sample()
    cd.save(sd, uri, thread_count=2)
    assert cd.is_complete(uri)
    out = blank(sd)
    cd.load(out, uri)
    assert_same(out, sample())
    with pytest.raises(AlreadyExistsError, match="overwrite=True"):
        cd.save(sd, uri)
    cd.save({"x": torch.ones(4)}, uri, overwrite=True)
    out = {"x": torch.zeros(4)}
    cd.load(out, uri)
    assert torch.equal(out["x"], torch.ones(4))


def _fsspec_options(endpoint: str) -> dict:
    return {
        "key": "testing",
        "secret": "testing",
        "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
    }


def test_ckptio_loads_fsspec_writer_checkpoint_on_s3(s3_uri, s3_endpoint):
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    uri = f"{s3_uri}/torch-written"
    sd = sample()
    dcp.save(sd, storage_writer=FsspecWriter(uri, thread_count=2, **_fsspec_options(s3_endpoint)))
    assert cd.is_complete(uri)
    out = blank(sd)
    cd.load(out, uri)
    assert_same(out, sample())


def test_fsspec_reader_loads_ckptio_checkpoint_on_s3(s3_uri, s3_endpoint):
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    uri = f"{s3_uri}/ckptio-written"
    sd = sample()
    cd.save(sd, uri, thread_count=2)
    out = blank(sd)
    dcp.load(out, storage_reader=FsspecReader(uri, **_fsspec_options(s3_endpoint)))
    assert_same(out, sample())


def test_large_tensor_multipart_on_s3(s3_uri):
    uri = f"{s3_uri}/big"
    sd = {"w": torch.randn(3 << 20), "b": io.BytesIO(b"z" * 10)}  # 12 MiB: several 5 MiB parts
    cd.save(sd, uri, part_size=5 << 20)
    out = {"w": torch.zeros(3 << 20), "b": io.BytesIO()}
    cd.load(out, uri, part_size=5 << 20)
    assert torch.equal(out["w"], sd["w"]) and out["b"].getvalue() == b"z" * 10


def test_dtensor_save_2_load_1_and_3_s3(s3_uri, s3_endpoint, tmp_path):
    options = {
        "endpoint_url": s3_endpoint,
        "access_key_id": "testing",
        "secret_access_key": "testing",
        "part_size": 5 << 20,
    }
    save_2_load_1_and_3(f"{s3_uri}/dist", tmp_path, {"s3": options}, load_3=False)  # 3 ranks: local test


def test_dtensor_save_2_load_1_and_3_gcs(gcs_uri, gcs_endpoint, tmp_path):
    save_2_load_1_and_3(
        f"{gcs_uri}/dist",
        tmp_path,
        {"gcs": {"endpoint_url": gcs_endpoint, "anon": True, "project": "test"}},
        load_3=False,
    )


def test_big_state_on_s3_after_interrupted_save(s3_uri):
    """An object store has no rename: a directory of data objects without .metadata is incomplete."""
    uri = f"{s3_uri}/partial"
    cd.save(W.big_state(1), uri)
    backend, root = cd.resolve(uri)
    backend.delete(f"{root}/.metadata")
    assert not cd.is_complete(uri)
    with pytest.raises(IncompleteCheckpointError, match="incomplete"):
        cd.load({k: torch.zeros_like(v) for k, v in W.big_state(1).items()}, uri)


def test_upload_buffers_are_bounded(s3_uri, tmp_path):
    # S3/GCS writers bound their own copies by max_buffer_bytes: the budget is split over the
    # objects written at once (64 MiB default budget, 2 objects -> 32 MiB each)
    w = cd.StorageWriter(f"{s3_uri}/x", part_size=5 << 20)
    assert w._bound_memory(256 << 20, 2) == 2 and w._write_backend.max_buffer_bytes == 32 << 20
    w = cd.StorageWriter(f"{s3_uri}/x", part_size=5 << 20, max_buffer_bytes=20 << 20)
    assert w._bound_memory(256 << 20, 4) == 4 and w._write_backend.max_buffer_bytes == 5 << 20
    w = cd.StorageWriter(str(tmp_path / "x"))  # local files are written from tensor memory: no cap
    assert w._bound_memory(256 << 20, 4) == 4

"""A DCP load takes a small remote data object's size from the GET of its bytes (ckptio.dcp.heads),
and still refuses a truncated, damaged, missing or crafted one before any item is loaded.

Requests are counted by a proxy in front of the real servers (moto, the GCS emulator).
"""

from __future__ import annotations

import pytest
import torch

import ckptio
from ckptio import dcp as cd
from ckptio.dcp import heads
from ckptio.dcp.layout import METADATA_NAME
from ckptio.errors import IntegrityError
from test_small_requests import _state


def _data_object(uri: str) -> str:
    backend, root = ckptio.resolve(uri)
    (obj,) = [i.uri for i in backend.list(root) if not i.uri.endswith(METADATA_NAME)]
    return obj


def _blank(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.full_like(v, 7.0) for k, v in state.items()}


def _untouched(out: dict[str, torch.Tensor]) -> bool:
    return all(bool((t == 7.0).all()) for t in out.values())


def _methods(proxy) -> list[str]:
    return [r.method for r in proxy.requests]


def test_small_load_is_two_gets_and_loads_exactly(proxy):
    state, uri = _state(), proxy.uri + "/ckpt"
    cd.save(state, uri)
    proxy.clear()
    out = _blank(state)
    cd.load(out, uri)
    assert _methods(proxy) == ["GET", "GET"], proxy.requests  # .metadata, then the data object with its size
    assert all(torch.equal(out[k], v) for k, v in state.items())


def test_truncated_object_is_refused_before_any_item_is_loaded(proxy):
    state, uri = _state(), proxy.uri + "/ckpt"
    cd.save(state, uri)
    obj = _data_object(uri)
    data = ckptio.get(obj)
    ckptio.put(data[: len(data) - 100], obj)
    proxy.clear()
    out = _blank(state)
    with pytest.raises(IntegrityError, match="past its end") as e:
        cd.load(out, uri)
    assert obj in str(e.value) and "nothing was loaded" in str(e.value)
    assert _untouched(out)
    assert "HEAD" not in _methods(proxy)  # the size came with the bytes


def test_damaged_bytes_in_a_head_fail_their_checksum(proxy):
    state, uri = _state(), proxy.uri + "/ckpt"
    cd.save(state, uri)
    obj = _data_object(uri)
    data = bytearray(ckptio.get(obj))
    at = data.find(state["layer3.weight"].numpy().tobytes())  # inside a tensor's bytes (not a zip header)
    assert at > 0
    data[at + 1000] ^= 0xFF
    ckptio.put(bytes(data), obj)
    with pytest.raises(IntegrityError, match="checksum mismatch"):
        cd.load(_blank(state), uri)
    out = _blank(state)
    cd.load(out, uri, verify=False)  # what verification guards against: the flipped byte is loaded
    assert not all(torch.equal(out[k], v) for k, v in state.items())


def test_missing_object_raises_not_found(proxy):
    state, uri = _state(), proxy.uri + "/ckpt"
    cd.save(state, uri)
    obj = _data_object(uri)
    ckptio.remove(obj)
    out = _blank(state)
    with pytest.raises(FileNotFoundError, match=obj.rsplit("/", 1)[-1]):
        cd.load(out, uri)
    assert _untouched(out)


def test_items_far_into_an_object_are_read_by_range_after_a_size_lookup(proxy):
    """Only one small tensor of a ~3 MiB object is needed: its range is fetched, not the object's first 3 MiB."""
    g = torch.Generator().manual_seed(1)
    state = {"big": torch.randn(3 << 18, generator=g), "small": torch.randn(16, generator=g)}
    uri = proxy.uri + "/ckpt"
    cd.save(state, uri)
    proxy.clear()
    out = {"small": torch.zeros(16)}
    cd.load(out, uri)
    assert torch.equal(out["small"], state["small"])
    assert proxy.bytes_out < 512 << 10, (proxy.bytes_out, proxy.requests)


def test_an_object_past_head_max_is_read_after_a_size_lookup(proxy, monkeypatch):
    monkeypatch.setattr(heads, "HEAD_MAX", 64 << 10)
    state, uri = _state(), proxy.uri + "/ckpt"  # ~96 KiB
    cd.save(state, uri)
    proxy.clear()
    out = _blank(state)
    cd.load(out, uri)
    assert all(torch.equal(out[k], v) for k, v in state.items())
    assert "HEAD" in _methods(proxy) or len(proxy.requests) > 2, proxy.requests


def test_heads_held_stay_within_their_budget(s3_proxy, monkeypatch):
    """Objects whose heads would pass HEADS_MAX have their sizes looked up; the heads are dropped on release."""
    monkeypatch.setattr(heads, "HEADS_MAX", 3 << 20)
    backend, root = ckptio.resolve(s3_proxy.uri + "/objs")
    names = [f"{root}/o{i}" for i in range(4)]
    for n in names:
        ckptio.put(bytes(1 << 20), n)
    objects = heads.DataObjects(backend)
    s3_proxy.clear()
    for n in names:
        assert objects.size(n, [(0, 1 << 20, None)], True) == 1 << 20  # type: ignore[list-item]
    assert _methods(s3_proxy) == ["GET", "GET", "GET", "HEAD"], s3_proxy.requests
    target = memoryview(bytearray(16))
    assert objects.copy_out(names[0], 100, [(100, 116, target)])
    assert not objects.copy_out(names[3], 0, [(0, 16, target)])  # looked up, not fetched
    assert not objects.copy_out(names[0], 0, [(0, (1 << 20) + 1, memoryview(bytearray((1 << 20) + 1)))])
    objects.release()
    assert not objects.copy_out(names[0], 100, [(100, 116, target)])


def test_local_loads_look_sizes_up(tmp_path):
    state, uri = _state(), str(tmp_path / "ckpt")
    cd.save(state, uri)
    backend, _ = ckptio.resolve(uri)
    objects = heads.DataObjects(backend)
    obj = _data_object(uri)
    assert objects.size(obj, [(0, 64, None)], True) == len(ckptio.get(obj))  # type: ignore[list-item]
    assert not objects.copy_out(obj, 0, [(0, 64, memoryview(bytearray(64)))])


def test_checkpointer_load_into_a_fresh_optimizer_fetches_its_data_once(s3_proxy):
    """The Checkpointer checks the entries its state lacks (check_tensors) on one reader and loads with
    another: the check looks sizes up, and only the reader that reads fetches heads."""
    from ckptio.checkpointer import Checkpointer

    torch.manual_seed(0)

    def make():
        model = torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.Linear(128, 128))
        return model, torch.optim.Adam(model.parameters())

    model, opt = make()
    model(torch.randn(2, 128)).sum().backward()
    opt.step()
    root = s3_proxy.uri + "/run"
    Checkpointer(root).save(1, {"model": model, "opt": opt})
    backend, path = ckptio.resolve(root)
    size = sum(i.size for i in backend.list(path, recursive=True) if i.uri.endswith(".distcp"))
    m2, o2 = make()
    s3_proxy.clear()
    Checkpointer(root).load({"model": m2, "opt": o2})
    assert torch.equal(o2.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    fetched = sum(r.bytes_out for r in s3_proxy.requests if ".distcp" in r.path)
    # the optimizer's non-tensor items (its groups) are read a second time, first and alone, so that the load
    # is checked against the state before anything is touched; every tensor's bytes are fetched once
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    md = cd.StorageReader(f"{root}/{1:012d}").read_metadata()
    groups = sum(
        v.length
        for k, v in md.storage_data.items()
        if isinstance(md.state_dict_metadata[k.fqn], BytesStorageMetadata) and k.fqn.startswith("opt.")
    )
    assert 0 < groups < size / 10 and fetched <= size + groups, (fetched, size, groups, s3_proxy.requests)

"""Small DCP checkpoints on object stores: a load takes a small data object's size from the GET of
its bytes (ckptio.dcp.heads) and still refuses a truncated, damaged, missing or crafted one before any
item is loaded; a small save checks for a committed checkpoint while its data is written, and still
refuses to replace one.

Requests are counted (and held, to show what overlaps) by a proxy in front of the real servers
(moto, the GCS emulator).
"""

from __future__ import annotations

import pytest
import torch

import ckptio
from ckptio import dcp as cd
from ckptio.dcp import heads
from ckptio.dcp import writer as writer_module
from ckptio.dcp.layout import METADATA_NAME
from ckptio.errors import IntegrityError


@pytest.fixture(params=["s3", "gcs"])
def proxy(request):
    return request.getfixturevalue(f"{request.param}_proxy")


def _state(n: int = 6, side: int = 64) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {f"layer{i}.weight": torch.randn(side, side, generator=g) for i in range(n)}


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
        assert objects.size(n, [(0, 1 << 20, None)]) == 1 << 20  # type: ignore[list-item]
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
    assert objects.size(obj, [(0, 64, None)]) == len(ckptio.get(obj))  # type: ignore[list-item]
    assert not objects.copy_out(obj, 0, [(0, 64, memoryview(bytearray(64)))])


# ---- saves: the check for a committed checkpoint overlaps a small save's data -------------------

_CHECK = {"s3": "HEAD", "gcs": "GET"}  # how each store's check for .metadata is sent
_UPLOAD = {"s3": "PUT", "gcs": "POST"}


@pytest.fixture(params=["s3", "gcs"])
def store(request):
    return request.param, request.getfixturevalue(f"{request.param}_proxy")


def _order(proxy, kind: str) -> tuple[int, int]:
    """Positions, in order of completion, of the check for .metadata and of the first data upload."""
    methods = [(r.method, r.path) for r in proxy.requests]
    check = next(i for i, (m, p) in enumerate(methods) if m == _CHECK[kind] and "metadata" in p)
    data = next(i for i, (m, p) in enumerate(methods) if m == _UPLOAD[kind] and "distcp" in p)
    return check, data


def test_a_small_save_checks_while_its_data_is_written(store):
    """The check is held 1 s by the proxy: the data upload completes first, so it did not wait."""
    kind, proxy = store
    state, uri = _state(), proxy.uri + "/ckpt"
    proxy.delays = {_CHECK[kind]: 1.0}
    proxy.clear()
    cd.save(state, uri)
    check, data = _order(proxy, kind)
    assert data < check, proxy.requests
    out = _blank(state)
    cd.load(out, uri)
    assert all(torch.equal(out[k], v) for k, v in state.items())


@pytest.mark.parametrize("why", ["large", "overwrite"])
def test_large_saves_and_overwrites_check_before_writing(store, monkeypatch, why):
    kind, proxy = store
    state, uri = _state(), proxy.uri + "/ckpt"
    if why == "large":
        monkeypatch.setattr(writer_module, "EARLY_CHECK_MIN", 1024)
    proxy.delays = {_CHECK[kind]: 0.3}
    proxy.clear()
    cd.save(state, uri, overwrite=why == "overwrite")
    check, data = _order(proxy, kind)
    assert check < data, proxy.requests


def test_a_small_save_over_a_committed_checkpoint_is_refused_and_leaves_it_intact(store):
    kind, proxy = store
    old, uri = _state(), proxy.uri + "/ckpt"
    cd.save(old, uri)
    backend, root = ckptio.resolve(uri)
    before = sorted(i.uri for i in backend.list(root))
    proxy.delays = {_CHECK[kind]: 0.5}  # the new save's data is written before the check answers
    new = {k: v + 1 for k, v in old.items()}
    with pytest.raises(ckptio.AlreadyExistsError, match="overwrite=True"):
        cd.save(new, uri)
    proxy.delays = {}
    assert sorted(i.uri for i in backend.list(root)) == before  # its data object deleted, nothing else touched
    assert any(r.method == _UPLOAD[kind] and "distcp" in r.path for r in proxy.requests)
    out = _blank(old)
    cd.load(out, uri)
    assert all(torch.equal(out[k], v) for k, v in old.items())

"""A Checkpointer load of some parts (keys=, exclude=) reads only those parts' bytes, in every format: the bytes
S3 (moto, behind a counting proxy) sent are counted, a large part left out."""

from __future__ import annotations

import pytest
import torch

import ckptio
from ckptio.checkpointer import Checkpointer

pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
    pytest.mark.filterwarnings("ignore:.*single process:UserWarning"),
]
BIG = 2 << 20  # bytes of the part left out


def _state(seed: int) -> dict:
    torch.manual_seed(seed)
    model = torch.nn.Linear(16, 4)
    return {
        "big": {"table": torch.randn(BIG // 4)},  # an embedding table not restored, say
        "model": model,
        "trainer": {"step": seed, "scale": torch.full((8,), float(seed))},
    }


@pytest.mark.parametrize("strict", [True, False])
@pytest.mark.parametrize("fmt", ["pt", "fpk", "dcp"])
def test_a_load_of_some_parts_reads_only_their_bytes(s3_proxy, fmt, strict):
    root = s3_proxy.uri + "/run"
    src = _state(1)
    Checkpointer(root, format=fmt).save(3, src)
    for how in ({"exclude": ["big"]}, {"keys": ["model", "trainer"]}):
        s3_proxy.clear()
        dst = _state(2)
        table = dst["big"]["table"].clone()
        assert Checkpointer(root, format=fmt).load(dst, strict=strict, **how) == 3
        got = s3_proxy.bytes_out
        assert got < BIG // 4, (how, got)  # the big part's 2 MiB were not read
        assert torch.equal(dst["model"].weight, src["model"].weight)
        assert dst["trainer"]["step"] == 1 and torch.equal(dst["trainer"]["scale"], src["trainer"]["scale"])
        assert torch.equal(dst["big"]["table"], table)  # untouched


class Holder:
    """A trusted object holding tensors (loaded with weights_only=False): its tensors are found through it."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = {"inner": [t]}


def test_pt_entries_of_a_file_share_storages_and_load_whole_when_not_a_mapping(s3_uri, tmp_path):
    from ckptio.context import resolve
    from ckptio.formats.torch_entries import load_entries

    base = torch.arange(100.0)
    obj = {"a": base[:10], "b": {"view": base[50:], "n": 3}, "c": torch.ones(1000), "p": torch.nn.Parameter(base)}
    ckptio.dump(obj, f"{s3_uri}/x.pt")
    backend, uri = resolve(f"{s3_uri}/x.pt")
    got = load_entries(backend, uri, ["b", "p", "missing"])
    assert sorted(got) == ["b", "p"] and torch.equal(got["b"]["view"], base[50:]) and got["b"]["n"] == 3
    assert isinstance(got["p"], torch.nn.Parameter) and torch.equal(got["p"], base)
    ckptio.dump({"h": Holder(torch.arange(5.0)), "big": torch.ones(1000)}, f"{s3_uri}/obj.pt")
    backend, uri = resolve(f"{s3_uri}/obj.pt")
    held = load_entries(backend, uri, ["h"], weights_only=False)["h"]
    assert torch.equal(held.t["inner"][0], torch.arange(5.0))  # not a hole of zeros
    ckptio.dump([torch.ones(2)], f"{s3_uri}/list.pt")
    backend, uri = resolve(f"{s3_uri}/list.pt")
    assert torch.equal(load_entries(backend, uri, ["a"])[0], torch.ones(2))  # the caller reports what it holds
    torch.save({"a": torch.ones(3), "b": torch.zeros(3)}, tmp_path / "old.pt", _use_new_zipfile_serialization=False)
    ckptio.put((tmp_path / "old.pt").read_bytes(), f"{s3_uri}/old.pt")
    backend, uri = resolve(f"{s3_uri}/old.pt")
    assert list(load_entries(backend, uri, ["a"])) == ["a"]  # a legacy file: loaded whole, then picked


@pytest.mark.parametrize("fmt", ["pt", "fpk"])
def test_some_parts_of_an_incremental_checkpoint(tmp_path, fmt):
    root = str(tmp_path / "run")
    src = _state(1)
    ck = Checkpointer(root, format=fmt, incremental=True)
    ck.save(3, src)
    dst = _state(2)
    assert Checkpointer(root, format=fmt).load(dst, exclude=["big"], strict=False) == 3
    assert torch.equal(dst["model"].weight, src["model"].weight) and dst["trainer"]["step"] == 1
    assert not torch.equal(dst["big"]["table"], src["big"]["table"])

"""ckptio.dcp.inspect / verify: the library functions behind ``ckptio info`` / ``ckptio verify`` on DCP checkpoints."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed.checkpoint as tdcp

import ckptio
import ckptio.dcp as cd
from ckptio import cli
from ckptio.errors import IncompleteCheckpointError, IntegrityError
from conftest import flip_byte

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def cli_json(capsys, *argv: str) -> dict:
    code = cli.main(["--json", *argv])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)


def state() -> dict:
    return {
        "w": torch.randn(64, 32),
        "b": torch.arange(10),
        "h": torch.zeros(3, dtype=torch.bfloat16),
        "extra": {"k": 3},
    }


@pytest.mark.parametrize("writer", ["ckptio", "torch"])
def test_same_as_cli(tmp_path, capsys, writer):
    uri = str(tmp_path / "step7")
    if writer == "ckptio":
        cd.save(state(), uri)
    else:
        tdcp.save(state(), storage_writer=tdcp.FileSystemWriter(uri))
    info = cd.inspect(uri)
    doc = cli_json(capsys, "info", uri)
    assert doc.pop("uri") == uri and doc.pop("size") == sum(info["data_files"].values())
    assert json.loads(json.dumps(info)) == doc
    assert {t["key"] for t in info["tensors"]} == {"w", "b", "h"} and "extra.k" in info["values"]

    result = cd.verify(uri)
    assert result["checked"] >= 4 and result["unchecked"] == 0
    doc = cli_json(capsys, "verify", uri)
    assert (doc.pop("uri"), doc.pop("format"), doc.pop("ok")) == (uri, "dcp", True)
    assert doc == result


def test_verify_finds_corruption_and_incomplete(tmp_path):
    uri = str(tmp_path / "c")
    sd = state()
    cd.save(sd, uri)
    obj = next(u for u in ckptio.ls(uri) if u.endswith(".distcp") and sd["w"].numpy().tobytes()[:64] in ckptio.get(u))
    flip_byte(obj, ckptio.get(obj).index(sd["w"].numpy().tobytes()[:64]) + 100)
    with pytest.raises(IntegrityError, match="checksum mismatch"):
        cd.verify(uri)
    ckptio.remove(f"{uri}/.metadata")
    for fn in (cd.verify, cd.inspect):
        with pytest.raises(IncompleteCheckpointError, match="incomplete"):
            fn(uri)


def test_verify_checks_the_framing_torchs_reader_reads(tmp_path, capsys):
    """ckptio's reader reads only an item's tensor bytes; torch's FileSystemReader unpickles the zip frame
    around them. Four bytes changed in that frame's pickle: torch's reader fails, so verify must too."""
    uri = str(tmp_path / "c")
    sd = state()
    cd.save(sd, uri)
    w = sd["w"].numpy().tobytes()[:64]
    obj = next(u for u in ckptio.ls(uri) if u.endswith(".distcp") and w in ckptio.get(u))
    path = obj[len("file://") :] if obj.startswith("file://") else obj
    data = bytearray(open(path, "rb").read())
    at = data.rindex(b"archive/data.pkl", 0, data.index(w)) + len(b"archive/data.pkl")  # w's frame
    at = data.index(b"\x80\x02", at)  # the item's pickle (protocol 2)
    data[at + 2 : at + 6] = bytes(b ^ 0x5A for b in data[at + 2 : at + 6])
    open(path, "wb").write(bytes(data))
    with pytest.raises(BaseException):  # noqa: B017 - torch's CheckpointException: it cannot read the item
        tdcp.load({"w": torch.zeros(64, 32)}, storage_reader=tdcp.FileSystemReader(uri))
    with pytest.raises(IntegrityError, match="frame"):
        cd.verify(uri)
    assert cli.main(["verify", uri]) == 1
    capsys.readouterr()

"""A file whose extension names another format than its bytes hold (issue 51, item 8).

The load, ``ckptio info`` and ``ckptio verify`` name the file, the format its first bytes show
(:mod:`ckptio.formats.sniff`) and the fix (rename it, or ``file_format=``), on every storage. A file
named ``.pt`` that is not a torch.save file never reaches ``torch.load``, whatever ``weights_only``
says, and torch's advice to rerun with ``weights_only=False`` is never given for it. A real ``.pt``
keeps torch's own error. The class is fuzzed in ``test_wrong_extension_fuzz.py``.
"""

from __future__ import annotations

import io
import os
import pickle

import numpy as np
import pytest
import torch

import ckptio
from ckptio.errors import FormatError

STATE = {"w": torch.arange(12.0).reshape(3, 4), "step": 3}


class Evil:
    marker = ""

    def __reduce__(self):
        return (open, (self.marker, "w"))  # creating the file proves code ran


def _bytes_of(kind: str, tmp_path) -> bytes:
    """A genuine file of ``kind`` (fpk, safetensors, pt, npy), or junk."""
    if kind == "junk":
        return b"not a checkpoint at all\n" * 10
    path = str(tmp_path / f"sample.{kind}")
    if kind == "npy":
        np.save(path, np.arange(5.0))
    else:
        ckptio.dump({"w": STATE["w"]} if kind == "safetensors" else STATE, path)
    with open(path, "rb") as f:
        return f.read()


# (what the bytes are, the name they get, what the error must name)
CASES = [
    ("fpk", "x.pt", "fastpickle"),
    ("fpk", "x.pth", "fastpickle"),
    ("fpk", "x.ckpt", "fastpickle"),
    ("safetensors", "x.pt", "safetensors"),
    ("npy", "x.pt", "NumPy"),
    ("junk", "x.pt", "none of"),
    ("pt", "x.fpk", "torch.save"),
    ("pt", "x.safetensors", "torch.save"),
    ("fpk", "x.safetensors", "fastpickle"),
    ("safetensors", "x.fpk", "safetensors"),
]
FIX = {"fpk": "'fpk'", "safetensors": "'safetensors'", "pt": "'pt'", "npy": "'npy'", "junk": "damaged"}


def _root(where: str, request, tmp_path) -> str:
    return str(tmp_path / "store") if where == "local" else request.getfixturevalue(f"{where}_uri")


@pytest.mark.parametrize("kind, name, real", CASES)
@pytest.mark.parametrize("where", ["local", "memory", "s3"])
def test_a_file_named_as_another_format_is_refused_naming_the_real_one(
    tmp_path, request, monkeypatch, where, kind, name, real
):
    uri = f"{_root(where, request, tmp_path)}/{name}"
    ckptio.put(_bytes_of(kind, tmp_path), uri)

    def no_torch_load(*a, **k):
        raise AssertionError("torch.load ran on a file that is not a torch.save file")

    if kind != "pt":
        monkeypatch.setattr(torch, "load", no_torch_load)
    loads = [{}, {"weights_only": False}, {"weights_only": True}] if name.endswith((".pt", ".pth", ".ckpt")) else [{}]
    for kw in loads:
        with pytest.raises(FormatError) as e:
            ckptio.load(uri, **kw)
        msg = str(e.value)
        assert uri in msg and real in msg and FIX[kind] in msg, msg
        assert "weights_only" not in msg, msg
    for check in (ckptio.info, ckptio.verify):
        with pytest.raises(FormatError, match=real) as e:
            check(uri)
        assert uri in str(e.value) and "weights_only" not in str(e.value)
    if kind in ("fpk", "safetensors", "pt"):  # the fix the message gives works
        monkeypatch.undo()
        got = ckptio.load(uri, file_format=kind)
        assert torch.equal(got["w"], STATE["w"])


@pytest.mark.parametrize("where", ["local", "memory", "s3"])
def test_a_plain_pickle_named_pt_runs_no_code_even_with_weights_only_false(tmp_path, request, where):
    """torch.load reads anything but a zip as a legacy file and unpickles its first object with the
    full unpickler: a pickle named .pt ran its code before torch found no magic number."""
    evil = Evil()
    evil.marker = str(tmp_path / "PWNED")
    uri = f"{_root(where, request, tmp_path)}/evil.pt"
    ckptio.put(pickle.dumps({"x": evil}), uri)
    with pytest.raises(FormatError, match="plain pickle.*file_format='pkl'"):
        ckptio.load(uri, weights_only=False)
    assert not os.path.exists(evil.marker)


def test_an_fpk_in_a_file_object_read_as_pt_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("torch.load ran"))
    with pytest.raises(FormatError, match="fastpickle"):
        ckptio.load(io.BytesIO(_bytes_of("fpk", tmp_path)), file_format="pt", weights_only=False)


def test_a_real_pt_keeps_torchs_own_weights_only_error(tmp_path):
    """A genuine torch.save file that weights_only refuses gets torch's message (its advice is right there)."""
    evil = Evil()
    evil.marker = str(tmp_path / "PWNED")
    path = str(tmp_path / "real.pt")
    torch.save({"w": torch.ones(2), "x": evil}, path)
    with pytest.raises(pickle.UnpicklingError, match="weights_only") as e:
        ckptio.load(path)
    assert "fastpickle" not in str(e.value) and not os.path.exists(evil.marker)
    legacy = str(tmp_path / "legacy.pt")  # the legacy (non-zip) format is torch's too
    torch.save(STATE, legacy, _use_new_zipfile_serialization=False)
    assert torch.equal(ckptio.load(legacy)["w"], STATE["w"])


def test_the_sniff_reads_no_more_of_a_remote_object_than_the_load_would(tmp_path, s3_proxy):
    """An .fpk named .pt on S3: refused after the bytes the load fetches anyway, no second read of them."""
    ckptio.dump({"w": torch.randn(3 << 20)}, str(tmp_path / "big.fpk"))  # 12 MiB
    with open(tmp_path / "big.fpk", "rb") as f:
        data = f.read()
    uri = f"{s3_proxy.uri}/big.pt"
    ckptio.put(data, uri)
    s3_proxy.clear()
    with pytest.raises(FormatError, match="fastpickle"):
        ckptio.load(uri)
    fetched = sum(r.bytes_out for r in s3_proxy.requests if r.method == "GET")
    assert fetched <= len(data) + 4096, (fetched, len(data))  # (io.load asks 16 bytes: is it a recipe?)


def _flipped(data: bytes, at: int, mask: int) -> bytes:
    return data[:at] + bytes([data[at] ^ mask]) + data[at + 1 :]


@pytest.mark.parametrize(
    "damage",
    [
        lambda g: _flipped(g, 26, 0x10),  # the first record's name length: its local header disagrees
        lambda g: _flipped(g, 28, 0x40),  # its extra field's length: data.pkl read from the wrong bytes
        lambda g: b"\x01\x02\x03" + g,  # bytes before the archive (zipfile reads behind them, torch does not)
    ],
    ids=["name-length", "extra-length", "prefix"],
)
def test_a_damaged_pt_fails_with_a_ckptio_error_naming_it(tmp_path, damage):
    """Found by the fuzzer: zipfile's own errors (BadZipFile) came out raw, and info/verify read a
    torch archive behind junk that the load refuses."""
    path = str(tmp_path / "damaged.pt")
    torch.save(STATE, path)
    with open(path, "rb") as f:
        data = damage(f.read())
    with open(path, "wb") as f:
        f.write(data)
    for check in (ckptio.load, ckptio.info, ckptio.verify):
        with pytest.raises(FormatError, match="damaged.pt"):
            check(path)


@pytest.mark.parametrize("weights_only", [True, False])
def test_a_file_object_read_past_a_prefix_is_sniffed_from_where_torch_reads(tmp_path, weights_only):
    """torch.load reads a file object from its position: a plain pickle there is refused as at the start,
    and runs no code under weights_only=False; a torch.save file there still loads."""
    Evil.marker = str(tmp_path / "PWNED")
    buf = io.BytesIO(b"HDR!" + pickle.dumps(Evil(), protocol=2))
    buf.read(4)
    with pytest.raises(FormatError, match="a plain pickle"):
        ckptio.load(buf, file_format="pt", weights_only=weights_only)
    assert not os.path.exists(Evil.marker)
    real = io.BytesIO()
    torch.save(STATE, real)
    buf = io.BytesIO(b"HDR!" + real.getvalue())
    buf.read(4)
    assert torch.equal(ckptio.load(buf, file_format="pt", weights_only=weights_only)["w"], STATE["w"])

"""Crafted pickles against every unpickler ckptio owns (issue 34, defects 1-6): each is refused with a
FormatError before anything large is allocated, nothing runs for long, and no shared class or function
changes. Each case runs in a child with ``RLIMIT_AS`` and an alarm (``pickle_workers``).
"""

from __future__ import annotations

import io
import pickle
import struct
import zipfile

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint.metadata as md

from pickle_workers import run_jobs

MIB = 1 << 20


def pt_archive(pkl: bytes, compress: bool = False) -> bytes:
    """A torch.save-like zip whose data.pkl is ``pkl`` (deflated when ``compress``)."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for name, data in {"data.pkl": pkl, "byteorder": b"little", "version": b"3\n"}.items():
            z.writestr(f"archive/{name}", data, compress_type=zipfile.ZIP_DEFLATED if compress else zipfile.ZIP_STORED)
    return buf.getvalue()


def _unicode(s: str) -> bytes:
    b = s.encode()
    return b"X" + struct.pack("<I", len(b)) + b


def _build(global_line: bytes, key: str, value: bytes, slot: bool = False) -> bytes:
    """GLOBAL, then BUILD with ``{key: value}`` as its state (as slot state when ``slot``), then POP."""
    state = b"}" + _unicode(key) + value + b"s"
    return b"c" + global_line + (b"N" + state + b"\x86" if slot else state) + b"b0"


def genuine_metadata() -> bytes:
    props = md.TensorProperties(dtype=torch.float32)
    meta = md.Metadata(
        state_dict_metadata={
            "w": md.TensorStorageMetadata(
                properties=props,
                size=torch.Size([2]),
                chunks=[md.ChunkStorageMetadata(offsets=torch.Size([0]), sizes=torch.Size([2]))],
            )  # fmt: skip
        }
    )
    return pickle.dumps(meta)


def _check(results: list[dict], sizes: dict[str, int]) -> None:
    for r in results:
        assert r["outcome"] == "format", r
        assert r["path"] in r["msg"], r  # names the file
        assert not r["changed"], r
        assert r["grew"] <= 16 * sizes[r["path"]] + 64 * MIB, r


def _jobs(tmp_path, cases: dict[str, tuple[str, bytes]]) -> tuple[list[dict], dict[str, int]]:
    jobs, sizes = [], {}
    for name, (kind, data) in cases.items():
        path = tmp_path / name
        path.write_bytes(data)
        jobs.append({"kind": kind, "path": str(path)})
        sizes[str(path)] = len(data)
    return jobs, sizes


# ---- 1. BUILD on an admitted class or function --------------------------------------------------

_DCP = b"torch.distributed.checkpoint.metadata\n"
_LAYOUT = b"torch.serialization\n_get_layout\n"


def test_build_on_admitted_globals_is_refused(tmp_path):
    genuine = genuine_metadata()
    path_str = _build(b"pathlib\nPurePath\n", "_str", _unicode("/pwn"), slot=True)
    cases = {
        # the prefix: afterwards str(Path(anything)) is the attacker's path
        "purepath.metadata": ("metadata", b"\x80\x02" + path_str + genuine),
        "dataclass.metadata": ("metadata", b"\x80\x02" + _build(_DCP + b"Metadata\n", "x", b"N", slot=True) + genuine),
        "function.metadata": ("metadata", b"\x80\x02" + _build(_LAYOUT, "x", b"N") + genuine),
        # an enum member is shared too: BUILD on what the call returned
        "member.metadata": (
            "metadata",
            b"\x80\x02c" + _DCP + b"_MEM_FORMAT_ENCODING\nK\x00\x85R}" + _unicode("_value_") + b"K\x07sb0" + genuine,
        ),
        "function.pkl": ("pkl", b"\x80\x02" + _build(b"builtins\nbytes\n", "x", b"K\x01") + b"N."),
        "function.pt": ("info", pt_archive(b"\x80\x02" + _build(b"_codecs\nencode\n", "x", b"K\x01") + b"N.")),
    }  # fmt: skip
    jobs, sizes = _jobs(tmp_path, cases)
    _check(run_jobs(jobs), sizes)


# ---- 2. memo bombs ------------------------------------------------------------------------------

MEMO_BOMB = b"\x80\x02Nr\x00\x00\x00\x08."  # LONG_BINPUT 2**27: a 2 GiB memo table


def test_memo_bombs_are_refused(tmp_path):
    cases = {
        "bomb.pkl": ("pkl", MEMO_BOMB),
        "bomb.metadata": ("metadata", MEMO_BOMB),
        "bomb.pt": ("info", pt_archive(MEMO_BOMB)),
        "put.pkl": ("pkl", b"\x80\x02Np134217728\n."),  # the text PUT of protocol 0
    }
    jobs, sizes = _jobs(tmp_path, cases)
    _check(run_jobs(jobs), sizes)


# ---- 3. numpy object dtypes ---------------------------------------------------------------------


class _Array:
    """Pickles as numpy's ``_reconstruct`` + BUILD of ``state``, whatever the state says."""

    def __init__(self, state):
        self.state = state

    def __reduce__(self):
        return (np.core.multiarray._reconstruct, (np.ndarray, (0,), b"b"), self.state)


def test_numpy_object_dtypes_sized_from_the_data(tmp_path):
    subarray = np.dtype(("O", (2**25,)))  # 4 elements: 1 GiB of pointers
    padded = np.dtype({"names": ["a"], "formats": ["O"], "offsets": [0], "itemsize": 65536})
    cases = {
        "subarray.pkl": ("pkl", pickle.dumps(_Array((1, (4,), subarray, False, [None] * 4)), protocol=2)),
        "padded.pkl": ("pkl", pickle.dumps(_Array((1, (12000,), padded, False, [(None,)] * 12000)), protocol=2)),
    }
    jobs, sizes = _jobs(tmp_path, cases)
    _check(run_jobs(jobs, headroom=1536 * MIB), sizes)


def test_numpy_object_arrays_still_load(tmp_path):
    from ckptio.formats import safepickle

    objs = np.array([1, "a", None, (2,)], dtype=object)
    rec = np.array([(1, "x"), (2, None)], dtype=[("i", "i4"), ("o", "O")])
    nested = np.zeros(3, dtype=[("v", "f8", (4,)), ("o", "O")])
    for arr in (objs, rec, nested, objs.reshape(2, 2)):
        for proto in (2, 5):
            got = safepickle.load(io.BytesIO(pickle.dumps(arr, protocol=proto)))
            assert got.dtype == arr.dtype and got.shape == arr.shape and repr(got) == repr(arr)


# ---- 4. CPU bombs through admitted types ----------------------------------------------------------


def test_decimal_to_int_cpu_bomb_is_refused(tmp_path):
    bomb = b"\x80\x02cbuiltins\nint\ncdecimal\nDecimal\n" + _unicode("1E+3000000") + b"\x85R\x85R."
    jobs, sizes = _jobs(tmp_path, {"decimal.pkl": ("pkl", bomb)})
    _check(run_jobs(jobs), sizes)


# ---- 5. allocations from a small argument (torch's allow-list) ------------------------------------

BYTEARRAY = b"\x80\x02cbuiltins\nbytearray\nJ\x00\x00\x00\x18\x85R."  # bytearray(402653184)


def test_bytearray_of_a_size_is_refused(tmp_path):
    tensor = b"\x80\x02ctorch\nFloatTensor\nJ\x00\x00\x00\x06\x85R."  # 100M floats, uninitialised
    cases = {
        "bytearray.pt": ("pt", pt_archive(BYTEARRAY)),
        "bytearray-info.pt": ("info", pt_archive(BYTEARRAY)),
        "tensor.pt": ("pt", pt_archive(tensor)),
    }
    jobs, sizes = _jobs(tmp_path, cases)
    _check(run_jobs(jobs), sizes)


def test_dcp_item_check_refuses_bytearray_of_a_size(tmp_path):
    jobs, sizes = _jobs(tmp_path, {"item.bin": ("item", pt_archive(BYTEARRAY))})
    (r,) = run_jobs(jobs)
    assert r["outcome"] == "ok" and "bytearray" in r["msg"], r  # the check names the problem
    assert r["grew"] <= 64 * MIB, r


# ---- 6. zip bombs -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def zip_bomb() -> bytes:
    """A .pt whose data.pkl (a valid pickle of 256 MiB) is deflated about 1000:1."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        info = zipfile.ZipInfo("archive/data.pkl")
        info.compress_type = zipfile.ZIP_DEFLATED
        with z.open(info, "w", force_zip64=True) as f:
            f.write(b"\x80\x02")
            chunk = b"N0" * (MIB // 2)
            for _ in range(256):
                f.write(chunk)
            f.write(b"N.")
        z.writestr("archive/byteorder", b"little")
        z.writestr("archive/version", b"3\n")
    data = buf.getvalue()
    assert len(data) < 2 * MIB
    return data


def test_zip_bombs_are_refused(tmp_path, zip_bomb):
    cases = {"bomb-info.pt": ("info", zip_bomb), "bomb-load.pt": ("pt", zip_bomb)}
    jobs, sizes = _jobs(tmp_path, cases)
    _check(run_jobs(jobs, headroom=384 * MIB), sizes)


def test_compressed_records_of_modest_ratio_still_load(tmp_path):
    import ckptio

    state = {"w": torch.arange(1000.0), "step": 3}
    buf = io.BytesIO()
    torch.save(state, buf)
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as src, zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info), compress_type=zipfile.ZIP_DEFLATED)
    path = tmp_path / "deflated.pt"
    path.write_bytes(out.getvalue())
    got = ckptio.load(str(path))
    assert torch.equal(got["w"], state["w"]) and got["step"] == 3
    assert ckptio.info(str(path))["tensors"][0]["shape"] == [1000]


def test_metadata_missing_a_dataclass_field_is_a_format_error():
    """A crafted ``.metadata`` can build DCP's dataclasses without their state (found by the long fuzzer):
    loads_metadata refuses it with a FormatError naming the file, not an AttributeError on a later access."""
    import pickle

    from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

    import ckptio.dcp as cd
    from ckptio.errors import FormatError

    good = pickle.loads(genuine_metadata())
    key, entry = next((k, v) for k, v in good.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata))
    torn = object.__new__(TensorStorageMetadata)
    torn.__dict__.update({k: v for k, v in vars(entry).items() if k != "size"})
    crafted = Metadata(state_dict_metadata={**good.state_dict_metadata, key: torn})
    with pytest.raises(FormatError, match=r"x/\.metadata.*TensorStorageMetadata without its 'size'"):
        cd.loads_metadata(pickle.dumps(crafted), "x/.metadata")
    assert isinstance(cd.loads_metadata(genuine_metadata(), "x/.metadata"), Metadata)

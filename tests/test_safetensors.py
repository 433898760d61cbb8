"""safetensors: byte compatibility with the package both ways, round trips on every storage, partial
and sharded loads, and crafted files that must end in FormatError (in a subprocess)."""

from __future__ import annotations

import json
import os
import re
import struct
import subprocess
import sys

import pytest
import torch

import ckptio
from ckptio import cli
from ckptio.errors import FormatError, NotFoundError

st = pytest.importorskip("safetensors.torch")

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def sample() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {
        "model.w": torch.randn(64, 32, generator=g),
        "model.b": torch.randn(32, generator=g).to(torch.bfloat16),
        "step": torch.tensor(7, dtype=torch.int64),
        "mask": torch.rand(9, generator=g) > 0.5,
        "ids": torch.arange(-5, 6, dtype=torch.int8),
        "half": torch.randn(3, 5, generator=g).half(),
        "f64": torch.randn(2, generator=g).double(),
        "c": torch.randn(4, generator=g, dtype=torch.complex64),
        "empty": torch.zeros(0, 7),
        "u8": torch.arange(13, dtype=torch.uint8),
        "i32": torch.arange(6, dtype=torch.int32).reshape(2, 3),
        'clé ünïcode \n"q"': torch.ones(2, 2),
    }
    for name in ("float8_e4m3fn", "float8_e5m2", "uint16", "uint32", "uint64"):
        if hasattr(torch, name):
            out[name] = torch.arange(6).to(getattr(torch, name))
    return out


def same(a: dict, b: dict) -> None:
    assert list(a) == list(b) or set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k].view(-1).view(torch.uint8), b[k].contiguous().view(-1).view(torch.uint8)), k


def header(data: bytes) -> dict:
    (n,) = struct.unpack_from("<Q", data)
    return json.loads(data[8 : 8 + n])


# ---- byte compatibility with safetensors.torch ---------------------------------------------------


@pytest.mark.parametrize("metadata", [None, {}, {"format": "pt"}])
def test_same_bytes_as_save_file(tmp_path, metadata):
    sd = sample()
    ckptio.dump(sd, tmp_path / "a.safetensors", metadata=metadata)
    st.save_file(sd, tmp_path / "b.safetensors", metadata=metadata)
    assert (tmp_path / "a.safetensors").read_bytes() == (tmp_path / "b.safetensors").read_bytes()
    same(sd, st.load_file(tmp_path / "a.safetensors"))
    same(sd, ckptio.load(tmp_path / "b.safetensors"))
    assert ckptio.dump(sd, file_format="safetensors", metadata=metadata) == st.save(sd, metadata=metadata)


def test_many_metadata_keys_same_content(tmp_path):
    """The package writes metadata in hash order (it differs between its own runs): compare parsed."""
    sd, md = sample(), {f"k{i}": f"v{i}" for i in range(6)}
    ours = ckptio.dump(sd, file_format="safetensors", metadata=md)
    theirs = st.save(sd, metadata=md)
    assert len(ours) == len(theirs) and header(ours) == header(theirs)
    assert list(header(ours)["__metadata__"]) == list(md)  # ours keeps the caller's order
    assert ours[-1000:] == theirs[-1000:]
    assert st.load(ours).keys() == sd.keys()


def test_float4_and_e8m0(tmp_path):
    if not hasattr(torch, "float4_e2m1fn_x2") or not hasattr(torch, "float8_e8m0fnu"):
        pytest.skip("torch without float4/e8m0")
    sd = {
        "f4": torch.arange(8, dtype=torch.uint8).reshape(2, 4).view(torch.float4_e2m1fn_x2),
        "e8m0": torch.arange(5, dtype=torch.uint8).view(torch.float8_e8m0fnu),
    }
    ckptio.dump(sd, tmp_path / "a.safetensors")
    assert header((tmp_path / "a.safetensors").read_bytes())["f4"]["shape"] == [2, 8]
    back = ckptio.load(tmp_path / "a.safetensors")
    assert back["f4"].dtype == torch.float4_e2m1fn_x2 and back["f4"].shape == (2, 4)
    assert torch.equal(back["f4"].view(torch.uint8), sd["f4"].view(torch.uint8))
    pkg = st.load_file(tmp_path / "a.safetensors")
    assert torch.equal(pkg["e8m0"].view(torch.uint8), sd["e8m0"].view(torch.uint8))


@pytest.mark.parametrize(
    "bad, what",
    [
        ([torch.ones(1)], "flat dict"),
        ({"a": {"b": torch.ones(1)}}, "`a`.*flatten"),
        ({"a": torch.ones(1), "n": 3}, "`n`"),
        ({1: torch.ones(1)}, "key 1"),
        ({"__metadata__": torch.ones(1)}, "reserved"),
        ({"q": torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.qint8)}, "'q'"),
        ({"s": torch.ones(2, 2).to_sparse()}, "'s'.*to_dense"),
        ({"c128": torch.ones(2, dtype=torch.complex128)}, "'c128'"),
    ],
)
def test_dump_refuses_what_safetensors_cannot_hold(local_uri, bad, what):
    uri = f"{local_uri}/x.safetensors"
    with pytest.raises(TypeError, match=what):
        ckptio.dump(bad, uri)
    assert not ckptio.exists(uri)


@pytest.mark.parametrize("md, what", [({"a": 1}, r"metadata\['a'\]"), ({2: "x"}, r"metadata\[2\]"), ("x", "metadata")])
def test_dump_refuses_bad_metadata(local_uri, md, what):
    with pytest.raises(TypeError, match=what):
        ckptio.dump({"a": torch.ones(1)}, f"{local_uri}/x.safetensors", metadata=md)


# ---- the package's refusals (its test_pt_comparison.py and save_file's checks) --------------------

_BASE = torch.arange(24, dtype=torch.float32).reshape(4, 6)
REFUSED = {  # what safetensors.torch.save_file refuses, and the words of its error that ours has too
    "not_contiguous": ({"a": _BASE.t()}, "non contiguous tensor: `a`"),
    "expanded": ({"a": torch.zeros(1).expand(3)}, "non contiguous tensor: `a`"),
    "column": ({"col": _BASE[:, 1]}, "non contiguous tensor: `col`"),
    "shared_storage": ({"a": _BASE, "b": _BASE}, "Some tensors share memory"),
    "overlapping_views": ({"a": _BASE, "b": _BASE[1]}, "Some tensors share memory"),
    "dict_value": (
        {"a": {"b": torch.ones(1)}},
        "Key `a` is invalid, expected torch.Tensor but received <class 'dict'>",
    ),
    "int_value": ({"a": torch.ones(1), "n": 3}, "Key `n` is invalid, expected torch.Tensor but received <class 'int'>"),
    "sparse": ({"s": torch.ones(2, 2).to_sparse()}, "You are trying to save a sparse tensors: `['s']`"),
    "meta": ({"m": torch.empty(2, device="meta")}, "Cannot copy out of meta tensor"),
    "not_a_dict": ([torch.ones(1)], "Expected a dict of [str, torch.Tensor] but received <class 'list'>"),
    "int_key": ({1: torch.ones(1)}, "str"),  # the package's words here are pyo3's
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_dump_refuses_what_the_package_refuses_with_its_error_type(tmp_path, case):
    sd, words = REFUSED[case]
    with pytest.raises(Exception) as theirs:
        st.save_file(sd, tmp_path / "theirs.safetensors")
    with pytest.raises(type(theirs.value)) as ours:  # the package's type; TypeError as ckptio always raised
        ckptio.dump(sd, tmp_path / "ours.safetensors")
    assert isinstance(ours.value, TypeError) and "ours.safetensors" in str(ours.value), ours.value
    assert words in str(theirs.value) and words in str(ours.value), (theirs.value, ours.value)
    with pytest.raises(type(theirs.value), match=re.escape(words)):
        ckptio.dump(sd, file_format="safetensors")
    assert not (tmp_path / "ours.safetensors").exists()


def test_dump_accepts_what_the_package_accepts_from_one_storage(tmp_path):
    """Disjoint parts of one storage share no bytes: both write them, byte for byte the same."""
    flat = torch.arange(12, dtype=torch.float32)
    sd = {"lo": flat[:5], "hi": flat[5:], "rows": _BASE[1:3], "e1": torch.empty(0), "e2": torch.empty(0)}
    assert ckptio.dump(sd, file_format="safetensors") == st.save(sd)
    ckptio.dump(sd, tmp_path / "a.safetensors")
    same(sd, ckptio.load(tmp_path / "a.safetensors"))


@pytest.mark.parametrize("md", [[], 0, False, "", "x", {"k": 1}, {"k": None}, [["k", "v"]]])
def test_load_refuses_metadata_that_is_not_a_str_to_str_object(tmp_path, md):
    data = craft({"__metadata__": md, "a": T()}, bytes(8))
    path = tmp_path / "m.safetensors"
    path.write_bytes(data)
    with pytest.raises(Exception, match="header"):  # the package refuses it (SafetensorError)
        st.load(data)
    for load in (lambda: ckptio.load(path), lambda: ckptio.load(path, mmap=False), lambda: ckptio.info(path)):
        with pytest.raises(FormatError, match=r"m\.safetensors: __metadata__ must be"):
            load()


@pytest.mark.parametrize("md", [None, {}, {"k": "v"}])
def test_load_accepts_metadata_the_package_accepts(tmp_path, md):
    data = craft({"__metadata__": md, "a": T()}, bytes(8))
    (tmp_path / "m.safetensors").write_bytes(data)
    assert st.load(data).keys() == ckptio.load(tmp_path / "m.safetensors").keys() == {"a"}


# ---- every storage -------------------------------------------------------------------------------


@pytest.mark.parametrize("fx", ["local_uri", "memory_uri", "s3_uri", "gcs_uri", "fsspec_uri", "user_uri"])
def test_round_trip_partial_and_map_location(request, fx):
    uri = request.getfixturevalue(fx) + "/run/model.safetensors"
    sd = sample()
    ckptio.dump(sd, uri, metadata={"format": "pt"})
    data = ckptio.get(uri)
    assert data == st.save(sd, metadata={"format": "pt"})
    same(sd, ckptio.load(uri))
    part = ckptio.load(uri, keys=["half", "model.w"])
    assert list(part) == ["half", "model.w"]
    same({k: sd[k] for k in part}, part)
    seen = []
    back = ckptio.load(uri, keys=["step"], map_location=lambda s, loc: seen.append(loc))
    assert seen == ["cpu"] and back["step"].item() == 7
    assert ckptio.load(uri, keys=["ids"], map_location={"cpu": "cpu"})["ids"].device.type == "cpu"
    with pytest.raises(KeyError, match="nope"):
        ckptio.load(uri, keys=["nope"])
    twice = ckptio.load(uri, keys=["ids", "u8", "ids"])  # one read per range, not two
    assert list(twice) == ["ids", "u8"] and torch.equal(twice["ids"], sd["ids"]) and torch.equal(twice["u8"], sd["u8"])
    with pytest.raises(TypeError, match="list"):
        ckptio.load(uri, keys="ids")
    with pytest.raises(ckptio.AlreadyExistsError):
        ckptio.dump(sd, uri, mode="create")


def test_local_load_maps_the_file_copy_on_write(tmp_path):
    path = tmp_path / "m.safetensors"
    sd = sample()
    ckptio.dump(sd, path)
    before = path.read_bytes()
    mapped = ckptio.load(path)
    mapped["model.w"].add_(1)  # private mapping: the file does not change
    assert path.read_bytes() == before
    read = ckptio.load(path, mmap=False)
    same(sd, read)
    with open(path, "rb") as f:
        same(sd, ckptio.load(f, file_format="safetensors"))


def test_misaligned_tensor_is_copied_to_aligned_memory(tmp_path):
    body = {
        "b": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},
        "a": {"dtype": "F32", "shape": [2], "data_offsets": [1, 9]},
    }
    raw = json.dumps(body).encode()
    data = struct.pack("<Q", len(raw)) + raw + b"\x07" + struct.pack("<2f", 1.5, -2.0)
    (tmp_path / "odd.safetensors").write_bytes(data)
    for mmap in (True, False):
        a = ckptio.load(tmp_path / "odd.safetensors", mmap=mmap)["a"]
        assert a.tolist() == [1.5, -2.0] and a.data_ptr() % 4 == 0


def test_remote_partial_load_reads_header_then_only_needed_ranges(s3_proxy):
    uri = s3_proxy.uri + "/big.safetensors"
    sd = {f"t{i}": torch.full((256, 1024), float(i)) for i in range(8)}  # 1 MiB each
    ckptio.dump(sd, uri)
    s3_proxy.clear()
    part = ckptio.load(uri, keys=["t5"])
    assert torch.equal(part["t5"], sd["t5"])
    gets = [r for r in s3_proxy.requests if r.method == "GET"]
    assert len(gets) == 2  # the header (with the first 256 KiB), then t5's range
    assert s3_proxy.bytes_out < (1 << 20) + (300 << 10)
    s3_proxy.clear()
    same(sd, ckptio.load(uri))
    assert s3_proxy.bytes_out == ckptio.stat(uri).size  # a full load reads each byte once
    with pytest.raises(ValueError, match="mmap"):
        ckptio.load(uri, mmap=True)


# ---- sharded checkpoints -------------------------------------------------------------------------


def write_sharded(root: str, sd: dict, nshards: int = 3, index: dict | None = None) -> str:
    keys = list(sd)
    weight_map = {}
    for s in range(nshards):
        name = f"model-{s + 1:05d}-of-{nshards:05d}.safetensors"
        part = {k: sd[k] for k in keys[s::nshards]}
        ckptio.put(st.save(part, metadata={"format": "pt"}), f"{root}/{name}")
        weight_map.update({k: name for k in part})
    doc = index or {"metadata": {"total_size": sum(t.nbytes for t in sd.values())}, "weight_map": weight_map}
    ckptio.put(json.dumps(doc).encode(), f"{root}/model.safetensors.index.json")
    return f"{root}/model.safetensors.index.json"


@pytest.mark.parametrize("fx", ["local_uri", "s3_uri"])
def test_sharded_load_through_the_index(request, fx, capsys):
    sd = sample()
    index = write_sharded(request.getfixturevalue(fx) + "/hf", sd)
    same(sd, ckptio.load(index))
    part = ckptio.load(index, keys=["model.b", "step", "c"])
    assert list(part) == ["model.b", "step", "c"]
    same({k: sd[k] for k in part}, part)
    with pytest.raises(KeyError, match="missing"):
        ckptio.load(index, keys=["missing"])
    assert cli.main(["--json", "info", index]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["format"] == "safetensors" and doc["shards"] == 3 and len(doc["tensors"]) == len(sd)
    assert doc["values"]["total_size"] > 0
    assert cli.main(["--json", "verify", index]) == 0
    assert json.loads(capsys.readouterr().out)["checked"] == 3


def test_sharded_load_through_the_node_cache(s3_uri, tmp_path):
    sd = sample()
    index = write_sharded(s3_uri + "/hf", sd, nshards=2)
    same(sd, ckptio.load(index, cache=str(tmp_path / "cache")))
    assert len(os.listdir(tmp_path / "cache" / "data")) >= 1


@pytest.mark.parametrize(
    "shard",
    [
        "../model-1.safetensors",
        "a/../../x.safetensors",
        "/etc/x.safetensors",
        "s3://other/x.safetensors",
        "file:x.safetensors",
        "a//b.safetensors",
        "./x.safetensors",
        "secrets.json",
        "~/x.safetensors",
        3,
        None,
        "",
    ],
)
def test_index_naming_outside_paths_is_refused(local_uri, shard):
    index = write_sharded(local_uri, {"w": torch.ones(2)}, nshards=1, index={"weight_map": {"w": shard}})
    with pytest.raises(FormatError, match=r"model\.safetensors\.index\.json.*'w'"):
        ckptio.load(index)


def test_index_errors_name_the_index_and_key(local_uri):
    sd = {"a": torch.ones(2), "b": torch.zeros(3)}
    index = write_sharded(local_uri, sd, nshards=1)
    doc = json.loads(ckptio.get(index))
    doc["weight_map"]["ghost"] = doc["weight_map"]["a"]
    ckptio.put(json.dumps(doc).encode(), index)
    with pytest.raises(FormatError, match="'ghost'"):
        ckptio.load(index)
    with pytest.raises(FormatError, match="'ghost'"):
        ckptio.load(index, keys=["ghost"])
    assert cli.main(["verify", index]) == cli.EXIT_FAILURE
    doc["weight_map"] = {"a": "model-00009-of-00009.safetensors"}
    ckptio.put(json.dumps(doc).encode(), index)
    with pytest.raises(NotFoundError, match="model-00009"):
        ckptio.load(index)
    for bad in (b'{"weight_map": [1]}', b"[]", b'{"weight_map": {}, "weight_map": {}}', b"\xff"):
        ckptio.put(bad, index)
        with pytest.raises(FormatError, match="index.json"):
            ckptio.load(index)


# ---- info / verify -------------------------------------------------------------------------------


@pytest.mark.parametrize("fx", ["local_uri", "s3_uri"])
def test_cli_info_and_verify(request, fx, capsys):
    uri = request.getfixturevalue(fx) + "/m.safetensors"
    sd = sample()
    ckptio.put(st.save(sd, metadata={"format": "pt"}), uri)  # written by the package
    assert cli.main(["--json", "info", uri]) == 0
    doc = json.loads(capsys.readouterr().out)
    t = {x["key"]: x for x in doc["tensors"]}
    assert doc["format"] == "safetensors" and doc["values"] == {"format": "pt"}
    assert t["model.w"] == {"key": "model.w", "dtype": "float32", "shape": [64, 32], "nbytes": 64 * 32 * 4}
    assert doc["size"] == ckptio.stat(uri).size and doc["tensor_bytes"] == sum(v.nbytes for v in sd.values())
    assert cli.main(["--json", "verify", uri]) == 0
    assert json.loads(capsys.readouterr().out)["ok"] is True
    data = ckptio.get(uri)
    ckptio.put(data[:-3], uri)
    assert cli.main(["verify", uri]) == cli.EXIT_FAILURE
    assert "truncated" in capsys.readouterr().err
    h = header(data)
    h["model.w"]["data_offsets"][1] -= 4  # overlaps the next tensor
    raw = json.dumps(h).encode()
    ckptio.put(struct.pack("<Q", len(raw)) + raw + data[8 + struct.unpack_from("<Q", data)[0] :], uri)
    assert cli.main(["info", uri]) == cli.EXIT_FAILURE
    assert "'model.w'" in capsys.readouterr().err


@pytest.mark.parametrize(
    "data, want",
    [
        (lambda: craft({"a": T(), "b": T()}, bytes(16)), "overlaps"),
        (lambda: craft({"a": T()}, bytes(16)), "8 bytes after the last tensor"),
        (
            lambda: craft(
                b'{"a": ' + json.dumps(T()).encode() + b', "a": ' + json.dumps(T()).encode() + b"}", bytes(8)
            ),
            "'a' twice",
        ),
        (lambda: craft({"a": T(dtype="F32", shape=(3,))}, bytes(8)), "'a'"),
    ],
)
def test_cli_verify_refuses_what_a_header_length_check_accepts(local_uri, capsys, data, want):
    uri = f"{local_uri}/m.safetensors"
    ckptio.put(data(), uri)
    assert cli.main(["verify", uri]) == cli.EXIT_FAILURE
    err = capsys.readouterr().err
    assert want in err and "m.safetensors" in err


# ---- crafted files: FormatError naming the file and key, never a crash (in a subprocess) -----------

CHILD = r"""
import io, json, random, struct, sys
import torch, ckptio
from ckptio.errors import FormatError

def run(data, **kw):
    try:
        ckptio.put(data, "memory://c/x.safetensors")
        ckptio.load("memory://c/x.safetensors", **kw)
        return ["ok", ""]
    except (FormatError, KeyError) as e:
        return [type(e).__name__, str(e)]
    except Exception as e:  # anything else is a bug
        return ["BUG " + type(e).__name__, str(e)]

def run_local(data, path, mmap):
    with open(path, "wb") as f:
        f.write(data)
    try:
        ckptio.load(path, mmap=mmap)
        return ["ok", ""]
    except FormatError as e:
        return [type(e).__name__, str(e)]
    except Exception as e:
        return ["BUG " + type(e).__name__, str(e)]

cases, path = json.loads(sys.stdin.read()), sys.argv[1]
out = {}
for name, hexdata in cases.items():
    data = bytes.fromhex(hexdata)
    out[name] = [run(data), run_local(data, path, True), run_local(data, path, False)]
good = bytes.fromhex(cases["__good__"])
rng = random.Random(1234)
bugs = []
for i in range(400):
    d = bytearray(good)
    if i % 2:
        for _ in range(rng.randint(1, 4)):
            d[rng.randrange(min(len(d), 200))] ^= rng.randint(1, 255)
    else:
        d = d[: rng.randrange(len(d))] + bytes(rng.randrange(12))
    for r in (run(bytes(d)), run_local(bytes(d), path, True)):
        if r[0].startswith("BUG"):
            bugs.append(r)
out["__fuzz__"] = bugs
print(json.dumps(out))
"""


def craft(entries: dict | bytes, data: bytes = b"", length: int | None = None, pad: bool = True) -> bytes:
    raw = entries if isinstance(entries, bytes) else json.dumps(entries).encode()
    if pad:
        raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw) if length is None else length) + raw + data


def T(dtype="F32", shape=(2,), offsets=(0, 8)):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


CRAFTED = {
    # name: (file bytes, substring the message must contain besides the file name)
    "too_short": (b"\x01\x00", "too short"),
    "header_beyond_file": (craft({"w": T()}, bytes(8), length=1 << 20), "past the end"),
    "huge_header": (craft({"w": T()}, bytes(8), length=(1 << 64) - 1), "limit"),
    "not_json": (craft(b"{not json", bytes(8)), "not valid JSON"),
    "not_object": (craft(b"[1, 2]", b""), "start"),
    "not_utf8": (craft(b'{"\xff": 1}', b""), "UTF-8"),
    "deep": (craft(b'{"w": ' + b"[" * 100000 + b"]" * 100000 + b"}", b""), "JSON"),
    "duplicate_key": (
        craft(b'{"w": ' + json.dumps(T()).encode() + b', "w": ' + json.dumps(T()).encode() + b"}", bytes(8)),
        "'w' twice",
    ),
    "unknown_dtype": (craft({"w": T(dtype="F128")}, bytes(8)), "'w'"),
    "no_torch_dtype": (craft({"w": T(dtype="F6_E2M3", shape=(4,), offsets=(0, 3))}, bytes(3)), "'w'"),
    "negative_dim": (craft({"w": T(shape=(-2,))}, bytes(8)), "'w'"),
    "float_dim": (craft({"w": T(shape=(2.0,))}, bytes(8)), "'w'"),
    "bool_dim": (craft({"w": T(shape=(True, 2))}, bytes(8)), "'w'"),
    "many_dims": (craft({"w": T(shape=(1,) * 65, offsets=(0, 4))}, bytes(4)), "'w'"),
    "huge_dims": (craft({"w": T(shape=(1 << 62, 1 << 62), offsets=(0, 8))}, bytes(8)), "'w'"),
    "zero_and_huge": (craft({"w": T(shape=(0, 1 << 70), offsets=(0, 0))}, b""), "'w'"),
    "zero_and_huge_product": (craft({"w": T(shape=(0, 1 << 62, 1 << 62), offsets=(0, 0))}, b""), "'w'"),
    "huge_product_then_zero": (craft({"w": T(shape=(1 << 40, 1 << 40, 0), offsets=(0, 0))}, b""), "'w'"),
    "size_mismatch": (craft({"w": T(shape=(3,))}, bytes(8)), "'w'"),
    "offsets_reversed": (craft({"w": T(offsets=(8, 0))}, bytes(8)), "'w'"),
    "offsets_three": (craft({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4, 8]}}, bytes(8)), "'w'"),
    "offset_out_of_range": (craft({"w": T(offsets=(1 << 40, (1 << 40) + 8))}, bytes(8)), "'w'"),
    "overlap": (craft({"a": T(), "b": T(offsets=(4, 12))}, bytes(12)), "'b'"),
    "same_range": (craft({"a": T(), "b": T()}, bytes(8)), "'"),
    "gap": (craft({"a": T(offsets=(4, 12))}, bytes(12)), "'a'"),
    "truncated_data": (craft({"a": T(shape=(4,), offsets=(0, 16))}, bytes(8)), "truncated"),
    "trailing_bytes": (craft({"a": T()}, bytes(16)), "after the last tensor"),
    "metadata_not_str": (craft({"__metadata__": {"k": 1}, "a": T()}, bytes(8)), "__metadata__"),
    "metadata_list": (craft({"__metadata__": [], "a": T()}, bytes(8)), "__metadata__"),
    "metadata_zero": (craft({"__metadata__": 0, "a": T()}, bytes(8)), "__metadata__"),
    "metadata_false": (craft({"__metadata__": False, "a": T()}, bytes(8)), "__metadata__"),
    "metadata_str": (craft({"__metadata__": "", "a": T()}, bytes(8)), "__metadata__"),
    "entry_not_object": (craft({"a": [1, 2]}, bytes(8)), "'a'"),
    "f4_odd": (craft({"a": T(dtype="F4", shape=(3,), offsets=(0, 2))}, bytes(2)), "'a'"),
    "f4_odd_last": (craft({"a": T(dtype="F4", shape=(3, 1), offsets=(0, 2))}, bytes(2)), "'a'"),
}


def test_crafted_files_raise_format_errors_in_a_subprocess(tmp_path):
    cases = {k: v[0].hex() for k, v in CRAFTED.items()}
    cases["__good__"] = st.save(
        {"a": torch.arange(6.0), "b": torch.ones(3, dtype=torch.int8), "c": torch.zeros(2, 2, dtype=torch.float16)},
        metadata={"m": "x"},
    ).hex()
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path / "crafted.safetensors")],
        input=json.dumps(cases),
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    assert out.pop("__fuzz__") == []
    assert out.pop("__good__") == [["ok", ""]] * 3
    for name, (_, want) in CRAFTED.items():
        for (kind, msg), where in zip(
            out[name], ("memory://c/x.safetensors", "crafted.safetensors", "crafted.safetensors"), strict=True
        ):
            assert kind in ("FormatError", "IntegrityError"), (name, kind, msg)
            assert where in msg and want in msg, (name, msg)


# ---- the benchmark runs (no timing checks) -------------------------------------------------------


def test_benchmark_smoke(tmp_path, capsys):
    sys.path.insert(0, ROOT)
    from benchmarks import safetensors_bench

    assert safetensors_bench.main(["--size-mib", "1", "--runs", "1", "--no-s3", "--out", str(tmp_path)]) == 0
    (out,) = tmp_path.iterdir()
    doc = json.loads(out.read_text())
    ratios = [r for table in doc["results"] for r in table["ratios"]]
    assert len(ratios) == 4 and all(r["ratio"] > 0 for r in ratios)
    assert "ckptio.load (mapped)" in capsys.readouterr().out

"""A crafted DCP checkpoint runs no code and makes ckptio allocate nothing far beyond what it stores
(:mod:`ckptio.dcp.checks`), while the non-tensor state DCP users save keeps loading by default.

Crafted checkpoints load in a child process (``dcp_workers.load_capped``) whose address space is
capped with ``RLIMIT_AS``: a huge allocation fails the child, not the machine, and a payload that
ran leaves a marker file behind.
"""

from __future__ import annotations

import collections
import io
import json
import os
import pickle
import random
import sys
import uuid
import warnings
import zipfile

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
import xxhash
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

import ckptio
import ckptio.dcp as cd
import zygote
from ckptio.checkpointer import Checkpointer
from ckptio.errors import FormatError
from conftest import S3_TEST_OPTIONS
from test_dcp import assert_same, blank

pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
    pytest.mark.filterwarnings("ignore::ckptio.checkpointer.CheckpointWarning"),
]
WORKER = os.path.join(os.path.dirname(__file__), "dcp_workers.py")
KINDS = ["ckptio", "torch", "checkpointer"]


class Evil:
    """Unpickling it creates ``marker``: proof that code from the checkpoint ran."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def load_in_child(tmp_path, jobs: list[dict], backends: dict | None = None) -> list[dict]:
    """Run ``jobs`` (uri, state, kind, options, root) in one capped child; what each did."""
    for job in jobs:
        path = str(tmp_path / f"state-{uuid.uuid4().hex}.pt")
        torch.save(job["state"], path)
        job["state"] = path
        job.setdefault("root", str(tmp_path / "ckroot"))
    args = json.dumps({"jobs": jobs, "backends": backends})
    proc = zygote.run([sys.executable, WORKER, "load_capped", args], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def assert_refused(result: dict, *parts: str) -> None:
    # torch's own dcp.load wraps the reader's error in a CheckpointException that quotes it
    assert (
        "FormatError" in result["types"]
        or "ckptio.errors.FormatError" in result["outcome"]
        or "ckptio.errors.IntegrityError" in result["outcome"]
    ), result
    for part in parts:
        assert part in result["outcome"], (part, result)


def edit_metadata(uri: str, edit) -> None:
    md = cd.loads_metadata(ckptio.get(f"{uri}/.metadata"))
    edit(md)
    ckptio.put(pickle.dumps(md), f"{uri}/.metadata")


def entry(md, fqn: str):
    return next(s for i, s in md.storage_data.items() if i.fqn == fqn)


def replace_item(uri: str, fqn: str, data: bytes) -> None:
    """Point the storage entry of ``fqn`` at ``data``, appended to its data object (checksums updated)."""

    def edit(md):
        s = entry(md, fqn)
        obj = f"{uri}/{s.relative_path}"
        old = ckptio.get(obj)
        ckptio.put(old + data, obj)
        s.offset, s.length = len(old), len(data)
        if getattr(s, "ckptio", None) is not None:
            s.ckptio.update(xxh3=[xxhash.xxh3_64_intdigest(data)], block=max(len(data), 1))

    edit_metadata(uri, edit)


def stored_zip(pkl: bytes, method: int = zipfile.ZIP_STORED, **more: bytes) -> bytes:
    """A torch.save-like archive holding ``pkl`` as its data.pkl (and records ``more``)."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=method) as z:
        for name, data in {"data.pkl": pkl, "byteorder": b"little", "version": b"3\n", **more}.items():
            z.writestr(f"archive/{name}", data)
    return buf.getvalue()


# ---- non-tensor items: no code runs -------------------------------------------------------------


@pytest.mark.parametrize("where,writer", [("local", "ckptio"), ("local", "torch"), ("s3", "ckptio")])
def test_bytes_item_payload_runs_nothing(tmp_path, request, where, writer):
    """A non-tensor item that unpickles to a call of ``open``: every way of loading refuses it, naming
    the checkpoint, the item and allow_pickle=True, and the payload never runs."""
    backends = None
    if where == "s3":
        root = request.getfixturevalue("s3_uri")
        backends = {"s3": {"endpoint_url": request.getfixturevalue("s3_endpoint"), **S3_TEST_OPTIONS}}
    else:
        root = str(tmp_path)
    uri, marker = f"{root}/ckpt", str(tmp_path / "PWNED")
    state = {"m": {"x": torch.ones(2), "opt": {"lr": 0.1, "hook": Evil(marker)}}}
    if writer == "ckptio":
        cd.save(state, uri)
    else:
        dcp.save(state, storage_writer=dcp.FileSystemWriter(uri))
    blank = {"m": {"x": torch.zeros(2), "opt": {"lr": None, "hook": None}}}
    jobs = [{"uri": uri, "state": blank, "kind": kind} for kind in KINDS]
    for result in load_in_child(tmp_path, jobs, backends):
        assert_refused(result, uri, "'m.opt.hook'", "allow_pickle=True", "io.open")
    assert not os.path.exists(marker)


def test_allow_pickle_loads_trusted_objects(tmp_path):
    uri, marker = str(tmp_path / "ckpt"), str(tmp_path / "RAN")
    cd.save({"m": {"x": torch.ones(2), "obj": Evil(marker)}}, uri)
    blank = {"m": {"x": torch.zeros(2), "obj": None}}
    jobs = [
        {"uri": uri, "state": blank, "kind": kind, "options": {"allow_pickle": True}}
        for kind in ("ckptio", "checkpointer")
    ]
    assert [r["outcome"] for r in load_in_child(tmp_path, jobs)] == ["ok", "ok"]
    assert os.path.exists(marker)  # the opt-in reaches the planner's plain unpickle


def _torchscript() -> bytes:
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.jit.save(torch.jit.script(torch.nn.Linear(2, 2)), buf)
    return buf.getvalue()


CRAFTED_ITEMS = {  # bytes a non-tensor item is replaced with -> what the refusal says
    "legacy_pickle": (lambda marker: pickle.dumps(Evil(marker), protocol=2), "not a torch.save zip archive"),
    "torchscript": (lambda marker: _torchscript(), ""),  # torch.load hands these to torch.jit.load
    "torchscript_stored": (lambda marker: stored_zip(pickle.dumps(0, 2), **{"constants.pkl": b"."}), "TorchScript"),
    # the C unpickler sizes its memo by the largest index: 32 GiB for these 8 bytes
    "memo_index": (lambda marker: stored_zip(b"\x80\x02Nr\xff\xff\xff\x7f."), "memo entry at index 2147483647"),
    # torch's zip reader allocates the size a record's header claims
    "deflated_record": (
        lambda marker: _inflated(stored_zip(pickle.dumps(0, 2), zipfile.ZIP_DEFLATED)),
        "compressed zip record",
    ),
}


def _inflated(archive: bytes) -> bytes:
    """``archive`` with the uncompressed size of its first record's headers set to 3.5 GiB."""
    raw = bytearray(archive)
    for sig, at in ((b"PK\x03\x04", 22), (b"PK\x01\x02", 24)):
        i = raw.find(sig)
        raw[i + at : i + at + 4] = (0xE0000000).to_bytes(4, "little")
    return bytes(raw)


@pytest.mark.parametrize("case", sorted(CRAFTED_ITEMS))
def test_crafted_bytes_items_are_refused(tmp_path, case):
    make, says = CRAFTED_ITEMS[case]
    uri, marker = str(tmp_path / "ckpt"), str(tmp_path / "PWNED")
    cd.save({"m": {"x": torch.ones(2), "step": 3}}, uri)
    replace_item(uri, "m.step", make(marker))
    blank = {"m": {"x": torch.zeros(2), "step": None}}
    (result,) = load_in_child(tmp_path, [{"uri": uri, "state": blank, "kind": "ckptio"}])
    assert_refused(result, "'m.step'", says, "allow_pickle=True")
    assert not os.path.exists(marker)


# ---- sizes from .metadata: checked against what is stored before anything is allocated ----------


def _set(fqn: str, **fields):
    def edit(md):
        s = entry(md, fqn)
        for k, v in fields.items():
            if k.startswith("info_"):
                s.ckptio[k[5:]] = v
            else:
                setattr(s, k, v)

    return edit


CRAFTED_SIZES = {  # writer, item, edit, what the error says
    "torch_tensor_length": ("torch", "m.w", _set("m.w", length=1 << 40), "past its end"),
    "bytes_length": ("ckptio", "m.step", _set("m.step", length=1 << 40, info_block=1 << 40), "past its end"),
    "tensor_nbytes": ("ckptio", "m.w", _set("m.w", info_shape=[1 << 20, 1 << 20], info_nbytes=1 << 42), "outside its"),
    "negative_offset": ("ckptio", "m.w", _set("m.w", offset=-64), "offset -64"),
    "float_length": ("ckptio", "m.step", _set("m.step", length=1e12), "length 1000000000000.0"),
    "str_length": ("torch", "m.step", _set("m.step", length="64"), "length '64'"),
    "bool_offset": ("torch", "m.w", _set("m.w", offset=True), "offset True"),
    "not_a_dtype": ("ckptio", "m.w", _set("m.w", info_dtype="load"), "dtype 'load'"),
    "short_checksums": ("ckptio", "m.w", _set("m.w", info_xxh3=[]), "checksums"),
    "zero_block": ("ckptio", "m.w", _set("m.w", info_block=0), "checksums"),
    "shape_smaller_than_chunk": ("ckptio", "m.w", _set("m.w", info_shape=[2, 8], info_nbytes=64), "outside the shape"),
}


@pytest.mark.parametrize("writer", ["ckptio", "torch"])
def test_crafted_sizes_are_refused_before_allocating(tmp_path, writer):
    """Each crafted storage entry is refused with a FormatError naming the data object and the item."""
    state = {"m": {"w": torch.arange(32, dtype=torch.float32).reshape(4, 8), "step": 3}}
    blank = {"m": {"w": torch.zeros(4, 8), "step": None}}
    jobs, expected = [], []
    for case, (w, fqn, edit, says) in sorted(CRAFTED_SIZES.items()):
        if w != writer:
            continue
        uri = str(tmp_path / case)
        if writer == "ckptio":
            cd.save(state, uri)
        else:
            dcp.save(state, storage_writer=dcp.FileSystemWriter(uri))
        edit_metadata(uri, edit)
        obj = entry(cd.loads_metadata(ckptio.get(f"{uri}/.metadata")), fqn).relative_path
        jobs.append({"uri": uri, "state": blank, "kind": "ckptio"})
        expected.append((case, f"{uri}/{obj}", f"'{fqn}'", says))
    for result, (case, *parts) in zip(load_in_child(tmp_path, jobs), expected, strict=True):
        assert_refused({**result, "case": case}, *parts)


def test_cli_verify_sizes_nothing_from_crafted_metadata(tmp_path):
    uri = str(tmp_path / "ckpt")
    cd.save({"m": {"w": torch.ones(4, 8)}}, uri)
    edit_metadata(uri, _set("m.w", info_shape=[1 << 20, 1 << 20], info_nbytes=1 << 42, info_block=1 << 42))
    (result,) = load_in_child(tmp_path, [{"uri": uri, "state": {}, "kind": "verify"}])
    assert_refused(result, "'m.w'", "outside its")


def test_crafted_length_on_s3(tmp_path, s3_uri, s3_endpoint):
    uri = f"{s3_uri}/ckpt"
    cd.save({"m": {"w": torch.ones(4, 8), "step": 3}}, uri)
    edit_metadata(uri, _set("m.step", length=1 << 40, info_block=1 << 40))
    blank = {"m": {"w": torch.zeros(4, 8), "step": None}}
    backends = {"s3": {"endpoint_url": s3_endpoint, **S3_TEST_OPTIONS}}
    jobs = [{"uri": uri, "state": blank, "kind": kind, "root": f"{s3_uri}/ck"} for kind in KINDS]
    for result in load_in_child(tmp_path, jobs, backends):
        assert_refused(result, "'m.step'", "past its end", s3_uri)


def test_overlapping_items_are_refused(tmp_path):
    """600 items naming the same 4 MiB of stored bytes would load 2.4 GB from one 4 MiB object."""
    uri = str(tmp_path / "ckpt")
    cd.save({"m": {"blob": b"x" * (4 << 20)}}, uri)
    names = [f"blob{i}" for i in range(600)]

    def edit(md):
        sinfo = entry(md, "m.blob")
        for n in names:
            md.state_dict_metadata[f"m.{n}"] = BytesStorageMetadata()
            md.storage_data[MetadataIndex(f"m.{n}")] = sinfo

    edit_metadata(uri, edit)
    (result,) = load_in_child(tmp_path, [{"uri": uri, "state": {"m": dict.fromkeys(names)}, "kind": "ckptio"}])
    assert_refused(result, "overlap")


def test_checkpointer_allocates_only_stored_tensors(tmp_path):
    """The Checkpointer builds tensors the state lacks from .metadata: a 1 TiB one backed by 8 stored
    bytes is refused."""
    uri = str(tmp_path / "ckpt")
    cd.save({"m": {"x": torch.ones(2)}}, uri)

    def edit(md):
        huge = torch.Size([1 << 38])
        md.state_dict_metadata["m.ghost"] = TensorStorageMetadata(
            TensorProperties(dtype=torch.float32), huge, [ChunkStorageMetadata(torch.Size([0]), huge)]
        )
        md.planner_data["m.ghost"] = ("m", "ghost")
        md.storage_data[MetadataIndex("m.ghost", (0,))] = entry(md, "m.x")

    edit_metadata(uri, edit)
    job = {"uri": uri, "state": {"m": {"x": torch.zeros(2)}}, "kind": "checkpointer"}
    (result,) = load_in_child(tmp_path, [{**job, "options": {"strict": False}}])  # would allocate it
    assert_refused(result, "'m.ghost'", "stored in 8 bytes")
    (result,) = load_in_child(tmp_path, [job])  # strict: an unexpected key, refused before any read
    assert "KeyError" in result["types"] and "m.ghost" in result["outcome"], result


# ---- what DCP users save keeps loading by default -----------------------------------------------


def plain_state() -> dict:
    return {
        "x": torch.arange(6.0),
        "step": 7,
        "lr": 0.1,
        "name": "run-7",
        "flag": True,
        "nothing": None,
        "cplx": 1 + 2j,
        "raw": b"\x00\x01",
        "ids": [1, 2, 3],
        "cfg": {"a": {"b": [1.5, "x", None]}},
        "betas": (0.9, 0.99),
        "size": torch.Size([2, 3]),
        "dtype": torch.bfloat16,
        "device": torch.device("cpu"),
        "rng": torch.get_rng_state(),
        "py_rng": random.Random(1).getstate(),
        "od": collections.OrderedDict(a=1),
        "set": {1, 2},
        "counter": collections.Counter("aab"),
        "blob": io.BytesIO(b"raw bytes \x00\xff"),
    }


@pytest.mark.parametrize("writer", ["ckptio", "torch"])
@pytest.mark.parametrize("kind", KINDS)
def test_plain_non_tensor_state_loads_by_default(tmp_path, writer, kind):
    uri = str(tmp_path / "ckpt")
    if writer == "ckptio":
        cd.save({"s": plain_state()}, uri)
    else:
        dcp.save({"s": plain_state()}, storage_writer=dcp.FileSystemWriter(uri))
    out = blank({"s": plain_state()})
    if kind == "ckptio":
        cd.load(out, uri)
    elif kind == "torch":
        dcp.load(out, storage_reader=cd.StorageReader(uri))
    else:
        Checkpointer(str(tmp_path / "ck")).load(out, step=uri)
    assert_same(out, {"s": plain_state()})


@pytest.mark.parametrize("writer", ["checkpointer", "torch"])
def test_model_and_optimizer_round_trip(tmp_path, writer):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.8, 0.9), weight_decay=0.1)
    for _ in range(3):
        model(torch.randn(5, 4)).sum().backward()
        optim.step()
        optim.zero_grad()
    root = str(tmp_path / "run")
    if writer == "checkpointer":
        Checkpointer(root, format="dcp").save(3, {"model": model, "optim": optim, "extra": {"epoch": 2}})
        step = "latest"
    else:
        step = str(tmp_path / "torch-ckpt")
        dcp.save(
            {"model": model.state_dict(), "optim": optim.state_dict(), "extra": {"epoch": 2}},
            storage_writer=dcp.FileSystemWriter(step),
        )
    model2 = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    optim2 = torch.optim.AdamW(model2.parameters(), lr=1.0)
    extra: dict = {"epoch": None}
    Checkpointer(root).load({"model": model2, "optim": optim2, "extra": extra}, step=step)
    assert all(
        torch.equal(a, b) for a, b in zip(model.state_dict().values(), model2.state_dict().values(), strict=True)
    )
    want, got = optim.state_dict(), optim2.state_dict()
    assert got["param_groups"] == want["param_groups"] and extra == {"epoch": 2}
    for i, st in want["state"].items():
        assert all(torch.equal(st[k], got["state"][i][k]) for k in st)


def test_numpy_values_need_allow_pickle(tmp_path):
    """numpy's unpickling trusts dtype flags in the file, so torch's weights_only (and ckptio) refuse it by default."""
    uri = str(tmp_path / "ckpt")
    cd.save({"best": np.float64(0.5)}, uri)
    with pytest.raises(FormatError, match=r"'best'.*numpy.*allow_pickle=True"):
        cd.load({"best": None}, uri)
    out: dict = {"best": None}
    cd.load(out, uri, allow_pickle=True)
    assert out["best"] == 0.5


@pytest.mark.filterwarnings("ignore:Detected pickle protocol 4")
def test_weights_only_globals_resolve_to_the_same_callables():
    """The safety argument in ckptio.dcp.checks: each callable torch's weights_only unpickler admits by
    default is, by name, the same object (or nothing) for torch.load's full unpickler, for pickle
    protocols 2 and 4 and every split of its dotted name into module and attribute path."""
    from torch._weights_only_unpickler import _get_allowed_globals

    checked = 0
    for key, obj in _get_allowed_globals().items():
        if not callable(obj):
            continue
        parts = key.split(".")
        for i in range(1, len(parts)):
            module, name = ".".join(parts[:i]), ".".join(parts[i:])
            for proto in (2, 4):
                data = stored_zip(bytes([0x80, proto]) + f"c{module}\n{name}\n.".encode())
                try:
                    assert torch.load(io.BytesIO(data), weights_only=True) is obj
                except pickle.UnpicklingError:
                    continue
                try:
                    full = torch.load(io.BytesIO(data), weights_only=False)
                except (AttributeError, ImportError):
                    continue
                assert full is obj, (key, module, name, proto, full)
                checked += 1
    assert checked > 50

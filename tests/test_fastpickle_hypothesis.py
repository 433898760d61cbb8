"""fastpickle under hypothesis: nested round-trips, and a loader that only ever raises format errors.

Loading a file never executes code, whatever it says; a mutated, truncated, extended or lying file
ends in ckptio's FormatError/IntegrityError (never a crash, a hang or an allocation larger than
the file). The fuzzed files are loaded in a child process (fpk_crafting.LoaderProcess), so a crash
fails the test; test_fastpickle_structure.py fuzzes structure (depth, tables, offsets) the same way.
"""

from __future__ import annotations

import collections
import io
import pathlib
import pickle

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from ckptio import fastpickle as fp
from ckptio.errors import FormatError, IntegrityError
from ckptio.formats.fastpickle import read as fpk_read
from ckptio.formats.fastpickle.meta import read_meta
from fpk_crafting import seal, split
from test_fastpickle import assert_same, roundtrip

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ---- nested structures --------------------------------------------------------------------------

DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int8,
    torch.int64,
    torch.bool,
    torch.complex64,
    torch.uint8,
    torch.float8_e5m2,
]


@st.composite
def tensors(draw):
    dtype = draw(st.sampled_from(DTYPES))
    shape = draw(st.lists(st.integers(0, 4), max_size=3))
    n = int(np.prod(shape)) if shape else 1
    raw = torch.tensor(
        draw(st.lists(st.integers(0, 255), min_size=n * dtype.itemsize, max_size=n * dtype.itemsize)), dtype=torch.uint8
    )
    t = raw.view(dtype).reshape(shape)
    if draw(st.booleans()) and t.dim() >= 2:
        t = t.transpose(0, 1)
    if dtype.is_floating_point and draw(st.booleans()):
        t.requires_grad_(True)
    return t


scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=8)
    | st.complex_numbers()
    | st.integers(-(2**200), 2**200)
)
hashables = st.integers() | st.text(max_size=6) | st.booleans() | st.tuples(st.integers(), st.text(max_size=3))
leaves = scalars | tensors() | hnp.arrays(hnp.scalar_dtypes(), hnp.array_shapes(min_dims=0, max_dims=2, max_side=3))
trees = st.recursive(
    leaves,
    lambda kids: (
        st.lists(kids, max_size=4)
        | st.tuples(kids, kids)
        | st.dictionaries(st.text(max_size=6) | st.integers(), kids, max_size=4)
        | st.dictionaries(hashables, kids, max_size=3).map(collections.OrderedDict)
        | st.sets(hashables, max_size=4)
        | st.frozensets(st.integers(), max_size=3)
    ),
    max_leaves=12,
)


@FAST
@given(trees)
def test_nested_structures_roundtrip(obj):
    assert_same(roundtrip(obj), obj)


# ---- a sample file and tools to take it apart --------------------------------------------------


def sample_file() -> bytes:
    base = torch.arange(64, dtype=torch.float32)
    obj = {
        "model": collections.OrderedDict(w=base.view(8, 8), b=base[:8], h=torch.ones(3, dtype=torch.bfloat16)),
        "optim": {
            "state": {0: {"exp_avg": torch.zeros(8), "step": torch.tensor(2.0)}},
            "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "params": [0]}],
        },
        "np": np.arange(6, dtype=np.int16).reshape(2, 3),
        "misc": [1, 2.5, "x", b"y", None, {1, 2}, 1 << 80, 1j],
    }
    buf = io.BytesIO()
    fp.save(obj, buf)
    return buf.getvalue()


SAMPLE = sample_file()


def load_bytes(data: bytes, **kw):
    return fp.load(io.BytesIO(data), **kw)


def test_seal_reproduces_a_real_file():
    assert seal(*split(SAMPLE)) == SAMPLE


# ---- code execution ----------------------------------------------------------------------------


class Evil:
    marker: pathlib.Path

    def __reduce__(self):
        return pathlib.Path.touch, (self.marker,)


def test_pickle_payloads_never_run_without_allow_pickle(tmp_path):
    marker = tmp_path / "pwned"
    Evil.marker = marker
    buf = io.BytesIO()
    fp.save({"x": Evil(), "t": torch.ones(2)}, buf, allow_pickle=True)
    data = buf.getvalue()
    with pytest.raises(FormatError, match="allow_pickle"):
        load_bytes(data)
    with pytest.raises(FormatError, match="allow_pickle"):
        load_bytes(data, keys=["t"])
    fp.inspect(io.BytesIO(data))
    assert not marker.exists()

    # a file that hides the pickle: flag cleared, checksums made consistent again
    flags, payload, meta = split(data)
    hidden = seal(flags & ~fp.FLAG_PICKLE, payload, meta)
    with pytest.raises(FormatError):
        load_bytes(hidden)
    assert not marker.exists()

    # plain pickle and torch.save files are not fastpickle files
    with pytest.raises(FormatError):
        load_bytes(pickle.dumps({"x": Evil()}))
    tbuf = io.BytesIO()
    torch.save({"x": torch.ones(2)}, tbuf)
    with pytest.raises(FormatError):
        load_bytes(tbuf.getvalue())
    assert not marker.exists()

    load_bytes(data, allow_pickle=True)  # the opt-in does run it
    assert marker.exists()


# ---- integrity ----------------------------------------------------------------------------------


def test_corrupt_payload_names_tensor_and_byte_range():
    info = fp.inspect(io.BytesIO(SAMPLE))
    w = next(t for t in info.tensors if t.path == "model.w")
    data = bytearray(SAMPLE)
    data[w.offset + 17] ^= 1
    with pytest.raises(
        IntegrityError,
        match=rf"'model\.w' \(and 1 more sharing its storage\), bytes \[{w.offset}, "
        rf"{w.offset + w.nbytes}\)",
    ):
        load_bytes(bytes(data))
    out = load_bytes(bytes(data), verify=False)  # skippable
    assert not torch.equal(out["model"]["w"], torch.arange(64.0).view(8, 8))
    assert load_bytes(bytes(data), keys=["np"])["np"].shape == (2, 3)  # other payloads unaffected


def test_truncation_and_trailing_bytes_are_detected():
    for data in (SAMPLE[:-1], SAMPLE[:100], SAMPLE[:64], SAMPLE + b"\0", SAMPLE + SAMPLE[-64:], b"", b"x" * 200):
        with pytest.raises(FormatError):
            load_bytes(data)


def test_lying_footer_is_rejected_before_reading():
    flags, payload, meta = split(SAMPLE)
    for lie in ({"meta_len": 1 << 60}, {"meta_off": 1 << 62}, {"size": len(SAMPLE) + 1}, {"meta_off": 3}):
        with pytest.raises(IntegrityError):
            load_bytes(seal(flags, payload, meta, footer_lie=lie))


def lie_in_table(field_path, value) -> bytes:
    flags, payload, meta_bytes = split(SAMPLE)
    meta = msgpack.unpackb(meta_bytes, strict_map_key=False)
    node = meta
    for p in field_path[:-1]:
        node = node[p]
    node[field_path[-1]] = value
    return seal(flags, payload, msgpack.packb(meta, use_bin_type=True))


@pytest.mark.parametrize(
    "field_path,value",
    [
        (("storages", 0, 1), 1 << 40),  # nbytes beyond the file
        (("storages", 0, 0), 1 << 50),  # offset beyond the file
        (("storages", 1, 0), 64),  # overlaps storage 0
        (("storages", 0, 0), 65),  # misaligned
        (("storages", 0, 1), -1),
        (("tensors", 0, 3), [1 << 30, 1 << 30]),  # shape far beyond its storage
        (("tensors", 0, 4), [1 << 40, 1]),  # stride beyond its storage
        (("tensors", 0, 5), 1 << 33),  # storage offset
        (("tensors", 0, 3), [1] * 100),  # absurd rank
        (("tensors", 0, 2), "object"),  # not a dtype
        (("tensors", 0, 1), 999),  # storage index
        (("tensors", 0, 6), 99),  # unknown flags
        (("tensors", 0), [0, 0, "int64", [2], [1], 0, 1, "x", None]),  # requires_grad on integers
        (("checksum",), "crc32"),
        (("tree",), "not bytes"),
    ],
)
def test_lying_tables_are_rejected_before_allocation(field_path, value):
    data = lie_in_table(field_path, value)
    with pytest.raises(FormatError):
        read_meta(fpk_read.FileSource(io.BytesIO(data)))  # rejected by validation, before any tensor exists
    with pytest.raises(FormatError):
        load_bytes(data)


def test_lying_tree_references():
    flags, payload, meta_bytes = split(SAMPLE)
    meta = msgpack.unpackb(meta_bytes, strict_map_key=False)
    for tree in (
        msgpack.ExtType(fp.EXT_TENSOR, msgpack.packb(10**6)),
        msgpack.ExtType(99, b""),
        msgpack.ExtType(fp.EXT_TENSOR, (10**6).to_bytes(4, "little")),
        msgpack.ExtType(fp.EXT_GDICT, msgpack.packb([[1], 2])),
        msgpack.ExtType(fp.EXT_COMPLEX, b"short"),
        msgpack.ExtType(fp.EXT_NPSCALAR, msgpack.packb(["|O", b"12345678"])),
        msgpack.ExtType(fp.EXT_DTYPE, b"__import__"),
        msgpack.ExtType(fp.EXT_DEVICE, b"nonsense:x"),
        msgpack.ExtType(fp.EXT_SIZE, msgpack.packb([-1])),
    ):
        meta["tree"] = msgpack.packb(tree)
        with pytest.raises(FormatError):
            load_bytes(seal(flags, payload, msgpack.packb(meta, use_bin_type=True)))


# ---- fuzzing ------------------------------------------------------------------------------------


@FUZZ
@given(st.lists(st.tuples(st.integers(0, len(SAMPLE) - 1), st.integers(1, 255)), min_size=1, max_size=8), st.booleans())
def test_fuzz_byte_flips(loader, flips, verify):
    data = bytearray(SAMPLE)
    for pos, x in flips:
        data[pos] ^= x
    loader.check(bytes(data), verify=verify)


@FUZZ
@given(st.integers(0, len(SAMPLE) - 1), st.binary(max_size=80))
def test_fuzz_truncate_and_append(loader, cut, tail):
    assert loader.check(SAMPLE[:cut] + tail, ("load",)) == "format"


@FUZZ
@given(st.data())
def test_fuzz_resealed_metadata(loader, data):
    """Mutations that keep every checksum valid: only the parser and validation stand in the way."""
    flags, payload, meta = split(SAMPLE)
    meta = bytearray(meta)
    for _ in range(data.draw(st.integers(1, 6))):
        op = data.draw(st.sampled_from(["flip", "insert", "delete"]))
        pos = data.draw(st.integers(0, len(meta) - 1))
        if op == "flip":
            meta[pos] ^= data.draw(st.integers(1, 255))
        elif op == "insert":
            meta[pos:pos] = data.draw(st.binary(min_size=1, max_size=9))
        elif len(meta) > 1:
            del meta[pos : pos + data.draw(st.integers(1, 9))]
    assume(len(meta) > 0)
    sealed = seal(flags | data.draw(st.sampled_from([0, fp.FLAG_PICKLE])), payload, bytes(meta))
    loader.check(sealed, verify=data.draw(st.booleans()))
    loader.check(sealed, keys=[data.draw(st.sampled_from(["model.w", "optim.state.0", "misc.3", "np"]))])


@FUZZ
@given(
    st.recursive(
        st.none() | st.integers(-(2**63), 2**64 - 1) | st.text(max_size=4) | st.binary(max_size=6) | st.floats(),
        lambda kids: (
            st.lists(kids, max_size=4)
            | st.dictionaries(st.text(max_size=3), kids, max_size=3)
            | st.builds(msgpack.ExtType, st.integers(0, 20), st.binary(max_size=12))
        ),
        max_leaves=10,
    )
)
def test_fuzz_arbitrary_trees(loader, tree):
    flags, payload, meta_bytes = split(SAMPLE)
    meta = msgpack.unpackb(meta_bytes, strict_map_key=False)
    meta["tree"] = msgpack.packb(tree, use_bin_type=True)
    loader.check(seal(flags, payload, msgpack.packb(meta, use_bin_type=True)))

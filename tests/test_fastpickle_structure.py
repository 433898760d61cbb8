"""fastpickle against crafted structure: nesting depth, dtype/itemsize/shape tables, offsets in the index.

Byte-flip fuzzing (test_fastpickle_hypothesis.py) rarely builds a deep tree or a consistent table
that lies; these tests build them on purpose. Every crafted file is loaded, inspected and shown by
``ckptio info``/``verify`` in a child process (fpk_crafting.LoaderProcess), so a segfault, a hang or
an allocation far beyond the file fails the test instead of ending the run.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys

import msgpack
import pytest
import torch
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptio import fastpickle as fp
from ckptio.formats.fastpickle import layout as fpk_layout
from fpk_crafting import KINDS, craft, fix_kinds, nested_tree, nested_value, tensor_ref

DEPTH = fp.MAX_DEPTH
FUZZ = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
ALL_OPS = ("load", "inspect", "info", "verify")


def saved(obj) -> bytes:
    buf = io.BytesIO()
    fp.save(obj, buf)
    return buf.getvalue()


# ---- nesting depth ------------------------------------------------------------------------------


def test_issue_deep_tuples_do_not_crash(loader):
    """The report: 300 nested tuples saved, then load, info and verify killed the interpreter."""
    kinds = ["tuple"] * 300 + ["dict"]
    assert loader.check(craft(nested_tree(kinds)), ALL_OPS) == "format"
    outcome, msg = loader.run("load", craft(nested_tree(kinds)))
    assert f"nested more than {DEPTH} deep" in msg


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_container_kind_at_and_beyond_the_bound(loader, tmp_path, kind):
    def chain(depth: int) -> list[str]:  # a set or a dict key holds hashable values only: tuples below it
        return ["tuple"] * (depth - 1) + [kind] if kind in ("set", "gdict_key") else [kind] * depth

    kinds = chain(DEPTH)
    obj = nested_value(kinds)
    data = saved(obj)
    assert data == craft(nested_tree(kinds))  # what the crafting writes is what the writer writes
    assert loader.check(data, ALL_OPS, return_value=True) == "ok"
    assert loader.run("load", data, return_value=True)[1]["value"] == obj
    if kind == "dict":  # a partial load walks the subtree it returns
        assert loader.check(data, ("load",), keys=["k.k.k"], return_value=True) == "ok"

    deeper = nested_value(chain(DEPTH + 1))
    path = tmp_path / "deep.fpk"
    with pytest.raises(ValueError, match=rf"more than {DEPTH} deep \(at '.*\(\d+ more\).*'\)"):
        fp.save(deeper, str(path))
    assert not path.exists()  # nothing written, not even a temporary file
    assert os.listdir(tmp_path) == []
    assert loader.check(craft(nested_tree(chain(DEPTH + 1))), ALL_OPS) == "format"


def test_depth_counts_keys_tensors_and_the_root():
    """The bound is on containers: a tensor or torch.Size at the bottom adds nothing, a tuple key adds one."""
    leafy = nested_value(["list"] * (DEPTH - 1), torch.Size([2, 3]))
    assert fp.load(io.BytesIO(saved({"t": torch.ones(2), "x": leafy})))["x"] == leafy  # dict + DEPTH-1 lists
    key = nested_value(["tuple"] * (DEPTH - 1))
    assert fp.load(io.BytesIO(saved({key: 1}))) == {key: 1}
    with pytest.raises(ValueError, match="<key"):
        saved({(key,): 1})


@pytest.mark.parametrize(
    "kinds",
    [
        ["list"] * 1025,
        ["list"] * 5000,
        ["dict"] * 3000,
        ["tuple"] * 2000,
        ["set", "list"] * 600,
        ["gdict_key", "frozenset"] * 400,
    ],
    ids=["list-1025", "list-5000", "dict-3000", "tuple-2000", "set+list", "key+frozenset"],
)
def test_far_too_deep_is_a_clear_format_error(loader, kinds):
    data = craft(nested_tree(fix_kinds(kinds)))
    assert loader.check(data, ALL_OPS) == "format"
    _, msg = loader.run("load", data)
    assert "nested more than" in msg  # msgpack's own limit (1024 natively) or the bound, never an empty reason


def _ext(code: int, value=None, raw: bytes | None = None) -> msgpack.ExtType:
    return msgpack.ExtType(code, msgpack.packb(value) if raw is None else raw)


@pytest.mark.parametrize(
    "tree,why",
    [
        ({_ext(fp.EXT_TUPLE, [[1]]): 1}, "map key"),  # a placeholder would be left in the tree
        (_ext(fp.EXT_TUPLE, 5), "does not hold a list"),
        ([_ext(fp.EXT_TUPLE, [_ext(fp.EXT_SET, 5)])], "does not hold a list"),  # found by the loop, not the hook
        (_ext(fp.EXT_GDICT, [1]), "odd number"),
        (_ext(fp.EXT_SET, [[1]]), "unhashable"),
        (_ext(fp.EXT_TUPLE, raw=b"\xc1"), "invalid msgpack"),
        (_ext(fp.EXT_TUPLE, raw=b"\x92\x01"), "incomplete"),
        (_ext(fp.EXT_TUPLE, raw=b"\x91" * 2000 + b"\xc0"), "nested more than msgpack"),
        (msgpack.ExtType(0x7F, b""), "unknown extension"),
        (msgpack.ExtType(fp.EXT_NPDTYPE, b","), "invalid numpy dtype"),  # numpy's parser raised SyntaxError
        (msgpack.ExtType(fp.EXT_NPDTYPE, b"i4,i4"), "invalid numpy dtype"),  # structured: never written
        (msgpack.ExtType(fp.EXT_NPDTYPE, b"(2,)i4"), "invalid numpy dtype"),  # subarray
        (_ext(fp.EXT_NPSCALAR, [",", b"\0"]), "invalid numpy dtype"),
    ],
)
def test_malformed_trees_say_what_is_wrong(loader, tree, why):
    data = craft(msgpack.packb(tree))
    assert loader.check(data, ALL_OPS) == "format"
    _, msg = loader.run("load", data)
    assert msg.startswith(f"{loader.path}: malformed tree: ") and why in msg


def test_a_tuple_of_scalars_counts_as_one_level():
    """Extensions that hold no containers are built at once; they still count against the bound."""
    ok = craft(nested_tree(["tuple"] + ["list"] * (DEPTH - 1)))
    assert fp.load(io.BytesIO(ok)) == nested_value(["tuple"] + ["list"] * (DEPTH - 1))
    with pytest.raises(fp.FormatError, match=f"nested more than {DEPTH}"):
        fp.load(io.BytesIO(craft(nested_tree(["tuple"] + ["list"] * DEPTH))))


@FUZZ
@given(st.lists(st.sampled_from(sorted(KINDS)), min_size=DEPTH - 2, max_size=DEPTH + 2), st.booleans())
def test_fuzz_mixed_nesting_around_the_bound(loader, kinds, tensor_leaf):
    kinds = fix_kinds(kinds)
    leaf = tensor_ref(0) if tensor_leaf else b"\xc0"
    payload = bytes(range(8))
    tables = (
        ([[64, 8, xxhash.xxh3_64_intdigest(payload), "cpu"]], [[0, 0, "float32", [2], [1], 0, 0, "x", None]], payload)
        if tensor_leaf
        else ()
    )
    data = craft(nested_tree(kinds, leaf), *tables)
    outcome = loader.check(data, ALL_OPS, return_value=True)
    assert outcome == ("ok" if len(kinds) <= DEPTH else "format")
    if outcome == "ok" and not tensor_leaf:
        assert loader.run("load", data, return_value=True)[1]["value"] == nested_value(kinds)


# ---- dtype, itemsize, shape --------------------------------------------------------------------

NP_DTYPES = [
    "S0",
    "U0",
    "S",
    "U",
    "a",
    "V0",
    "V8",
    "O",
    "|O",
    "S5",
    "U3",
    ">U2",
    "<f8",
    ">f8",
    "=i4",
    "|b1",
    "?",
    "M8",
    "m8[s]",
    "<M8[ns]",
    "c16",
    "f2",
    "u8",
    "i1",
    "float64",
    "(2,)f4",
    "f4,i4",
    "S2147483647",
    "U999999999",
    "[('a', 'f4')]",
    "int",
    "x" * 40,
    "d" * 3,
]
TORCH_DTYPES = sorted(fpk_layout.DTYPES)
DIMS = [
    0,
    1,
    2,
    3,
    7,
    8,
    64,
    1000,
    1 << 20,
    1 << 31,
    1 << 32,
    (1 << 62) + 1,
    (1 << 63) - 1,
    1 << 63,
    (1 << 64) - 1,
    -1,
    -(1 << 63),
]
QEXTRA = [
    None,
    ["per_tensor_affine", 0.1, 0],
    ["per_tensor_affine", 0.0, (1 << 64) - 1],
    ["per_tensor_affine", float("nan"), 0],
    ["per_channel_affine", [0.1, 0.2], [0, 0], 0],
    ["per_channel_affine", [0.1], [0], 5],
    ["bogus"],
]


@st.composite
def tensor_entries(draw):
    kind = draw(st.sampled_from([fp.KIND_TORCH, fp.KIND_NUMPY, fp.KIND_QUANT]))
    dtype = draw(st.sampled_from(NP_DTYPES if kind == fp.KIND_NUMPY else TORCH_DTYPES))
    dims = st.lists(st.sampled_from(DIMS), max_size=5) | st.sampled_from([[1] * 65, [2] * 64, [0] + [1 << 62] * 3])
    shape = draw(dims)
    stride = draw(st.just([]) | dims | st.just([1] * len(shape)) | st.just([0] * len(shape)))
    soff = draw(st.sampled_from([0, 0, 1, 7, 1 << 40, -1]))
    flags = draw(st.sampled_from([0, 0, 1, 2, 3, 4]))
    extra = draw(st.sampled_from(QEXTRA)) if kind == fp.KIND_QUANT else None
    return [kind, 0, dtype, shape, stride, soff, flags, "model.weight", extra]


@FUZZ
@given(tensor_entries(), st.sampled_from([0, 1, 2, 8, 64, 4096]), st.booleans())
def test_fuzz_dtype_itemsize_shape_tables(loader, entry, nbytes, mmap):
    payload = bytes(range(256)) * (nbytes // 256) + bytes(range(nbytes % 256))
    pad = b"" if nbytes % 64 == 0 else bytes(64 - nbytes % 64)
    data = craft(tensor_ref(0), [[64, nbytes, xxhash.xxh3_64_intdigest(payload), "cpu"]], [entry], payload + pad)
    loader.check(data, ALL_OPS, mmap=mmap)


def zero_itemsize_file(dtype: str, shape=(1000, 1000, 1000)) -> bytes:
    return craft(
        msgpack.packb({"x": msgpack.ExtType(fp.EXT_TENSOR, bytes(4))}),
        [[64, 0, xxhash.xxh3_64_intdigest(b""), "cpu"]],
        [[1, 0, dtype, list(shape), [], 0, 0, "x", None]],
    )


@pytest.mark.parametrize("dtype", ["S0", "U0", "|S0", ">U0", "S", "U"])
def test_issue_zero_itemsize_arrays_are_refused(loader, dtype):
    """The report: a 425-byte file with an S0/U0 array of 1000**3 items allocated 1 GB on load."""
    data = zero_itemsize_file(dtype)
    assert len(data) < 512
    assert loader.check(data, ALL_OPS) == "format"
    _, msg = loader.run("load", data)
    assert "'x'" in msg and "0 bytes per item" in msg


def test_issue_zero_itemsize_with_many_dims_is_refused(loader):
    """The 4 KB variant: 64 dimensions whose product asks numpy for hundreds of GiB."""
    data = zero_itemsize_file("U0", [7] * 14)
    assert loader.check(data, ALL_OPS) == "format"


@pytest.mark.parametrize(
    "entry,why",
    [
        ([1, 0, "<f8", [0] + [1 << 40] * 3, [], 0, 0, "x", None], "larger than any array"),
        ([0, 0, "float32", [1 << 40] * 3, [0] * 3, 0, 0, "x", None], "more elements than any tensor"),
        ([0, 0, "quint4x2", [2], [1], 0, 0, "x", None], "unknown dtype"),
        ([2, 0, "qint8", [1000, 1000], [0, 0], 0, 0, "x", ["per_tensor_affine", 0.1, 0]], "larger than its"),
        ([2, 0, "qint8", [2], [1], 0, 0, "x", ["per_tensor_affine", 0.1, 1 << 63]], "quantization"),
    ],
)
def test_tables_that_would_allocate_or_misbehave_are_refused(loader, entry, why):
    payload = bytes(8)
    data = craft(tensor_ref(0), [[64, 8, xxhash.xxh3_64_intdigest(payload), "cpu"]], [entry], payload + bytes(56))
    assert loader.check(data, ALL_OPS) == "format"
    _, msg = loader.run("load", data)
    assert "'x'" in msg and why in msg


@pytest.mark.parametrize(
    "storage,entry",
    [
        ([64, 8, True, "cpu"], None),  # a bool where an integer belongs
        ([64, 8, -1, "cpu"], None),  # a checksum outside u64
        ([64, 8.0, 0, "cpu"], None),
        ([True, 8, 0, "cpu"], None),
        ([64, -8, 0, "cpu"], None),
        (None, [0, 0, "float32", [True, 2], [2, 1], 0, 0, "x", None]),
        (None, [0, 0, "float32", [2, 1.0], [1, 1], 0, 0, "x", None]),
        (None, [0, 0, "float32", [2], [-1], 0, 0, "x", None]),
        (None, [0, 0, "float32", [2], ["1"], 0, 0, "x", None]),
        (None, [0, 0, "float32", [2], [1 << 63], 0, 0, "x", None]),
        (None, [0, False, "float32", [2], [1], 0, 0, "x", None]),
        (None, [0, 0, "float32", [2], [1], 0, True, "x", None]),
    ],
)
def test_tables_with_wrong_field_types_are_refused(loader, storage, entry):
    """Each field is checked for its exact type and range (a bool is not an int, a float is not a size)."""
    payload = bytes(8)
    storage = storage or [64, 8, xxhash.xxh3_64_intdigest(payload), "cpu"]
    entry = entry or [0, 0, "float32", [2], [1], 0, 0, "x", None]
    data = craft(tensor_ref(0), [storage], [entry], payload + bytes(56))
    assert loader.check(data, ALL_OPS) == "format"
    _, msg = loader.run("load", data)
    assert "malformed metadata" in msg


def test_expanded_views_still_load():
    """A tensor saved as a broadcast view (stride 0) keeps its shape without materializing it."""
    t = torch.arange(3.0).view(3, 1).expand(3, 1 << 20)
    out = fp.load(io.BytesIO(saved({"t": t})))["t"]
    assert out.shape == t.shape and out.stride() == t.stride() and out.untyped_storage().nbytes() == 12


# ---- offsets and lengths in the index ----------------------------------------------------------

OFFSETS = [0, 63, 64, 65, 128, 192, 1 << 32, (1 << 63) - 1, 1 << 63, (1 << 64) - 1, -1, -(1 << 63)]
LENGTHS = [0, 1, 8, 63, 64, 65, 128, 129, 1 << 31, (1 << 63) - 1, (1 << 64) - 1, -1]


@FUZZ
@given(
    st.lists(
        st.tuples(
            st.sampled_from(OFFSETS),
            st.sampled_from(LENGTHS),
            st.booleans(),
            st.sampled_from(["cpu", "cpu", "cuda:0", "meta", "nonsense", "cpu" * 30]),
        ),
        min_size=1,
        max_size=3,
    ),
    st.sampled_from([{}, {"meta_off": 3}, {"meta_len": 1 << 40}, {"meta_off": 1 << 63}, {"size": 1 << 62}]),
    st.sampled_from([{}, {"keys": ["a"]}, {"mmap": True}, {"verify": False}, {"map_location": "cpu"}]),
)
def test_fuzz_storage_offsets_and_lengths(loader, storages, footer_lie, kw):
    payload = bytes(range(128)) * 2
    table = [
        [off, n, xxhash.xxh3_64_intdigest(payload[max(0, off - 64) : max(0, off - 64 + n)]) if good else 1, loc]
        for off, n, good, loc in storages
    ]
    tensors = [
        [0, i, "uint8", [max(0, n)] if 0 <= n < 1 << 20 else [1], [1], 0, 0, f"t{i}", None]
        for i, (_, n, _, _) in enumerate(storages)
    ]
    tree = msgpack.packb({"a": [msgpack.ExtType(fp.EXT_TENSOR, i.to_bytes(4, "little")) for i in range(len(tensors))]})
    loader.check(craft(tree, table, tensors, payload, **footer_lie), ALL_OPS, **kw)


# ---- the CLI, as users run it -------------------------------------------------------------------


@pytest.mark.parametrize(
    "data", [craft(nested_tree(["tuple"] * 300 + ["dict"])), zero_itemsize_file("U0")], ids=["deep-tuples", "U0-array"]
)
@pytest.mark.parametrize("command", ["info", "verify"])
def test_cli_on_crafted_files(tmp_path, data, command):
    path = tmp_path / "crafted.fpk"
    path.write_bytes(data)
    r = subprocess.run(
        [sys.executable, "-m", "ckptio.cli", command, str(path)], capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 1, (r.returncode, r.stderr[-2000:])  # an error, not a signal (negative)
    assert f"error: {path}: malformed" in r.stderr

"""fastpickle: exact round-trips, sharing, errors, partial and mapped loads, every backend."""

from __future__ import annotations

import collections
import io
import os
import struct

import numpy as np
import pytest
import torch

import ckptio
from ckptio import fastpickle as fp
from ckptio.errors import AlreadyExistsError, FormatError, IntegrityError
from ckptio.formats.fastpickle import layout as fpk_layout
from ckptio.formats.fastpickle import read as fpread
from ckptio.formats.fastpickle import write as fpk_write

# ---- comparing values exactly ------------------------------------------------------------------


def storage_bytes(t: torch.Tensor) -> bytes:
    return bytes(torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage()).numpy())


def assert_same(a, b, path="<root>"):
    assert type(a) is type(b), f"{path}: {type(a)} != {type(b)}"
    if isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape, a.requires_grad) == (b.dtype, b.shape, b.requires_grad), path
        if a.is_quantized:
            assert a.qscheme() == b.qscheme(), path
            assert torch.equal(a.int_repr(), b.int_repr()), path
            if a.qscheme() == torch.per_tensor_affine:
                assert (a.q_scale(), a.q_zero_point()) == (b.q_scale(), b.q_zero_point()), path
            else:
                assert torch.equal(a.q_per_channel_scales(), b.q_per_channel_scales()), path
            return
        assert (a.stride(), a.storage_offset()) == (b.stride(), b.storage_offset()), path
        assert storage_bytes(a) == storage_bytes(b), path
    elif isinstance(a, np.ndarray):
        assert (a.dtype, a.shape) == (b.dtype, b.shape) and a.tobytes() == b.tobytes(), path
    elif isinstance(a, np.generic):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), path
    elif isinstance(a, float):
        assert struct.pack("<d", a) == struct.pack("<d", b), path
    elif isinstance(a, complex):
        assert struct.pack("<dd", a.real, a.imag) == struct.pack("<dd", b.real, b.imag), path
    elif isinstance(a, dict):
        assert list(a.keys()) == list(b.keys()), path
        for k in a:
            assert type(k) is type(next(kk for kk in b if kk == k))
            assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}.{i}")
    else:
        assert a == b, path


def roundtrip(obj, **load_kw):
    buf = io.BytesIO()
    fp.save(obj, buf)
    buf.seek(0)
    return fp.load(buf, **load_kw)


def train_state():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    for _ in range(3):
        model(torch.randn(5, 8)).pow(2).mean().backward()
        opt.step()
        sched.step()
    return {
        "model": model.state_dict(),
        "optim": opt.state_dict(),
        "sched": sched.state_dict(),
        "step": 3,
        "rng": torch.get_rng_state(),
        "np_rng": np.random.RandomState(0).get_state()[1],
    }


# ---- round-trips -------------------------------------------------------------------------------

PLAIN = {
    "none": None,
    "true": True,
    "false": False,
    "int": -7,
    "u64": (1 << 64) - 1,
    "i64": -(1 << 63),
    "big": 1 << 200,
    "negbig": -(1 << 90) + 3,
    "float": 0.1,
    "nan": float("nan"),
    "inf": float("-inf"),
    "negzero": -0.0,
    "str": "héllo",
    "empty": "",
    "bytes": b"\x00\xff",
    "complex": complex(1.5, float("nan")),
    "list": [1, [2, [3]]],
    "tuple": (1, (2,), ()),
    "set": {1, "a", (2, 3)},
    "frozenset": frozenset({b"x"}),
    "odict": collections.OrderedDict([("z", 1), ("a", 2)]),
    "intkeys": {10: "a", -1: "b", 3: "c"},
    "mixedkeys": {"a": 1, 2: 2, b"c": 3},
    "tuplekeys": {(1, 2): "t", None: "n", 1.5: "f", True: "b"},
    "size": torch.Size([2, 0, 3]),
    "dtype": torch.float8_e4m3fn,
    "device": torch.device("cuda", 1),
    "np_scalars": [np.float32(1.25), np.int8(-3), np.bool_(True), np.complex128(1j), np.uint64(2**64 - 1)],
    "np_dtype": np.dtype("<f2"),
}


@pytest.mark.parametrize("key", sorted(PLAIN))
def test_plain_values_roundtrip_exactly(key):
    assert_same(roundtrip({key: PLAIN[key]}), {key: PLAIN[key]})


def test_top_level_non_dict_values():
    for obj in (None, 3, [1, 2], (torch.ones(2),), "s"):
        assert_same(roundtrip(obj), obj)


QUANTIZED = {torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4}
ALL_DTYPES = sorted({d for d in fpk_layout.DTYPES.values() if d not in QUANTIZED}, key=str)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_every_dtype_roundtrips_bitwise(dtype):
    raw = torch.randint(0, 256, (6 * 5 * dtype.itemsize,), dtype=torch.uint8)
    t = raw.view(dtype).view(6, 5) if dtype.itemsize > 1 else raw.view(dtype).view(6, 5 * dtype.itemsize)
    obj = {"t": t, "col": t[:, 1], "zero_d": t[2, 3], "empty": torch.empty(0, 3, dtype=dtype)}
    assert_same(roundtrip(obj), obj)


@pytest.mark.parametrize("qdtype", [torch.qint8, torch.quint8, torch.qint32])
def test_quantized_tensors(qdtype):
    x = torch.randn(4, 6)
    obj = {
        "pt": torch.quantize_per_tensor(x, 0.05, 3, qdtype),
        "pc": torch.quantize_per_channel(x, torch.rand(6) + 0.1, torch.zeros(6, dtype=torch.long), 1, qdtype),
    }
    assert_same(roundtrip(obj), obj)


def test_packed_quantized_dtypes_fail_clearly():
    q = torch.quantize_per_tensor(torch.rand(4), 0.1, 0, torch.quint4x2)
    with pytest.raises(TypeError, match=r"quint4x2.*'w'"):
        fp.save({"w": q}, io.BytesIO())


def test_tensor_layouts_and_flags():
    base = torch.randn(6, 8)
    obj = {
        "t": base.t(),
        "slice": base[1:4, ::3],
        "expand": torch.randn(3, 1).expand(3, 5),
        "zero_d": torch.tensor(2.5),
        "empty": torch.empty(0),
        "chlast": torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last),
        "rg": torch.randn(3, requires_grad=True),
        "param": torch.nn.Parameter(torch.randn(2)),
        "frozen": torch.nn.Parameter(torch.randn(2), requires_grad=False),
        "conj": torch.randn(3, dtype=torch.complex64).conj(),
        "nonleaf": torch.randn(2, requires_grad=True) * 2,
    }
    out = roundtrip(obj)
    for k in ("t", "slice", "expand", "zero_d", "empty", "chlast", "rg", "param", "frozen"):
        assert_same(out[k], obj[k], k)
    assert torch.equal(out["conj"], obj["conj"]) and not out["conj"].is_conj()
    assert out["nonleaf"].requires_grad and out["nonleaf"].is_leaf
    assert torch.equal(out["nonleaf"], obj["nonleaf"].detach())


def test_numpy_arrays():
    obj = {
        "f": np.arange(12, dtype=np.float32).reshape(3, 4),
        "fortran": np.asfortranarray(np.ones((2, 3))),
        "strided": np.arange(20)[::3],
        "be": np.arange(4, dtype=">i4"),
        "s": np.array([b"ab", b"c"]),
        "u": np.array(["xyz"]),
        "zero_d": np.array(1.5),
        "empty": np.empty((0, 4), dtype=np.int16),
        "bool": np.array([True, False]),
        "dt64": np.array(["2024-01-01"], dtype="datetime64[ns]"),
    }
    out = roundtrip(obj)
    for k, v in obj.items():
        assert_same(out[k], np.array(v, order="C"), k)


def test_training_state_roundtrips(tmp_path):
    state = train_state()
    fp.save(state, tmp_path / "s.fpk")
    out = fp.load(tmp_path / "s.fpk")
    assert_same(out, state)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    model.load_state_dict(out["model"])
    opt = torch.optim.AdamW(model.parameters())
    opt.load_state_dict(out["optim"])


def test_shared_storage_restored_shared():
    base = torch.randn(4, 4)
    lin = torch.nn.Linear(4, 4)
    obj = {
        "a": base,
        "view": base[1],
        "same": base,
        "bytes": base.view(torch.int32),
        "emb": lin.weight,
        "head": lin.weight,
        "np": np.zeros(3),
    }
    obj["np2"] = obj["np"]
    buf = io.BytesIO()
    fp.save(obj, buf)
    info = fp.inspect(io.BytesIO(buf.getvalue()))
    assert len({t.storage for t in info.tensors}) == 3  # base, lin.weight, the array
    out = fp.load(io.BytesIO(buf.getvalue()))
    assert out["a"] is out["same"] and out["emb"] is out["head"] and out["np"] is out["np2"]
    assert out["view"].untyped_storage().data_ptr() == out["a"].untyped_storage().data_ptr()
    assert out["bytes"].untyped_storage().data_ptr() == out["a"].untyped_storage().data_ptr()
    out["a"][1, 0] = 42.0
    assert out["view"][0] == 42.0
    assert buf.getvalue().count(storage_bytes(base)) == 1


def test_unsupported_type_names_key_path():
    class Foo:
        pass

    with pytest.raises(TypeError, match=r"optim\.state\.3\.exp_avg"):
        fp.save({"optim": {"state": {3: {"exp_avg": Foo()}}}}, io.BytesIO())
    with pytest.raises(TypeError, match=r"'a\.1'"):
        fp.save({"a": (1, torch.randn(2).to_sparse())}, io.BytesIO())
    with pytest.raises(TypeError):
        fp.save({"x": 3 == 3 and collections.Counter()}, io.BytesIO())
    cyc: list = []
    cyc.append(cyc)
    with pytest.raises(ValueError, match="cycle"):
        fp.save(cyc, io.BytesIO())


def test_nothing_is_written_when_a_type_is_unsupported(tmp_path):
    with pytest.raises(TypeError):
        fp.save({"x": object()}, tmp_path / "x.fpk")
    assert os.listdir(tmp_path) == []


def test_pickle_fallback_is_opt_in_on_both_sides():
    obj = {"counter": collections.Counter("aab"), "t": torch.ones(2)}
    buf = io.BytesIO()
    fp.save(obj, buf, allow_pickle=True)
    data = buf.getvalue()
    assert fp.inspect(io.BytesIO(data)).has_pickle
    assert isinstance(fp.inspect(io.BytesIO(data)).tree["counter"], fp.PickledObject)
    with pytest.raises(FormatError, match="allow_pickle"):
        fp.load(io.BytesIO(data))
    assert_same(fp.load(io.BytesIO(data), allow_pickle=True), obj)


# ---- files, URIs, backends ---------------------------------------------------------------------


def test_registered_extension_through_ckptio_dump_load(memory_uri, tmp_path):
    state = train_state()
    for uri in (f"{memory_uri}/a/step1.fpk", str(tmp_path / "step1.fpk")):
        ckptio.dump(state, uri)
        assert_same(ckptio.load(uri), state)


def test_write_modes_and_durability(tmp_path):
    p = str(tmp_path / "c.fpk")
    fp.save({"a": 1}, p, mode="create", durable=False)
    with pytest.raises(AlreadyExistsError):
        fp.save({"a": 2}, p, mode="create")
    fp.save({"a": 3}, p)
    assert fp.load(p) == {"a": 3}
    assert sorted(os.listdir(tmp_path)) == ["c.fpk"]


def test_real_file_objects(tmp_path):
    obj = {"w": torch.randn(100, 10), "n": 1}
    with open(tmp_path / "f.fpk", "wb") as f:
        fp.save(obj, f)
    with open(tmp_path / "f.fpk", "rb") as f:
        assert_same(fp.load(f), obj)
        assert_same(fp.load(f, mmap=True)["w"], obj["w"])


@pytest.mark.parametrize("backend", ["local", "memory", "s3", "gcs"])
def test_same_file_loads_identically_everywhere(backend, request, tmp_path):
    root = request.getfixturevalue(f"{backend}_uri")
    state = train_state()
    state["big"] = torch.randn(300_000)  # several parts/requests on object stores
    fp.save(state, tmp_path / "ref.fpk")
    data = (tmp_path / "ref.fpk").read_bytes()
    be, uri = ckptio.resolve(f"{root}/copy.fpk")
    be.write(uri, data)
    assert_same(fp.load(f"{root}/copy.fpk"), state)
    assert_same(fp.load(f"{root}/copy.fpk", keys=["optim.state.0"])["optim.state.0"], state["optim"]["state"][0])
    fp.save(state, f"{root}/direct.fpk")
    assert be.read(ckptio.resolve(f"{root}/direct.fpk")[1]) == data  # deterministic bytes


def test_map_location(tmp_path):
    p = tmp_path / "m.fpk"
    fp.save({"w": torch.randn(3), "i": torch.arange(3)}, p)
    for ml in ("cpu", torch.device("cpu"), {"cpu": "cpu"}, lambda storage, loc: storage):
        out = fp.load(p, map_location=ml)
        assert out["w"].device.type == "cpu"
    seen = []
    fp.load(p, map_location=lambda storage, loc: seen.append(loc))
    assert seen == ["cpu", "cpu"]


@pytest.mark.parametrize("ml", ["meta", torch.device("meta"), {"cpu": "meta"}])
def test_map_location_meta_gives_shapes_and_dtypes_without_data(tmp_path, memory_uri, ml):
    """As ``torch.load(map_location="meta")``: every tensor on the meta device, views still sharing
    their storage, from a mapped local file and from memory."""
    w = torch.randn(4, 6)
    state = {"w": w, "col": w[:, 2], "i": torch.arange(5, dtype=torch.int16), "n": 2}
    for where in (str(tmp_path / "meta.fpk"), f"{memory_uri}/meta.fpk"):
        ckptio.dump(state, where)
        out = ckptio.load(where, map_location=ml)
        assert all(out[k].is_meta for k in ("w", "col", "i")) and out["n"] == 2
        assert out["w"].shape == (4, 6) and out["col"].stride() == (6,) and out["i"].dtype == torch.int16
        assert out["col"].untyped_storage().nbytes() == out["w"].untyped_storage().nbytes() == w.nbytes


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_go_through_pinned_staging(tmp_path):
    state = {
        "w": torch.randn(3000, 1000, device="cuda"),
        "b": torch.arange(7, device="cuda"),
        "cpu": torch.randn(5),
        "view": None,
    }
    state["view"] = state["w"][10:20]  # shares the CUDA storage
    p = tmp_path / "cuda.fpk"
    fp.save(state, p)
    assert fpk_write._staging is not None and fpk_write._staging.is_pinned()
    out = fp.load(p)  # located where they were saved, like torch.load
    assert out["w"].is_cuda and torch.equal(out["w"], state["w"]) and torch.equal(out["b"], state["b"])
    assert out["view"].untyped_storage().data_ptr() == out["w"].untyped_storage().data_ptr()
    cpu = fp.load(p, map_location="cpu")
    assert cpu["w"].device.type == "cpu" and torch.equal(cpu["w"], state["w"].cpu())


# ---- partial, lazy and metadata-only loads ----------------------------------------------------


def test_partial_load_reads_only_needed_ranges(memory_uri):
    state = {
        "model": collections.OrderedDict((f"layer{i}.weight", torch.randn(256, 256)) for i in range(6)),
        "optim": {
            "state": {i: {"exp_avg": torch.randn(256, 256), "step": torch.tensor(3.0)} for i in range(6)},
            "param_groups": [{"lr": 0.1, "params": list(range(6))}],
        },
        "step": 7,
    }
    uri = f"{memory_uri}/p.fpk"
    fp.save(state, uri)
    backend, resolved = ckptio.resolve(uri)
    size = backend.stat(resolved).size
    meta_len = struct.unpack("<Q", backend.read_range(resolved, size - 56, size - 48))[0]
    assert meta_len + 64 < fp.TAIL_PREFETCH < size // 4
    # the header and the end: footer and metadata (a remote source reads TAIL_PREFETCH bytes at once, some
    # payload with them; memory reads are local and read the footer and the metadata exactly)
    overhead = 64 + fp.TAIL_PREFETCH

    backend.bytes_read = 0
    out = fp.load(uri, keys=["model.layer3.weight", "optim.state.2.exp_avg", "step", "optim.param_groups"])
    assert list(out) == ["model.layer3.weight", "optim.state.2.exp_avg", "step", "optim.param_groups"]
    assert torch.equal(out["model.layer3.weight"], state["model"]["layer3.weight"])
    assert torch.equal(out["optim.state.2.exp_avg"], state["optim"]["state"][2]["exp_avg"])
    assert out["step"] == 7 and out["optim.param_groups"] == state["optim"]["param_groups"]
    assert 2 * 256 * 256 * 4 < backend.bytes_read <= overhead + 2 * 256 * 256 * 4

    backend.bytes_read = 0
    sub = fp.load(uri, keys=[("optim", "state", 4)])["optim.state.4"]
    assert_same(sub, state["optim"]["state"][4])
    assert backend.bytes_read <= overhead + 256 * 256 * 4 + 64 + 4  # exp_avg and step: adjacent, one range

    backend.bytes_read = 0
    info = fp.inspect(uri)
    assert backend.bytes_read <= overhead  # no payload byte
    assert isinstance(info.tree["model"]["layer0.weight"], fp.TensorInfo)
    assert info.tree["model"]["layer0.weight"].shape == (256, 256)
    assert info.tensors[0].path == "model.layer0.weight"
    with pytest.raises(KeyError, match="model.nope"):
        fp.load(uri, keys=["model.nope"])


def test_mmap_load_is_zero_copy_and_lazy(tmp_path):
    p = tmp_path / "m.fpk"
    obj = {"a": torch.randn(1000), "b": torch.arange(10), "np": np.arange(5.0), "e": torch.empty(0)}
    fp.save(obj, p)
    out = fp.load(p, mmap=True)
    assert_same(out, obj)
    assert all(t.data_ptr() % 64 == 0 for t in (out["a"], out["b"]))
    out["a"][0] = 7.0  # private mapping: the file is unchanged
    assert_same(fp.load(p), obj)
    data = bytearray(p.read_bytes())
    off = fp.inspect(p).tensors[0].offset
    data[off + 5] ^= 0xFF
    p.write_bytes(bytes(data))
    fp.load(p, mmap=True)  # payloads are not read, so not verified, unless asked
    with pytest.raises(IntegrityError, match=r"'a'"):
        fp.load(p, mmap=True, verify=True)
    with pytest.raises(ValueError, match="local file"):
        fp.load(io.BytesIO(bytes(data)), mmap=True)


@pytest.mark.parametrize("where", ["local", "memory"])
def test_format_inspect_and_verify_report_what_the_cli_shows(where, tmp_path, memory_uri):
    import json

    from ckptio import cli, registry

    w = torch.randn(4, 3)
    state = {
        "model": {"w": w, "view": w[1], "q": torch.quantize_per_tensor(torch.randn(5), 0.1, 2, torch.qint8)},
        "arrays": [np.arange(6, dtype=np.int16).reshape(2, 3), (np.float32(1.5), np.dtype("<f8"))],
        "tensors_in_a_set": {torch.ones(2)},
        "values": {3: "int key", (1, 2): b"\x00\x01", "c": 1 + 2j, "nan": float("nan"), "size": torch.Size([2, 3])},
        "types": [torch.float16, torch.device("cpu"), None, True, 2**70],
        "odd": collections.OrderedDict(b=[[1, 2], {"x": [torch.arange(3)]}]),
    }
    root = str(tmp_path) if where == "local" else memory_uri
    for name, obj, pickled in [
        ("rich", state, False),
        ("plain", {"a": [1, 2, {"b": 3}]}, False),
        ("pkl", {"p": collections.Counter("aab")}, True),
    ]:
        uri = f"{root}/{name}.fpk"
        fp.save(obj, uri, allow_pickle=pickled)
        backend, resolved = ckptio.resolve(uri)
        fmt = registry.formats.find(resolved).instance()
        report = fmt.inspect(backend, resolved)
        json.dumps(report)  # JSON-able as it is
        assert name != "rich" or (len(report["tensors"]) == 6 and report["values"]["values.c"] == "(1+2j)")
        info = cli.info(uri)
        assert set(info) - set(report) <= {"uri", "size"}
        assert {k: info[k] for k in report} == report
        if pickled:
            with pytest.raises(FormatError, match="allow_pickle"):
                fmt.verify(backend, resolved)
            with pytest.raises(FormatError, match="allow_pickle"):
                cli.verify(uri)
        else:
            assert cli.verify(uri) == {"uri": uri, "format": "fastpickle", "ok": True, **fmt.verify(backend, resolved)}


def test_cached_backend_loads_from_its_local_entry(memory_uri, tmp_path):
    from ckptio.cache import CachedBackend

    state = {"w": torch.randn(64, 64), "step": 3}
    uri = f"{memory_uri}/c.fpk"
    fp.save(state, uri)
    inner, resolved = ckptio.resolve(uri)
    cache = CachedBackend(inner, tmp_path / "cache")
    fmt = fp.FastpickleFormat()
    inner.bytes_read = 0
    out = fmt.load(cache, resolved)
    assert torch.equal(out["w"], state["w"]) and out["step"] == 3
    filled = inner.bytes_read  # one fill of the entry, no ranged reads per payload
    assert filled == inner.stat(resolved).size
    out = fmt.load(cache, resolved, mmap=True)  # a plain local file: mapping works
    assert torch.equal(out["w"], state["w"]) and inner.bytes_read == filled


class _RangedMemory:
    """memory:// read by ranges (``readinto``), as a store without ``Backend.held`` is."""

    def held(self, uri):
        return None


@pytest.mark.parametrize("held", [True, False])
@pytest.mark.parametrize("part_size", [1 << 16, 1 << 20, 32 << 20])
def test_full_remote_load_reads_each_byte_once(memory_uri, part_size, held):
    from ckptio.backends.memory import MemoryBackend

    state = {"a": torch.randn(100_000), "b": [torch.arange(7), torch.randn(3, 5000)], "c": torch.randn(40_000)}
    uri = f"{memory_uri}/full.fpk"
    fp.save(state, uri)
    _, resolved = ckptio.resolve(uri)
    cls = MemoryBackend if held else type("Ranged", (_RangedMemory, MemoryBackend), {})
    backend = cls(part_size=part_size, concurrency=4)
    size = backend.stat(resolved).size
    out = fp.FastpickleFormat().load(backend, resolved)
    assert torch.equal(out["a"], state["a"]) and torch.equal(out["c"], state["c"])
    assert all(torch.equal(x, y) for x, y in zip(out["b"], state["b"], strict=True))
    # read ahead at both ends, then only the middle: never a byte twice (gaps of alignment padding aside)
    assert size - 3 * 64 <= backend.bytes_read <= size


@pytest.mark.parametrize("mmap", [None, False])
def test_remote_reads_never_wait_for_the_head_behind_an_empty_tensor(memory_uri, mmap):
    """A zero-length tensor inside the first range read ahead needs no read: with one connection a
    read of it waited for that range (reading nothing from it), and every read queued behind it too."""
    import time

    from ckptio.backends.memory import MemoryBackend

    class SlowHead(MemoryBackend):
        reads_local = False  # read as an object store is

        def pin_version(self, uri, version=None):
            return self  # reads come through readinto below

        def held(self, uri):
            return None  # ranged reads, not the bytes the memory backend holds

        def readinto(self, uri, buf, offset=0):
            starts.append((offset, time.monotonic()))
            if offset == 0:
                time.sleep(1.0)
            return super().readinto(uri, buf, offset)

    starts: list[tuple[int, float]] = []
    state = {"z": torch.empty(0), "a": torch.randn(1000), "big": torch.randn(3 << 20)}  # 12 MiB
    uri = f"{memory_uri}/empty-in-head.fpk"
    fp.save(state, uri)
    _, resolved = ckptio.resolve(uri)
    backend = SlowHead(part_size=8 << 20, concurrency=1)
    t0 = time.monotonic()
    out = fp.FastpickleFormat().load(backend, resolved, **({} if mmap is None else {"mmap": mmap}))
    assert all(torch.equal(out[k], v) for k, v in state.items())
    later = [off for off, t in starts if off and t - t0 > 0.9]
    assert starts and not later, (later, starts)  # every other read started while the head was still on its way


def test_remote_load_returns_views_of_what_it_read_ahead_checked_and_alive(s3_uri, monkeypatch):
    import gc

    from ckptio.formats.fastpickle import read as fpk_read

    shared = []
    real_view = fpk_read.BackendSource.ahead_view

    def view(self, offset, nbytes, **kw):
        v = real_view(self, offset, nbytes, **kw)
        if v is not None:
            shared.append(nbytes)
        return v

    monkeypatch.setattr(fpk_read.BackendSource, "ahead_view", view)

    # part_size 5 MiB: a 12.6 MB object is read ahead at both ends, its middle read into fresh tensors
    state = {
        "head": torch.randn(1000),
        "middle": torch.randn(3 << 20),  # 12 MiB: the tail range starts inside it, wherever the size says
        "tail": torch.randn(1000),
        "c": torch.randn(77, dtype=torch.complex128),  # in the tail: its view is 16-byte aligned like the file's
        "n": 3,
        "odd": "x",
    }
    uri = f"{s3_uri}/views.fpk"
    fp.save(state, uri)
    for _ in range(64):  # an object whose size is no multiple of 64: the tail range then starts off one
        if len(ckptio.get(uri)) % 64:
            break
        state["odd"] += "x"
        fp.save(state, uri)
    opts = {"backend_args": {"part_size": 5 << 20}}
    out = ckptio.load(uri, **opts)
    gc.collect()
    junk = [torch.full((1 << 20,), 7.0) for _ in range(8)]  # reuse any memory wrongly freed
    for k in ("head", "middle", "tail", "c"):
        assert torch.equal(out[k], state[k]), k
        assert out[k].data_ptr() % 64 == 0, k  # as aligned as in the file (some kernels fault otherwise)
    del junk
    assert sorted(shared) == [77 * 16, 4000, 4000]  # views of the read-ahead buffers; the middle is read
    # the buffers are private: a forked child (a DataLoader worker) writing a loaded tensor changes its copy only
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    child = ctx.Process(target=out["tail"].add_, args=(1.0,))
    child.start()
    child.join(60)
    assert child.exitcode == 0 and torch.equal(out["tail"], state["tail"])
    shared.clear()
    copies = ckptio.load(uri, mmap=False, **opts)  # copies asked for: every payload its own
    assert shared == [] and all(torch.equal(copies[k], state[k]) for k in ("head", "middle", "tail", "c"))
    # damage inside each read-ahead range is caught before anything is returned
    data = bytearray(ckptio.get(uri))
    for where in ("head", "tail"):
        bad = bytearray(data)
        raw = state[where].numpy().tobytes()
        at = bad.find(raw[:64])
        assert at > 0
        bad[at + 100] ^= 0x10
        ckptio.put(bytes(bad), f"{s3_uri}/bad-{where}.fpk")
        with pytest.raises(IntegrityError, match=f"bad-{where}.fpk.*{where}"):
            ckptio.load(f"{s3_uri}/bad-{where}.fpk", **opts)


@pytest.mark.parametrize("share", [True, False])
def test_remote_reads_do_not_wait_for_the_first_range_read_ahead(s3_uri, s3_endpoint, monkeypatch, share):
    """A full remote load reads the first ``part_size`` bytes (5 MiB, under HEAD_PREFETCH) and a small
    tail ahead; once the tail (the layout) is in, every other read starts, without waiting for the first
    range's body: a payload straddling it fetches only its part outside it, and its part inside is
    copied (then checked) after. Through a proxy passing 2 MB/s a connection the first range's body
    takes 2.6 s; every other read must start before it ends. Damage in a straddling payload's copied
    part is still caught."""
    import time

    from ckptio.backends.s3 import S3Backend
    from ckptio.bench.proxy import LatencyProxy

    state = {
        "a": torch.randn(1000),
        "first": torch.randn(1 << 20),  # 4 MiB, inside the first range
        "straddles": torch.randn(2 << 20),  # 8 MiB from about 4 MiB: the first range (5 MiB) ends inside it
        "c": torch.randn(300),
    }
    uri = f"{s3_uri}/straddle.fpk"
    fp.save(state, uri)
    real = S3Backend._get_range
    log: list[tuple[int, float, float]] = []  # (first byte asked for, started, ended)

    async def traced(self, uri_, bucket, key, start, *a, **kw):
        t = time.monotonic()
        try:
            return await real(self, uri_, bucket, key, start, *a, **kw)
        finally:
            log.append((start, t, time.monotonic()))

    monkeypatch.setattr(S3Backend, "_get_range", traced)
    with LatencyProxy(s3_endpoint, latency=0.0, bandwidth=2e6) as proxy:
        opts = {"backend_args": {"part_size": 5 << 20, "endpoint_url": proxy.url}}
        out = ckptio.load(uri, **opts) if share else ckptio.load(uri, mmap=False, **opts)
        assert all(torch.equal(out[k], state[k]) for k in state)
        head_end = next(end for start, _, end in log if start == 0)
        assert len(log) >= 3 and all(t < head_end for start, t, _ in log if start), log
        data = bytearray(ckptio.get(uri))
        at = data.find(state["straddles"].numpy().tobytes()[:64])
        data[at + 64] ^= 0x10  # inside the first range, in the payload that straddles its end
        ckptio.put(bytes(data), f"{s3_uri}/bad.fpk")
        with pytest.raises(IntegrityError, match="bad.fpk.*straddles"):
            ckptio.load(f"{s3_uri}/bad.fpk", **opts)


@pytest.mark.parametrize("sizes_mib", [[4] * 6, [24], [1] * 40, [5] * 10])
def test_remote_full_load_shares_the_object_out_over_its_connections(s3_uri, monkeypatch, sizes_mib):
    """With the default options (16 MiB parts, 16 connections) a full remote load reads the first
    HEAD_PREFETCH bytes and the tail ahead, then the rest in about ``concurrency`` ranged GETs of at least
    MIN_PIECE and at most ``part_size`` (not a few part-sized ones: one S3 connection streams ~90 MB/s),
    each byte once, whether the object is a few large tensors, one, or many small ones. (Objects up to
    MIDDLE_MAX read their middle ahead instead, in ranges sized by the store's pace: the objects here
    are taken as larger, see test_small_requests.py for that read.)"""
    from ckptio.backends.s3 import S3Backend
    from ckptio.formats.fastpickle import payloads
    from ckptio.formats.fastpickle import read as fpk_read

    real = S3Backend._get_range
    ranges: list[tuple[int, int]] = []

    async def traced(self, uri_, bucket, key, start, end, *a, **kw):
        ranges.append((start, end))
        return await real(self, uri_, bucket, key, start, end, *a, **kw)

    g = torch.Generator().manual_seed(3)
    state = {f"t{i}": torch.randn(m << 18, generator=g) for i, m in enumerate(sizes_mib)}
    uri = f"{s3_uri}/shared-out.fpk"
    fp.save(state, uri)
    backend, key = ckptio.resolve(uri)
    size = backend.stat(key).size
    monkeypatch.setattr(S3Backend, "_get_range", traced)
    monkeypatch.setattr(fpk_read, "MIDDLE_MAX", 1 << 20)
    out = ckptio.load(uri)
    assert all(torch.equal(out[k], v) for k, v in state.items())
    head = min(backend.part_size, fpk_read.HEAD_PREFETCH)
    assert (0, head) in ranges, ranges
    rest = sorted(r for r in ranges if r[0] != 0 and r[1] != size)  # neither range read ahead
    assert sum(e - s for s, e in ranges) <= size + 2 * fpk_layout.ALIGN, ranges  # each byte once
    assert all(e - s <= backend.part_size for s, e in rest), rest
    # a payload's few bytes past a range read ahead, and the last slice, may come in shorter reads
    body = rest[:-1]
    # (a payload is cut into equal slices near the share per connection: none under half of MIN_PIECE)
    assert sum(e - s for s, e in body if e - s >= payloads.MIN_PIECE // 2) >= 0.85 * sum(e - s for s, e in body), rest
    todo = size - head - fpk_read.TAIL_PREFETCH
    want = min(backend.concurrency, todo // payloads.MIN_PIECE)  # about concurrency, none below MIN_PIECE
    assert want - 1 <= len(rest) <= 2 * want, (todo, rest)


def test_a_large_remote_load_has_its_fresh_tensors_faulted_in_by_a_helper(s3_uri, tmp_path, monkeypatch):
    """A remote load of at least FAULT_HELPER_MIN hands the fresh tensors its reads fill (not the ranges
    read ahead, not a caller's tensors) to osio.fault_in_striped on a helper thread, which has stopped
    by the time the load returns; the tensors are exact. Local loads and loads into tensors do not."""
    from ckptio.formats.fastpickle import payloads

    real = payloads.fault_in_striped
    seen: list[list[list[memoryview]]] = []
    ended: list[bool] = []

    def traced(targets, stop):
        seen.append(targets)
        out = real(targets, stop)
        ended.append(True)  # before the load returns (asserted below)
        return out

    monkeypatch.setattr(payloads, "fault_in_striped", traced)
    monkeypatch.setattr(payloads, "FAULT_HELPER_MIN", 1 << 20)
    monkeypatch.setattr(fpread, "MIDDLE_MAX", 1 << 20)  # a large object: its middle is read into its tensors
    g = torch.Generator().manual_seed(5)
    state = {
        "a": torch.randn(3 << 20, generator=g),
        "b": torch.randn(5, generator=g),
        "c": torch.randn(1 << 20, generator=g),
    }
    uri = f"{s3_uri}/helped.fpk"
    fp.save(state, uri)
    out = ckptio.load(uri)
    assert all(torch.equal(out[k], v) for k, v in state.items())
    assert len(seen) == 1 and len(ended) == 1
    spans = [(ctypes_addr(v), len(v)) for views in seen[0] for v in views]
    tensors = [(t.data_ptr(), t.numel() * t.element_size()) for t in out.values()]
    assert spans and all(any(p <= a and a + n <= p + m for p, m in tensors) for a, n in spans)
    # the first bytes were read ahead (views of that buffer, faulted in by its own read): not handed over
    assert sum(n for _, n in spans) < sum(m for _, m in tensors)

    seen.clear()
    ckptio.load_into({k: torch.zeros_like(v) for k, v in state.items()}, uri)  # the caller's tensors
    fp.save(state, str(tmp_path / "local.fpk"))
    ckptio.load(str(tmp_path / "local.fpk"), mmap=False)
    assert not any(views for targets in seen for views in targets)


def ctypes_addr(view: memoryview) -> int:
    from ckptio import osio

    return osio.address(view)


def test_remote_full_load_reads_footer_and_metadata_from_its_read_ahead_without_a_copy(s3_uri, monkeypatch):
    from ckptio.formats.fastpickle import read as fpk_read

    copied, seen = [], []
    real_copy, real_view = fpk_read.Source.read, fpk_read.BackendSource.view

    def copy(self, offset, n):
        copied.append((offset, n))
        return real_copy(self, offset, n)

    def view(self, offset, n):
        out = real_view(self, offset, n)
        seen.append(out)
        return out

    monkeypatch.setattr(fpk_read.Source, "read", copy)
    monkeypatch.setattr(fpk_read.BackendSource, "view", view)
    state = {"w": torch.randn(300_000), "n": 3}  # 1.2 MB: one request, the tail read is a part of it
    uri = f"{s3_uri}/meta-view.fpk"
    fp.save(state, uri)
    out = ckptio.load(uri)
    assert torch.equal(out["w"], state["w"]) and out["n"] == 3
    assert copied == [] and seen  # header, footer and metadata: views of what was read ahead
    assert all(isinstance(v, memoryview) and v.readonly for v in seen)  # nobody can write into the payloads
    # the last 256 KiB straddle two ranges read ahead (5 MiB parts, 5.1 MiB): copied out of both
    seen.clear()
    state["w"] = torch.randn(1_340_000)
    fp.save(state, uri)
    out = ckptio.load(uri, backend_args={"part_size": 5 << 20})
    assert torch.equal(out["w"], state["w"]) and copied and all(type(v) in (bytes, memoryview) for v in seen)


@pytest.mark.parametrize(
    "pos, error, message",
    [
        (0, FormatError, "bad magic"),  # the magic
        (12, IntegrityError, "header or bytes"),  # the header's alignment field: it is under the metadata checksum
        (-100, IntegrityError, "metadata checksum"),  # a metadata byte (covered by the footer's checksum of both)
    ],
)
def test_remote_full_load_checks_header_and_metadata(memory_uri, pos, error, message):
    uri = f"{memory_uri}/h.fpk"
    fp.save({"w": torch.randn(1000), "x": [1, 2]}, uri)
    data = bytearray(ckptio.get(uri))
    data[pos] ^= 0x55
    ckptio.put(bytes(data), uri)
    with pytest.raises(error, match=message):
        fp.load(uri)


def test_a_write_that_takes_nothing_is_an_error_not_a_hang(tmp_path, monkeypatch):
    monkeypatch.setattr(fpk_write.os, "writev", lambda fd, bufs: 0)
    path = tmp_path / "zero.fpk"
    with pytest.raises(OSError, match="zero.fpk.*took no bytes"):
        fp.save({f"t{i}": torch.randn(100) for i in range(3)}, str(path))
    assert os.listdir(tmp_path) == []  # the temporary file is gone


def test_short_vectored_writes_are_resumed(tmp_path, monkeypatch):
    real = os.writev

    def short(fd, bufs):  # write at most 1000 bytes per call, often stopping inside a buffer
        first = memoryview(bufs[0]).cast("B")
        return real(fd, [first[:1000]])

    monkeypatch.setattr(fpk_write.os, "writev", short)
    state = {f"t{i}": torch.randn(700 + i) for i in range(20)}
    path = str(tmp_path / "short.fpk")
    fp.save(state, path)
    out = fp.load(path)
    assert all(torch.equal(out[k], v) for k, v in state.items())


def test_a_remote_payload_is_cut_into_equal_slices_near_the_share_per_connection():
    from ckptio.formats.fastpickle.payloads import _piece

    mib = 1 << 20
    assert _piece(5 * mib, 4 * mib, 16 * mib) == 5 * mib  # one read, not 4 MiB + 1 MiB
    assert _piece(63 * mib // 4, 4 * mib, 16 * mib) == 63 * mib // 16  # four equal slices
    assert _piece(100 * mib, 40 * mib, 16 * mib) <= 16 * mib  # never over part_size
    assert _piece(7, 4 * mib, 16 * mib) == 7

"""Trust: loading runs no code by default, whatever the file or a checkpoint's commit marker says.

* ``.pkl`` loads admit plain data only (``ckptio.formats.safepickle``): crafted pickles are refused
  before anything is called (checked in a subprocess, so a crash fails the test), the data that
  mmengine/easy_io users keep in ``.pkl`` still loads, and ``allow_pickle=True`` loads trusted files.
* A Checkpointer's ``checkpoint.json`` cannot choose a deserializer or a path: its format and file
  names are checked, the data file is read as the checkpoint's format, and ``allow_pickle=True`` is
  the one opt-in for trusted checkpoints.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import decimal
import io
import json
import os
import pickle
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import ckptio
from ckptio import fastpickle
from ckptio.checkpointer import Checkpointer
from ckptio.errors import CkptioError, FormatError
from test_security import _evil  # an object whose unpickling creates a marker file

pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
    pytest.mark.filterwarnings("ignore::ckptio.checkpointer.CheckpointWarning"),
]


@dataclasses.dataclass
class Point:  # an ordinary user class: plain pickle stores it by reference
    x: int
    y: int


# ---- crafted pickles -------------------------------------------------------------------------------

_NPCORE = getattr(np, "_core", None) or np.core  # numpy 2 / 1.x


def _reduce_as(fn, args, state=None):
    """An object that pickles as ``fn(*args)`` followed by BUILD with ``state``, whatever those are."""

    class R:
        def __reduce__(self):
            return (fn, args) if state is None else (fn, args, state)

    return R()


def _payloads(marker: str) -> dict[str, bytes]:
    cmd = f"touch {marker}".encode()
    recon, scalar = _NPCORE.multiarray._reconstruct, _NPCORE.multiarray.scalar
    lying = (3, "|", None, None, None, -1, -1, 0)  # an object dtype whose flags say "no objects"
    obj_dtype = _reduce_as(np.dtype, ("O8", False, True), lying)
    return {
        "GLOBAL os.system": b"cos\nsystem\n(S'" + cmd + b"'\ntR.",
        "GLOBAL posix.system (protocol 0)": pickle.dumps(_reduce_as(os.system, (cmd.decode(),)), protocol=0),
        "STACK_GLOBAL posix.system": pickle.dumps(_reduce_as(os.system, (cmd.decode(),)), protocol=4),
        "builtins.eval": b"cbuiltins\neval\n(S\"__import__('os').system('" + cmd + b"')\"\ntR.",
        "__builtin__.eval (protocol 2 name)": b"\x80\x02c__builtin__\neval\n(S\"__import__('os').system('"
        + cmd
        + b"')\"\ntR.",
        "builtins.getattr(__import__('os'), 'system')": b"cbuiltins\ngetattr\n(cbuiltins\n__import__\n"
        b"(S'os'\ntRS'system'\ntR(S'" + cmd + b"'\ntR.",
        "copyreg._reconstructor": b"ccopy_reg\n_reconstructor\n(ccollections\nOrderedDict\ncbuiltins\ndict\nNtR.",
        "INST os.system": b"(S'" + cmd + b"'\nios\nsystem\n.",
        "OBJ os.system": b"(cos\nsystem\nS'" + cmd + b"'\no.",
        "NEWOBJ numpy.ndarray": b"\x80\x02cnumpy\nndarray\n)\x81.",
        "BUILD sets __init__ on an admitted class": b"ccollections\nOrderedDict\n"
        b"(N(dS'__init__'\ncbuiltins\nset\nsttb.",
        "BUILD sets __reduce_ex__ on an admitted class": b"ccollections\nOrderedDict\n"
        b"(N(dS'__reduce_ex__'\ncbuiltins\nset\nsttb.",
        "BUILD sets a checked function's defaults": b"c_codecs\nencode\n(N(dS'__defaults__'\n(S'zlib'\ntsttb.",
        "REDUCE bytes(size) on an admitted type": b"cbuiltins\nbytes\n(I1000000000000\ntR.",
        "REDUCE _codecs.encode with a non-latin codec": b"c_codecs\nencode\n(S'x'\nS'zlib_codec'\ntR.",
        "defaultdict(builtins.exec)": b"ccollections\ndefaultdict\n(cbuiltins\nexec\ntR.",
        "numpy _reconstruct of a non-ndarray type": pickle.dumps(
            _reduce_as(recon, (collections.OrderedDict, (0,), b"b")), protocol=2
        ),
        "numpy _reconstruct of an ndarray subclass": pickle.dumps(np.zeros(2).view(np.recarray), protocol=2),
        "numpy dtype flags: object array from raw bytes": pickle.dumps(
            _reduce_as(recon, (np.ndarray, (0,), b"b"), (1, (1,), obj_dtype, False, b"A" * 8))
        ),
        "numpy dtype: object field at a forged offset": pickle.dumps(
            _reduce_as(
                recon,
                (np.ndarray, (0,), b"b"),
                (
                    1,
                    (1,),
                    _reduce_as(np.dtype, ("V8", False, True), (3, "|", None, ("a",), {"a": (obj_dtype, 0)}, 8, 1, 0)),
                    False,
                    b"A" * 8,
                ),
            )
        ),
        "numpy dtype: field beyond the item size": pickle.dumps(
            _reduce_as(
                recon,
                (np.ndarray, (0,), b"b"),
                (
                    1,
                    (1,),
                    _reduce_as(
                        np.dtype, ("V8", False, True), (3, "|", None, ("a",), {"a": (np.dtype("f8"), 4096)}, 8, 1, 0)
                    ),
                    False,
                    b"A" * 8,
                ),
            )
        ),
        "numpy _frombuffer with an object dtype": pickle.dumps(
            _reduce_as(_NPCORE.numeric._frombuffer, (bytearray(8), obj_dtype, (1,), "C")), protocol=5
        ),
        "numpy gadget runstring": b"cnumpy.testing._private.utils\nrunstring\n(S'import os; os.system(\""
        + cmd
        + b"\")'\n(dtR.",
        "PERSID": b"P1\n.",
        "BINPERSID": b"\x80\x02K\x01Q.",
        "EXT1": b"\x80\x02\x82\x01.",
        "torch tensor": pickle.dumps(torch.ones(2), protocol=2),
        "user class": pickle.dumps(Point(1, 2)),
        "scalar of a lying object dtype": pickle.dumps(_reduce_as(scalar, (obj_dtype, b"A" * 8))),
        # numpy's __setstate__ loses the error of a field it cannot convert (SystemError, a leaked buffer)
        "numpy structured object array with unconvertible items": pickle.dumps(
            _reduce_as(
                recon,
                (np.ndarray, (0,), b"b"),
                (1, (2,), np.dtype([("o", "O"), ("i", "<i4")]), False, [(None, "x"), bytearray(b"ab")]),
            )
        ),
        "Decimal of text that is not a number": b"cdecimal\nDecimal\n(S'garbage'\ntR.",
    }


_HARMLESS = {"scalar of a lying object dtype"}  # loads, as numpy's rule says: an object scalar is the object

_WORKER = textwrap.dedent("""
    import collections, json, os, sys
    import numpy as np
    import ckptio
    from ckptio.errors import CkptioError
    f8 = np.dtype("f8")
    for path in sys.argv[1:]:
        print("loading", path, flush=True)
        try:
            out = {"loaded": repr(ckptio.load(path))[:200]}
        except BaseException as e:
            out = {"type": type(e).__name__, "ckptio": isinstance(e, CkptioError), "msg": str(e)}
        print("RESULT " + json.dumps({"path": path, **out}), flush=True)
    assert np.dtype("f8") is f8 and f8.byteorder == "=" and f8.flags == 0
    assert collections.OrderedDict([(1, 2)]) == {1: 2}
    assert type(collections.OrderedDict.__init__).__name__ == "wrapper_descriptor"
    print("INTACT", flush=True)
""")


def test_crafted_pickles_are_refused_without_running_anything(tmp_path):
    marker = tmp_path / "PWNED"
    paths = {}
    for i, (name, data) in enumerate(_payloads(str(marker)).items()):
        p = tmp_path / f"p{i}.pkl"
        p.write_bytes(data)
        paths[str(p)] = name
    r = subprocess.run(
        [sys.executable, "-c", _WORKER, *paths],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert r.returncode == 0 and "INTACT" in r.stdout, (r.returncode, r.stdout[-3000:], r.stderr[-3000:])
    assert not marker.exists()
    results = {
        paths[d["path"]]: d
        for d in (json.loads(line[7:]) for line in r.stdout.splitlines() if line.startswith("RESULT "))
    }
    assert set(results) == set(paths.values())
    for name, res in results.items():
        if name in _HARMLESS:
            assert "loaded" in res, (name, res)
            continue
        assert res.get("type") == "FormatError" and res["ckptio"], (name, res)
        assert res["msg"].startswith(next(p for p, n in paths.items() if n == name)), (name, res)  # names the file
    for name, cls in [
        ("GLOBAL os.system", "os.system"),
        ("STACK_GLOBAL posix.system", "posix.system"),
        ("builtins.eval", "builtins.eval"),
        ("copyreg._reconstructor", "copyreg._reconstructor"),
        ("torch tensor", "torch._utils._rebuild_tensor_v2"),
        ("user class", "test_trust.Point"),
        ("numpy _reconstruct of a non-ndarray type", "collections.OrderedDict"),
        ("numpy _reconstruct of an ndarray subclass", "recarray"),
    ]:
        assert cls in results[name]["msg"] and "allow_pickle=True" in results[name]["msg"], results[name]


# ---- what .pkl users keep in them still loads -------------------------------------------------------


def _plain_data():
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    return {
        "arrays": {
            "f32": a,
            "i64": np.arange(4),
            "bool": np.array([True, False]),
            "big_endian": np.arange(3, dtype=">i4"),
            "fortran": np.asfortranarray(a),
            "strings": np.array(["a", "bcd"]),
            "bytes": np.array([b"x"]),
            "objects": np.array([1, "a", None, np.arange(2)], dtype=object),
            "empty": np.zeros((0, 3)),
            "struct": np.zeros(2, dtype=[("a", "<i4"), ("b", "f8", (2,))]),
            "datetime": np.array(["2024-01-01"], dtype="M8[ns]"),
            "f16": np.ones(2, dtype=np.float16),
            "struct_objects": np.asfortranarray(
                np.array([[(1, 2), ("a", 3)], [(None, 4), ((5,), 6)]], dtype=[("o", "O"), ("i", "<i4")])
            ),
        },
        "scalars": [np.float32(1.5), np.int64(3), np.bool_(True), np.str_("s"), np.datetime64("2024-01-02")],
        "dtypes": {np.dtype("f4"), np.dtype(">i2")},
        "ordered": collections.OrderedDict([("b", 1), ("a", 2)]),
        "counts": collections.defaultdict(list, {"x": [1]}),
        "queue": collections.deque([1, 2], maxlen=5),
        "when": datetime.datetime(2024, 5, 6, 7, 8, 9, tzinfo=datetime.timezone.utc),
        "day": datetime.date(2024, 1, 1),
        "span": datetime.timedelta(seconds=3),
        "misc": (
            1,
            2.5,
            3 + 4j,
            "s",
            b"b",
            bytearray(b"ba"),
            None,
            True,
            2**100,
            {1, 2},
            frozenset({3}),
            slice(1, 5),
            Ellipsis,
            decimal.Decimal("1.25"),
        ),
        "shared": [a, a],
    }


def _equal(x, y) -> bool:
    if isinstance(y, np.ndarray):
        return (
            type(x) is np.ndarray
            and _equal(x.dtype, y.dtype)
            and x.shape == y.shape
            and x.flags.f_contiguous == y.flags.f_contiguous
            and (
                all(_equal(p, q) for p, q in zip(x.ravel(), y.ravel(), strict=True))
                if y.dtype.hasobject
                else x.tobytes() == y.tobytes()
            )
        )
    if isinstance(y, dict):
        return type(x) is type(y) and list(x) == list(y) and all(_equal(x[k], y[k]) for k in y)
    if isinstance(y, (list, tuple, collections.deque)):
        return type(x) is type(y) and len(x) == len(y) and all(_equal(p, q) for p, q in zip(x, y, strict=True))
    if isinstance(y, np.dtype):
        return type(x) is type(y) and x == y and x.str == y.str and x.byteorder == y.byteorder and hash(x) == hash(y)
    return type(x) is type(y) and (x == y or x is y)


@pytest.mark.parametrize("protocol", [0, 2, 4, 5])  # mmengine writes protocol 2, ckptio the highest
def test_plain_data_loads_by_default(tmp_path, protocol):
    raw = pickle.dumps(_plain_data(), protocol=protocol)
    back = ckptio.load(_write(tmp_path / "data.pkl", raw))
    assert _equal(back, pickle.loads(raw))  # what plain pickle gives (numpy makes big-endian arrays native)
    assert back["shared"][0] is back["shared"][1]
    assert back["counts"].default_factory is list and back["queue"].maxlen == 5
    assert back["arrays"]["f32"].flags.writeable


def test_numpy_1_pickles_load(tmp_path):
    data = {"a": np.arange(3.0), "s": np.float64(2.0), "b": np.frombuffer(b"xy", dtype=np.uint8)}
    for protocol in (0, 2):  # (no frames: the names can change length)
        raw = pickle.dumps(data, protocol=protocol).replace(b"numpy._core.", b"numpy.core.")  # numpy 1.x names
        assert b"numpy.core.multiarray" in raw
        assert _equal(ckptio.load(_write(tmp_path / "np1.pkl", raw)), data)


def _write(path, data: bytes) -> str:
    path.write_bytes(data)
    return str(path)


def test_ckptio_dump_then_load_round_trips(tmp_path):
    data = _plain_data()
    uri = str(tmp_path / "ours.pkl")
    ckptio.dump(data, uri)
    ref = pickle.loads(open(uri, "rb").read())  # plain pickle on the dump side: mmengine reads our files
    assert _equal(ref, data) and _equal(ckptio.load(uri), ref)


def test_allow_pickle_loads_trusted_files(tmp_path, memory_uri):
    uri = memory_uri + "/points.pkl"
    ckptio.dump({"p": Point(1, 2)}, uri)
    with pytest.raises(FormatError) as e:
        ckptio.load(uri)
    assert uri in str(e.value) and "test_trust.Point" in str(e.value) and "allow_pickle=True" in str(e.value)
    assert ckptio.load(uri, allow_pickle=True) == {"p": Point(1, 2)}
    buf = io.BytesIO(pickle.dumps(Point(3, 4)))
    with pytest.raises(FormatError, match="allow_pickle"):
        ckptio.load(buf, file_format="pkl")
    buf.seek(0)
    assert ckptio.load(buf, file_format="pkl", allow_pickle=True) == Point(3, 4)
    evil = _evil(tmp_path)
    path = _write(tmp_path / "evil.pkl", pickle.dumps({"x": evil}))
    with pytest.raises(FormatError, match="builtins.open|io.open"):
        ckptio.load(path)
    assert not os.path.exists(evil.marker)


def test_damaged_pickles_raise_format_error(tmp_path):
    good = pickle.dumps(_plain_data(), protocol=5)
    for cut in (1, len(good) // 3, len(good) - 1):
        with pytest.raises(FormatError, match="bad.pkl"):
            ckptio.load(_write(tmp_path / "bad.pkl", good[:cut]))
    with pytest.raises(FormatError, match="bad.pkl"):
        ckptio.load(_write(tmp_path / "bad.pkl", b"not a pickle"))


# ---- the Checkpointer's commit marker ----------------------------------------------------------------


def _forged_step(root, manifest, files: dict[str, bytes], step: int = 1):
    d = root / f"{step:012d}"
    d.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (d / name).write_bytes(data)
    (d / "checkpoint.json").write_text(manifest if isinstance(manifest, str) else json.dumps(manifest))
    (root / "latest.txt").write_text(f"{step:012d}\n")
    return d


@pytest.mark.parametrize("own", ["fpk", "dcp", "pt"])
def test_manifest_cannot_pick_pickle(tmp_path, own):
    """The issue's case: a hand-written marker names state.pkl; loading used to unpickle it."""
    evil = _evil(tmp_path)
    root = tmp_path / "run"
    d = _forged_step(root, {"format": "fpk", "step": 1, "files": ["state.pkl"]}, {"state.pkl": pickle.dumps(evil)})
    marker = str(d / "checkpoint.json")
    with pytest.raises(FormatError) as e:
        Checkpointer(str(root), format=own).load({"m": {}})
    assert marker in str(e.value) and "'files'" in str(e.value)
    with pytest.raises(FormatError, match="'files'") as e:  # by URI: any format, but still no .pkl
        Checkpointer(str(tmp_path / "other"), format=own).load({"m": {}}, step=str(d))
    assert marker in str(e.value)
    assert not os.path.exists(evil.marker)


@pytest.mark.parametrize("own", ["fpk", "pt"])
def test_data_file_is_read_as_the_checkpoint_format(tmp_path, own):
    """A pickle named state.fpk/state.pt is read as fastpickle/torch (weights_only), never unpickled."""
    evil = _evil(tmp_path)
    raw = str(tmp_path / "raw.pt")
    torch.save({"m": evil}, raw)
    data = {"fpk": pickle.dumps({"m": evil}), "pt": open(raw, "rb").read()}[own]
    root = tmp_path / "run"
    _forged_step(root, {"format": own, "step": 1, "files": [f"state.{own}"]}, {f"state.{own}": data})
    with pytest.raises((CkptioError, pickle.UnpicklingError)):
        Checkpointer(str(root), format=own).load({"m": {}})
    assert not os.path.exists(evil.marker)


@pytest.mark.parametrize(
    "manifest, key",
    [
        ("[]", None),
        ('"fpk"', None),
        ("null", None),
        ("3", None),
        ("{not json", None),
        (b"\xff\xfe", None),
        ({"format": "pkl", "step": 1}, "format"),
        ({"format": "pickle", "step": 1}, "format"),
        ({"format": 5, "step": 1}, "format"),
        ({"format": None, "step": 1}, "format"),
        ({"step": 1}, "format"),
        ({"format": "fpk", "step": "1"}, "step"),
        ({"format": "fpk", "step": True}, "step"),
        ({"format": "fpk", "step": -1}, "step"),
        ({"format": "fpk", "step": 1.0}, "step"),
        ({"format": "fpk", "step": 1, "files": "state.fpk"}, "files"),
        ({"format": "fpk", "step": 1, "files": [5]}, "files"),
        ({"format": "fpk", "step": 1, "files": ["../outside.fpk"]}, "files"),
        ({"format": "fpk", "step": 1, "files": ["OUTSIDE_ABS"]}, "files"),
        ({"format": "fpk", "step": 1, "files": ["sub/state.fpk"]}, "files"),
        ({"format": "fpk", "step": 1, "files": ["..\\outside.fpk"]}, "files"),
        ({"format": "fpk", "step": 1, "files": ["file://OUTSIDE_ABS"]}, "files"),
        ({"format": "fpk", "step": 1, "files": ["memory://b/state.fpk"]}, "files"),
        ({"format": "fpk", "step": 1, "files": [".."]}, "files"),
        ({"format": "fpk", "step": 1, "files": [""]}, "files"),
        ({"format": "fpk", "step": 1, "files": ["state.pt"]}, "files"),
        ({"format": "dcp", "step": 1, "files": ["../x"]}, "files"),
    ],
)
def test_malformed_manifest_is_refused_naming_file_and_key(tmp_path, manifest, key):
    root = tmp_path / "run"
    outside = root / "outside.fpk"
    root.mkdir()
    fastpickle.save({"m": {"w": torch.full((2,), 7.0)}}, str(outside))  # a valid file a marker must not reach
    if isinstance(manifest, dict):
        manifest = json.loads(json.dumps(manifest).replace("OUTSIDE_ABS", str(outside)))
    d = _forged_step(root, manifest if not isinstance(manifest, bytes) else "", {})
    if isinstance(manifest, bytes):
        (d / "checkpoint.json").write_bytes(manifest)
    marker = str(d / "checkpoint.json")
    for ck, step in (
        (Checkpointer(str(root), format="fpk"), "latest"),
        (Checkpointer(str(root), format="fpk"), 1),
        (Checkpointer(str(tmp_path / "other"), format="dcp"), str(d)),
    ):
        state = {"m": {"w": torch.zeros(2)}}
        with pytest.raises(FormatError) as e:
            ck.load(state, step=step)
        assert marker in str(e.value) and (key is None or f"'{key}'" in str(e.value)), str(e.value)
        assert torch.equal(state["m"]["w"], torch.zeros(2))


@pytest.mark.parametrize("fmt", ["fpk", "pt"])
def test_checkpointer_allow_pickle_loads_trusted_checkpoints(memory_uri, fmt):
    ck = Checkpointer(memory_uri, format=fmt, save_options={"allow_pickle": True} if fmt == "fpk" else None)
    ck.save(1, {"extra": {"p": Point(1, 2)}, "m": {"w": torch.ones(2)}})
    with pytest.raises(Exception, match="allow_pickle|weights_only|Unsupported global"):
        ck.load({"extra": {}, "m": {"w": torch.zeros(2)}})
    state = {"extra": {"p": None}, "m": {"w": torch.zeros(2)}}
    assert ck.load(state, allow_pickle=True) == 1
    assert state["extra"]["p"] == Point(1, 2) and torch.equal(state["m"]["w"], torch.ones(2))


def test_manifest_format_switch_runs_no_code(tmp_path):
    """A marker may name another of the Checkpointer formats (a dcp Checkpointer loads a pt step), but
    each of them loads safely: a forged pt step is read with weights_only."""
    evil = _evil(tmp_path)
    raw = tmp_path / "raw.pt"
    torch.save({"m": evil}, str(raw))
    root = tmp_path / "run"
    _forged_step(root, {"format": "pt", "step": 1, "files": ["state.pt"]}, {"state.pt": raw.read_bytes()})
    with pytest.raises(pickle.UnpicklingError, match="weights_only"):
        Checkpointer(str(root), format="dcp").load({"m": {}})
    assert not os.path.exists(evil.marker)


def test_extension_codes_cached_by_a_trusted_load_are_refused(tmp_path):
    # EXT opcodes: the C unpickler serves a code from copyreg's cache without asking find_class once any
    # load in the process resolved it; here os.system, registered and cached by a trusted plain load
    marker = tmp_path / "PWNED"
    path = _write(tmp_path / "ext.pkl", b"\x80\x02\x83\x00\x0f(S'touch " + str(marker).encode() + b"'\ntR.")
    script = textwrap.dedent("""
        import copyreg, pickle, sys
        import ckptio
        from ckptio.errors import FormatError
        copyreg.add_extension("os", "system", 0xF00)
        pickle.loads(b"\\x80\\x02\\x83\\x00\\x0f.")  # a trusted load resolves (and caches) the code
        try:
            ckptio.load(sys.argv[1])
        except FormatError as e:
            print("REFUSED", e)
    """)
    r = subprocess.run(
        [sys.executable, "-c", script, path],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert not marker.exists() and r.returncode == 0, (r.stdout, r.stderr[-2000:])
    assert "REFUSED" in r.stdout and path in r.stdout and "extension" in r.stdout, r.stdout

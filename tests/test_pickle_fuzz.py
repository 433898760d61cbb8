"""A structure fuzzer for every unpickler ckptio owns: genuine pickles (DCP metadata, plain data, numpy,
torch.save's data.pkl) with gadgets spliced in at opcode boundaries (BUILD/APPENDS/SETITEMS on an
admitted global, memo puts at any index, calls of admitted globals with sizes), byte flips, truncations
and random opcode runs. Each case goes to ``.pkl`` loads, ``.metadata`` parsing, ``.pt`` loads (torch's
``weights_only`` path behind ckptio's checks), ``ckptio info`` and the DCP item check, in a child with
``RLIMIT_AS`` and an alarm (``pickle_workers``). Each must end in a correct load or a refusal within
the alarm, with the peak RSS growing by at most a small multiple of the input, and no admitted class or
function changed. The default run is seeded and short; ``-m slow`` runs more cases.
"""

from __future__ import annotations

import collections
import pickle
import pickletools
import random
import struct

import numpy as np
import pytest
import torch

from pickle_workers import run_jobs
from test_pickle_bombs import MIB, genuine_metadata, pt_archive

GLOBALS = [
    b"pathlib\nPurePath\n",
    b"pathlib\nPosixPath\n",
    b"torch.distributed.checkpoint.metadata\nMetadata\n",
    b"torch.distributed.checkpoint.metadata\nTensorProperties\n",
    b"torch.distributed.checkpoint.metadata\n_MEM_FORMAT_ENCODING\n",
    b"torch.distributed.checkpoint.filesystem\n_StorageInfo\n",
    b"torch.serialization\n_get_layout\n",
    b"torch\nSize\n",
    b"torch\nfloat32\n",
    b"torch\nFloatTensor\n",
    b"torch\nUntypedStorage\n",
    b"torch._utils\n_rebuild_tensor_v2\n",
    b"torch._utils\n_rebuild_qtensor\n",
    b"collections\nOrderedDict\n",
    b"builtins\nset\n",
    b"builtins\nbytes\n",
    b"builtins\nbytearray\n",
    b"builtins\nint\n",
    b"builtins\nstr\n",
    b"decimal\nDecimal\n",
    b"_codecs\nencode\n",
    b"numpy\ndtype\n",
    b"numpy.core.multiarray\n_reconstruct\n",
]
# kind -> outcomes allowed besides "ok"/"format": a .pt that passes ckptio's checks but not torch's
# weights_only unpickler fails with torch's own error types, as a torch.load user expects (KeyError: a
# persistent id naming no record; UnicodeDecodeError, a ValueError: a record name that is not UTF-8)
_TORCH_ERRORS = (
    "UnpicklingError",
    "RuntimeError",
    "TypeError",
    "ValueError",
    "UnicodeDecodeError",
    "AttributeError",
    "IndexError",
    "KeyError",
)
KINDS = {"pkl": (), "metadata": (), "pt": _TORCH_ERRORS, "info": (), "item": ()}


def _str(rng: random.Random) -> bytes:
    s = rng.choice(["_str", "x", "_value_", "__doc__", "planner_data", "1E+3000000", "1E+400", "a" * 300])
    b = s.encode()
    return b"X" + struct.pack("<I", len(b)) + b


def _int(rng: random.Random) -> bytes:
    return b"J" + struct.pack("<i", rng.choice([0, 1, 7, 255, 1 << 20, 1 << 28, 0x7FFFFFFF, -1]))


def _value(rng: random.Random) -> bytes:
    return rng.choice([_str, _int, lambda r: b"N", lambda r: b"}", lambda r: b"(K\x01K\x02t"])(rng)


def gadget(rng: random.Random) -> bytes:
    """Opcodes that push one object and pop it: stack-neutral wherever an opcode may start."""
    g = b"c" + rng.choice(GLOBALS)
    pick = rng.randrange(8)
    if pick == 0:  # BUILD with a dict state
        return g + b"}" + _str(rng) + _value(rng) + b"sb0"
    if pick == 1:  # BUILD with slot state
        return g + b"N}" + _str(rng) + _value(rng) + b"s\x86b0"
    if pick == 2:  # a call, then BUILD on its result
        return g + b"(" + _value(rng) + b"tR}" + _str(rng) + _value(rng) + b"sb0"
    if pick == 3:  # a call with a size or a string
        return g + b"(" + b"".join(_value(rng) for _ in range(rng.randrange(1, 4))) + b"tR0"
    if pick == 4:  # container updates on a global
        return g + rng.choice([b"(K\x01e", b"(K\x01K\x02u", b"(K\x01\x90", b"K\x01K\x02s", b"K\x01a"]) + b"0"
    if pick == 5:  # a memo put at any index
        return b"N" + rng.choice([b"r" + struct.pack("<I", rng.getrandbits(32)), b"p%d\n" % rng.getrandbits(31)]) + b"0"
    if pick == 6:  # a memo put, then BUILD on what the memo gives back
        return g + b"\x94" + b"0" + b"h\x00" + b"}" + _str(rng) + _value(rng) + b"sb0"
    return b"".join(
        rng.choice([b"N", b"K\x05", b")", b"]", b"}", b"(", b"t", b"R", b"b", b"0", b"\x86"]) for _ in range(5)
    )


def _seeds() -> list[bytes]:
    data = {"a": [1, 2.5, "x", b"y", None], "t": (1, {2}), "o": collections.OrderedDict(k=1)}
    arr = np.array([1, "a", None], dtype=object)
    pt = pt_bytes({"w": torch.ones(2), "step": 3})
    meta = pickle.loads(genuine_metadata())
    return [
        pickle.dumps(meta, protocol=2),
        pickle.dumps(meta),
        pickle.dumps(data, protocol=2),
        pickle.dumps(data, protocol=5),
        pickle.dumps(arr, protocol=2),
        pickle.dumps(np.arange(6.0).reshape(2, 3), protocol=2),
        pt,
    ]


def pt_bytes(obj) -> bytes:
    import io
    import zipfile

    buf = io.BytesIO()
    torch.save(obj, buf)
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as z:
        return z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))


def mutate(rng: random.Random, seed: bytes) -> bytes:
    bounds = [pos for _, _, pos in pickletools.genops(seed)][1:-1]  # between PROTO and STOP
    how = rng.randrange(10)
    if how < 6:  # gadgets at opcode boundaries
        out = seed
        for _ in range(rng.randrange(1, 3)):
            at, g = rng.choice(bounds), gadget(rng)
            out = out[:at] + g + out[at:]
            bounds = [p if p <= at else p + len(g) for p in bounds]
        return out
    if how < 8:  # byte flips
        out = bytearray(seed)
        for _ in range(rng.randrange(1, 4)):
            out[rng.randrange(len(out))] = rng.getrandbits(8)
        return bytes(out)
    if how == 8:
        return seed[: rng.randrange(1, len(seed))]
    return b"\x80\x02" + b"".join(gadget(rng) for _ in range(rng.randrange(1, 4))) + b"N."


def _fuzz(tmp_path, seed: int, cases: int) -> None:
    rng = random.Random(seed)
    seeds = _seeds()
    jobs, sizes = [], {}
    for i in range(cases):
        pkl = mutate(rng, rng.choice(seeds))
        archive = pt_archive(pkl)
        for kind in KINDS:
            data = archive if kind in ("pt", "info", "item") else pkl
            path = tmp_path / f"case{i}-{kind}.{'pt' if kind in ('pt', 'info') else 'pkl'}"
            path.write_bytes(data)
            jobs.append({"kind": kind, "path": str(path)})
            sizes[str(path)] = len(data)
    for job, r in zip(jobs, run_jobs(jobs, headroom=768 * MIB, alarm=10), strict=True):
        assert r["outcome"] in ("ok", "format", *KINDS[job["kind"]]), r
        assert not r["changed"], r
        assert r["grew"] <= 16 * sizes[r["path"]] + 64 * MIB, r


def test_fuzz_unpicklers(tmp_path):
    _fuzz(tmp_path, seed=34, cases=40)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(5))
def test_fuzz_unpicklers_long(tmp_path, seed):
    _fuzz(tmp_path, seed=1000 + seed, cases=400)

"""A fuzzer for files whose bytes are not what their extension says (issue 51, item 8).

Genuine files of each format (.pt zip and legacy, .fpk, .fpk holding a pickle, safetensors, .npy,
plain pickles) and junk, some holding a pickle that creates a marker file if it runs, are given
random prefixes, another format's signature, truncations and flips of their first bytes, and are
loaded under each checkpoint extension (.pt/.pth/.ckpt with and without ``weights_only=False``,
.fpk, .safetensors), from a file and from memory://, and through ``ckptio info`` / ``verify``, in a
capped child (``pickle_workers``). No code ever runs; a file in another format than its name says
fails with a FormatError that names the file and the real format and never advises
``weights_only=False``; a file that is its extension's format loads or fails with that format's
errors (torch's own for a torch file); a load only succeeds for a file of its extension's format.
"""

from __future__ import annotations

import os
import pickle
import random

import numpy as np
import pytest
import torch

import ckptio
from ckptio import fastpickle
from ckptio.formats.sniff import sniff
from pickle_workers import run_jobs
from test_pickle_fuzz import _TORCH_ERRORS

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class Evil:
    marker = ""

    def __reduce__(self):
        return (open, (self.marker, "w"))  # creating the file proves code ran


# an extension's format; what an error names for each format :func:`sniff` tells
FORMAT_OF = {".pt": "torch", ".pth": "torch", ".ckpt": "torch", ".fpk": "fastpickle", ".safetensors": "safetensors"}
NAMED = {
    "torch": "torch.save",
    "fastpickle": "fastpickle",
    "safetensors": "safetensors",
    "npy": "NumPy",
    "pickle": "pickle",
}
SIGNATURES = [b"\x89FPKL\r\n\x1a", b"PK\x03\x04", b"\x93NUMPY", b"\x80\x04\x95", b"\x80\x02\x8a\x0al\xfc\x9cF"]


def _samples(tmp_path) -> list[tuple[str, int, bytes]]:
    """(real format, signature length, bytes) of genuine files; a pickle they hold creates the marker."""
    evil = Evil()
    evil.marker = str(tmp_path / "PWNED")
    state = {"w": torch.arange(6.0), "n": 3}
    p = str(tmp_path / "s")
    ckptio.dump(state, p + ".fpk")
    fastpickle.save({"w": torch.ones(2), "x": evil}, p + "e.fpk", allow_pickle=True)
    ckptio.dump({"w": state["w"]}, p + ".safetensors")
    torch.save(state, p + ".pt")
    torch.save(state, p + "l.pt", _use_new_zipfile_serialization=False)
    np.save(p + ".npy", np.arange(4.0))
    np.save(p + "e.npy", np.array([evil, 1], dtype=object), allow_pickle=True)
    files = [("fastpickle", 8, ".fpk"), ("fastpickle", 8, "e.fpk"), ("safetensors", 10, ".safetensors"),
             ("torch", 4, ".pt"), ("torch", 16, "l.pt"), ("npy", 6, ".npy"), ("npy", 6, "e.npy")]  # fmt: skip
    out = []
    for real, sig, suffix in files:
        with open(p + suffix, "rb") as f:
            out.append((real, sig, f.read()))
    for proto in (2, 4, 5):
        out.append(("pickle", 2, pickle.dumps({"x": evil, "w": [1.0] * 50}, protocol=proto)))
    return out


def _mutate(rng: random.Random, sig: int, data: bytes) -> tuple[bool, bytes]:
    """(whether the real format's signature, its first ``sig`` bytes, is intact; the bytes)."""
    r = rng.random()
    if r < 0.3:
        return True, data
    if r < 0.45:
        return False, rng.randbytes(rng.randrange(1, 17)) + data
    if r < 0.6:  # crafted: another format's signature on these bytes
        return False, rng.choice(SIGNATURES) + data[rng.randrange(0, 9) :]
    if r < 0.8:
        cut = rng.randrange(0, len(data))
        return cut >= sig, data[:cut]
    out, at = bytearray(data), [rng.randrange(0, min(24, len(data))) for _ in range(rng.randrange(1, 4))]
    for i in at:
        out[i] ^= 1 << rng.randrange(8)
    return min(at) >= sig, bytes(out)


def _fuzz(tmp_path, seed: int, cases: int) -> None:
    rng = random.Random(seed)
    samples = _samples(tmp_path)
    jobs, meta = [], []
    for i in range(cases):
        real, sig, data = rng.choice(samples)
        intact, data = _mutate(rng, sig, data)
        found = sniff(data)
        assert not intact or found == real, (real, data[:32])  # an intact signature is told
        ext = rng.choice(list(FORMAT_OF))
        path = str(tmp_path / f"case{i}{ext}")
        with open(path, "wb") as f:
            f.write(data)
        kinds = [("load", {}), ("memory", {}), (rng.choice(["info", "verify"]), None)]
        if FORMAT_OF[ext] == "torch":
            kinds.append((rng.choice(["load", "memory"]), {"weights_only": False}))
            kinds.append(("fileobj", {"weights_only": rng.random() < 0.5}))
        for kind, kw in kinds:
            jobs.append({"kind": kind, "path": path, "kw": kw})
            meta.append((real, found, ext, kind, kw))
    results = run_jobs(jobs, alarm=30)
    assert not (tmp_path / "PWNED").exists(), "a fuzzed file ran code"
    for (real, found, ext, kind, kw), res in zip(meta, results, strict=True):
        what = f"seed {seed}: {real} as {found}, named {ext}, {kind} {kw}: {res['outcome']}: {res['msg'][:600]}"
        own = FORMAT_OF[ext] == found  # bytes of the format the name says (maybe damaged past the signature)
        assert res["grew"] < 256 << 20, what
        if not own:  # refused, naming the file and what it is
            assert res["outcome"] == "format", what
            assert "weights_only" not in res["msg"] and os.path.basename(res["path"]) in res["msg"], what
            if found is not None:
                assert NAMED[found] in res["msg"] and "file_format=" in res["msg"], what
        elif res["outcome"] != "ok":  # its format's own errors (torch's, for a torch file torch reads)
            # torch's (a truncated legacy file: its weights_only unpickler's EOFError, struct.error)
            allowed = (
                (*_TORCH_ERRORS, "EOFError", "error")
                if found == "torch" and kind in ("load", "memory", "fileobj")
                else ()
            )
            assert res["outcome"] in ("format", *allowed), what


def test_wrong_extension_fuzz(tmp_path):
    _fuzz(tmp_path, seed=51, cases=120)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(4))
def test_wrong_extension_fuzz_long(tmp_path, seed):
    _fuzz(tmp_path, seed=1000 + seed, cases=1000)

"""Local reads that are checked as they go: a payload read from a local file (a load that reads,
not maps) or from an incremental step's local blocks is hashed in ``osio.HOT_PIECE`` pieces, each
right after its read. Damage in any piece (the first, a middle one, the short last one) and a cut
anywhere are found and named; the pieces reach the hash in order; and a storage without piecewise
reads (``Backend.readinto_each``'s default) checks the same bytes."""

from __future__ import annotations

import os

import pytest
import torch

import ckptio
import ckptio.fastpickle as fp
from ckptio.backends.base import Backend
from ckptio.checkpointer import Checkpointer
from ckptio.errors import FormatError, IntegrityError
from ckptio.formats.fastpickle.format import load_source
from ckptio.formats.fastpickle.read import FdSource, open_source, with_source
from ckptio.incremental import IncrementalBackend
from ckptio.osio import HOT_PIECE, preadinto_each
from conftest import flip_byte

BIG = 3 * HOT_PIECE + 12345  # four pieces, the last one short


def big_state() -> dict:
    g = torch.Generator().manual_seed(7)
    return {"w": torch.randn(BIG // 4, generator=g), "step": 3}  # one payload, read alone (a run of its own)


def spy(each, pieces: list[int]):
    def counted(piece):
        pieces.append(len(piece))
        return each(piece)

    return counted


def same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k]


@pytest.mark.parametrize("at", [5, HOT_PIECE + 3, 2 * HOT_PIECE + 4096, BIG // 4 * 4 - 2])
@pytest.mark.parametrize("into", [False, True])
def test_damage_in_any_piece_of_a_local_payload_is_found(tmp_path, at, into, monkeypatch):
    pieces: list[int] = []
    read_each = FdSource.read_each
    monkeypatch.setattr(FdSource, "read_each", lambda self, mv, o, each: read_each(self, mv, o, spy(each, pieces)))
    p = str(tmp_path / "s.fpk")
    want = big_state()
    ckptio.dump(want, p)
    target = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else v for k, v in want.items()}
    same(fp.load(p, mmap=False), want)
    w = next(t for t in fp.inspect(p).tensors if t.path == "w")
    assert len(pieces) == 4  # the payload, read in pieces
    flip_byte(p, w.offset + at)
    with pytest.raises(
        IntegrityError, match=rf"checksum mismatch in tensor 'w', bytes \[{w.offset}, {w.offset + w.nbytes}\)"
    ):
        if into:  # what a Checkpointer's load into the caller's tensors does
            with_source(open_source(p, {}), lambda src: load_source(src, into=target))
        else:
            fp.load(p, mmap=False)


def test_a_local_payload_cut_in_a_middle_piece_is_truncated(tmp_path):
    p = str(tmp_path / "s.fpk")
    ckptio.dump(big_state(), p)
    w = next(t for t in fp.inspect(p).tensors if t.path == "w")
    data = open(p, "rb").read()
    cut = str(tmp_path / "cut.fpk")
    with open(cut, "wb") as f:  # the footer and metadata kept: only the payload's middle is missing
        f.write(data[: w.offset + HOT_PIECE + 100])
    with pytest.raises((IntegrityError, FormatError)):
        fp.load(cut, mmap=False)


def test_pieces_reach_the_callback_in_order_and_cover_the_buffer(tmp_path):
    p = tmp_path / "f"
    data = os.urandom(BIG)
    p.write_bytes(data)
    out = memoryview(bytearray(BIG + 10))
    seen: list[bytes] = []
    fd = os.open(p, os.O_RDONLY)
    try:
        n = preadinto_each(fd, out, 0, lambda piece: seen.append(bytes(piece)))
        assert n == BIG and b"".join(seen) == data and all(len(s) <= HOT_PIECE for s in seen)
        seen.clear()
        n = preadinto_each(fd, out[:HOT_PIECE], BIG - 100, lambda piece: seen.append(bytes(piece)))
        assert n == 100 and seen == [data[-100:]]  # the end of the file: short, handed on once
    finally:
        os.close(fd)


def test_the_default_readinto_each_hands_on_what_it_read_once(memory_uri):
    backend, uri = ckptio.resolve(memory_uri + "/obj")
    backend.write(uri, b"abcdef")
    seen: list[bytes] = []
    buf = bytearray(10)
    assert Backend.readinto_each(backend, uri, buf, 2, lambda m: seen.append(bytes(m))) == 4
    assert seen == [b"cdef"]


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_damage_in_any_piece_of_a_local_block_is_named(tmp_path, where, monkeypatch):
    """A restore hashes a step's local blocks in pieces, for the payload checksums; damage anywhere in
    a block fails it, naming the block (read again with its own hash)."""
    pieces: list[int] = []
    read_each = IncrementalBackend.readinto_each
    monkeypatch.setattr(
        IncrementalBackend, "readinto_each", lambda self, u, b, o, each: read_each(self, u, b, o, spy(each, pieces))
    )
    root = str(tmp_path / "r")
    ck = Checkpointer(root, format="fpk", incremental=True)
    want = big_state()
    ck.save(1, want)
    target = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else v for k, v in want.items()}
    ck.load(target, step=1)
    same(target, want)
    assert sum(n == HOT_PIECE for n in pieces) >= 3  # the big payload's blocks, in pieces
    content = os.path.join(root, ".content")
    blocks = sorted((os.path.join(d, f) for d, _, fs in os.walk(content) for f in fs), key=os.path.getsize)
    victim = blocks[-1]
    size = os.path.getsize(victim)
    assert size > 2 * HOT_PIECE
    flip_byte(victim, {"first": 10, "middle": size // 2, "last": size - 3}[where])
    with pytest.raises(IntegrityError, match=os.path.basename(victim)):
        ck.load(target, step=1)

"""The benchmark's workload: a seeded, transformer-shaped dict of fp32 tensors, and helpers to touch,
compare, pack and unpack it (shared by the benchmarks in this package)."""

from __future__ import annotations

import os
from typing import Any

import torch

# the directory that holds the ckptio package: child processes put it first on sys.path to import this copy
SOURCE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def make_state(size: int) -> dict[str, torch.Tensor]:
    """A flat dict of transformer-shaped fp32 tensors (qkv, out, mlp up/down, two norms per layer) and
    an embedding row that brings the total to ``size`` bytes exactly (rounded down to 4 bytes), so a
    run asked for 8 MiB moves 8 MiB."""
    layers = 8 if size >= 8 * 2**20 else 2
    h = max(8, int((size / (4 * 12 * layers)) ** 0.5 / 8) * 8)
    g = torch.Generator().manual_seed(0)
    state: dict[str, torch.Tensor] = {}
    for i in range(layers):
        p = f"layers.{i}."
        for name, shape in (
            ("attn.qkv.weight", (3 * h, h)),
            ("attn.out.weight", (h, h)),
            ("mlp.up.weight", (4 * h, h)),
            ("mlp.down.weight", (h, 4 * h)),
            ("norm1.weight", (h,)),
            ("norm2.weight", (h,)),
        ):
            state[p + name] = torch.randn(shape, generator=g)
    rest = (size - nbytes(state)) // 4
    if rest > 0:
        state["embed.weight"] = torch.randn(rest, generator=g)
    return state


def nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def touch(obj: Any) -> None:
    """Fault in every page of every tensor (loads that map files lazily pay their read here)."""
    if isinstance(obj, torch.Tensor):
        if obj.numel():
            u8 = obj.detach().reshape(-1).view(torch.uint8)
            int(u8[::4096].sum())
    elif isinstance(obj, dict):
        for v in obj.values():
            touch(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            touch(v)


def same(a: dict[str, torch.Tensor], b: Any) -> bool:
    return isinstance(b, dict) and set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def u8(t: torch.Tensor) -> memoryview:
    # numpy's stubs give ndarray __buffer__ (the buffer protocol) on Python 3.12+ only
    return memoryview(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]


def pack(state: dict[str, torch.Tensor]) -> bytearray:
    """The tensor bytes back to back in one buffer (what a raw write stores)."""
    buf, pos = bytearray(nbytes(state)), 0
    for t in state.values():
        mv = u8(t)
        buf[pos : pos + len(mv)] = mv
        pos += len(mv)
    return buf


def unpack(ref: dict[str, torch.Tensor], data: Any) -> dict[str, torch.Tensor]:
    """Fresh tensors shaped like ``ref`` filled from ``pack``ed bytes."""
    data, out, pos = memoryview(data).cast("B"), {}, 0
    for k, v in ref.items():
        t = torch.empty_like(v)
        mv = u8(t)
        mv[:] = data[pos : pos + len(mv)]
        pos += len(mv)
        out[k] = t
    return out


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

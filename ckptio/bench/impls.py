"""What ``ckptio bench`` measures: ckptio's formats and the baselines people use today, as
:class:`Impl` (a save and a load) for each kind of storage. safetensors is optional: without it
that baseline is left out and :func:`local_baselines` says so in its ``missing`` list."""

from __future__ import annotations

import io
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

import ckptio
from ckptio import uri as _uri

from .workload import fsync_path, pack, u8, unpack


@dataclass
class Impl:
    name: str
    baseline: bool
    suffix: str  # appended to the target path ("" for directories)
    save: Callable[[dict, str], None]
    load: Callable[[dict, str], Any]  # (reference state for shapes, target) -> loaded state
    note: str = ""


def template(ref: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.empty_like(v) for k, v in ref.items()}


def ckptio_impls(has_fpk: bool, has_dcp: bool) -> list[Impl]:
    out = []
    if has_fpk:
        out.append(Impl("ckptio .fpk", False, ".fpk", lambda s, u: ckptio.dump(s, u), lambda r, u: ckptio.load(u)))
    out.append(Impl("ckptio .pt", False, ".pt", lambda s, u: ckptio.dump(s, u), lambda r, u: ckptio.load(u)))
    if has_dcp:
        from ckptio import dcp

        def dsave(s: dict, u: str) -> None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                dcp.save(s, u)

        def dload(r: dict, u: str) -> dict:
            t = template(r)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                dcp.load(t, u)
            return t

        out.append(Impl("ckptio DCP", False, "", dsave, dload))
    return out


def local_baselines() -> list[Impl]:
    def tsave(s: dict, p: str) -> None:
        torch.save(s, p)
        fsync_path(p)

    def rsave(s: dict, p: str) -> None:
        with open(p, "wb", buffering=0) as f:
            for t in s.values():
                f.write(u8(t))
            os.fsync(f.fileno())

    def rload(r: dict, p: str) -> dict:
        out = {}
        with open(p, "rb", buffering=0) as f:
            for k, v in r.items():
                t = torch.empty_like(v)
                f.readinto(u8(t))
                out[k] = t
        return out

    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

    def dsave(s: dict, p: str) -> None:
        import torch.distributed.checkpoint as tdcp

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tdcp.save(s, storage_writer=FileSystemWriter(p, thread_count=2))

    def dload(r: dict, p: str) -> dict:
        import torch.distributed.checkpoint as tdcp

        t = template(r)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tdcp.load(t, storage_reader=FileSystemReader(p))
        return t

    out = [
        Impl(
            "torch.save/load",
            True,
            ".pt",
            tsave,
            lambda r, p: torch.load(p, weights_only=True),
            "torch.save + fsync; torch.load(weights_only=True)",
        ),
        Impl(
            "raw write/read",
            True,
            ".raw",
            rsave,
            rload,
            "sequential write of the tensor bytes + fsync; readinto fresh tensors",
        ),
    ]
    try:
        import safetensors.torch as st

        def ssave(s: dict, p: str) -> None:
            st.save_file(s, p)
            fsync_path(p)

        out.append(
            Impl(
                "safetensors",
                True,
                ".safetensors",
                ssave,
                lambda r, p: st.load_file(p),
                "save_file + fsync; load_file (pages touched)",
            )
        )
    except ImportError:
        pass
    out.append(Impl("torch DCP FileSystemWriter", True, "", dsave, dload, "thread_count=2, sync_files=True"))
    return out


def memory_baselines() -> list[Impl]:
    store: dict[str, Any] = {}

    def tsave(s: dict, u: str) -> None:
        b = io.BytesIO()
        torch.save(s, b)
        store[u] = b

    def tload(r: dict, u: str) -> dict:
        b = store.pop(u)
        b.seek(0)
        return torch.load(b, weights_only=True)

    def msave(s: dict, u: str) -> None:
        store[u] = pack(s)

    return [
        Impl("torch.save/load BytesIO", True, ".pt", tsave, tload),
        Impl(
            "raw memcpy",
            True,
            ".raw",
            msave,
            lambda r, u: unpack(r, store.pop(u)),
            "copy of the tensor bytes into one buffer and back",
        ),
    ]


def fsspec_baselines(fs: Any, protocol: str, storage_options: dict) -> list[Impl]:
    """Baselines through a raw fsspec filesystem (s3fs / gcsfs) on the same server."""

    def path(u: str) -> str:
        return _uri.split(u)[1]

    def rsave(s: dict, u: str) -> None:
        with fs.open(path(u), "wb") as f:
            for t in s.values():
                f.write(u8(t))

    def rload(r: dict, u: str) -> dict:
        return unpack(r, fs.cat_file(path(u)))

    def tsave(s: dict, u: str) -> None:
        with fs.open(path(u), "wb") as f:
            torch.save(s, f)

    def tload(r: dict, u: str) -> dict:
        with fs.open(path(u), "rb") as f:
            return torch.load(f, weights_only=True)

    def dsave(s: dict, u: str) -> None:
        import torch.distributed.checkpoint as tdcp

        from ckptio.torch_internals import FsspecWriter

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tdcp.save(s, storage_writer=FsspecWriter(f"{protocol}://{path(u)}", thread_count=2, **storage_options))

    def dload(r: dict, u: str) -> dict:
        import torch.distributed.checkpoint as tdcp

        from ckptio.torch_internals import FsspecReader

        t = template(r)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tdcp.load(t, storage_reader=FsspecReader(f"{protocol}://{path(u)}", **storage_options))
        return t

    lib = type(fs).__module__.split(".")[0]
    return [
        Impl(f"raw {lib}", True, ".raw", rsave, rload, f"{lib} open('wb') of the tensor bytes; cat_file"),
        Impl(f"torch.save via {lib}", True, ".pt", tsave, tload, f"torch.save/torch.load on a {lib} file"),
        Impl("torch DCP FsspecWriter", True, "", dsave, dload, "thread_count=2"),
    ]


def backend_raw_baseline() -> Impl:
    """For user URIs: the storage's own speed for the same bytes, through ckptio's backend (no serialization)."""
    return Impl(
        "raw put/get",
        True,
        ".raw",
        lambda s, u: ckptio.put(pack(s), u),
        lambda r, u: unpack(r, ckptio.get(u)),
        "one ckptio.put/get of the tensor bytes",
    )

"""The peers users pick instead of ckptio for S3, as ``ckptio bench`` baselines on the same server:
AWS s3torchconnector's ``S3Checkpoint`` (torch.save/torch.load through its CRT client) and its DCP
``S3StorageWriter``/``S3StorageReader``, and s3fs's single PUT of ``torch.save`` bytes.

s3torchconnector is the optional ``peers`` extra (``pip install 'ckptio[peers]'``); without it (or
without its ``dcp`` extra) :func:`s3_peers` leaves those baselines out and says so in its notes.
Its CRT client signs with the credentials of the environment: each of its calls runs inside
:func:`crt_credentials` (the embedded server's test credentials, the previous values put back after),
so nothing else in the run (a ``--uri`` of the user's own bucket) sees them.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import warnings
from collections.abc import Callable, Iterator
from typing import IO, Any, cast

import torch

from ckptio import uri as _uri

from .impls import Impl, template

PEERS_HINT = "pip install 'ckptio[peers]'"
REGION = "us-east-1"
_PUT_CHUNK = 5 * 2**30 // 2  # s3fs puts below 2 x chunksize in one request: one PUT up to S3's 5 GB limit


@contextlib.contextmanager
def crt_credentials(key: str, secret: str) -> Iterator[None]:
    """Set ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY`` (the CRT client's only way in besides a
    profile) for the block, then restore what was there."""
    names = {"AWS_ACCESS_KEY_ID": key, "AWS_SECRET_ACCESS_KEY": secret}
    old = {k: os.environ.get(k) for k in (*names, "AWS_SESSION_TOKEN")}
    os.environ.update(names)
    os.environ.pop("AWS_SESSION_TOKEN", None)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def s3fs_put_baseline(fs: Any) -> Impl:
    """torch.save into bytes, one s3fs ``pipe_file`` (a single PUT); cat_file + torch.load back."""

    def save(s: dict, u: str) -> None:
        b = io.BytesIO()
        torch.save(s, b)
        fs.pipe_file(_uri.split(u)[1], b.getvalue(), chunksize=_PUT_CHUNK)

    def load(r: dict, u: str) -> Any:
        return torch.load(io.BytesIO(fs.cat_file(_uri.split(u)[1])), weights_only=True)

    return Impl(
        "s3fs pipe_file(torch.save)", True, ".pt", save, load, "torch.save to bytes, one PUT; cat_file + torch.load"
    )


def _with_credentials(fn: Callable[[dict, str], Any], creds: tuple[str, str]) -> Callable[[dict, str], Any]:
    def call(s: dict, u: str) -> Any:
        with crt_credentials(*creds):
            return fn(s, u)

    return call


def s3_peers(endpoint: str, key: str, secret: str) -> tuple[list[Impl], list[dict[str, str]]]:
    """s3torchconnector's baselines against the S3 server at ``endpoint`` (credentials ``key``,
    ``secret``), and notes for those left out."""
    impls, notes = _s3torchconnector(endpoint)
    for i in impls:
        i.save, i.load = _with_credentials(i.save, (key, secret)), _with_credentials(i.load, (key, secret))
    return impls, notes


def _s3torchconnector(endpoint: str) -> tuple[list[Impl], list[dict[str, str]]]:
    if importlib.util.find_spec("s3torchconnector") is None:
        why = f"baseline left out: the s3torchconnector package is not installed ({PEERS_HINT})"
        return [], [{"impl": "s3torchconnector", "reason": why}]
    from s3torchconnector import S3Checkpoint, S3ClientConfig

    config = S3ClientConfig(force_path_style=True)  # a loopback endpoint has no bucket subdomains
    ckpt = S3Checkpoint(region=REGION, endpoint=endpoint, s3client_config=config)

    def save(s: dict, u: str) -> None:
        with ckpt.writer(u) as w:
            torch.save(s, w)

    def load(r: dict, u: str) -> Any:
        with ckpt.reader(u) as f:
            return torch.load(cast(IO[bytes], f), weights_only=True)  # an io.BufferedIOBase

    impls = [Impl("s3torchconnector S3Checkpoint", True, ".pt", save, load, "torch.save/torch.load on its CRT streams")]
    notes = []
    try:
        from s3torchconnector._s3client import S3Client
        from s3torchconnector.dcp import S3FileSystem, S3StorageReader, S3StorageWriter
    except ImportError as e:
        why = f"baseline left out: s3torchconnector.dcp cannot be imported ({e}): {PEERS_HINT}"
        notes.append({"impl": "s3torchconnector DCP", "reason": why})
        return impls, notes

    def fs(reader_constructor: Any = None) -> Any:
        # the DCP classes take no endpoint: their file system gets a client that has one
        client = S3Client(REGION, endpoint=endpoint, s3client_config=config)
        return S3FileSystem(REGION, s3_client=client, reader_constructor=reader_constructor)

    def dsave(s: dict, u: str) -> None:
        import torch.distributed.checkpoint as tdcp

        w = S3StorageWriter(REGION, u, s3client_config=config, thread_count=2)
        w.fs = fs()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tdcp.save(s, storage_writer=w)

    def dload(r: dict, u: str) -> dict:
        import torch.distributed.checkpoint as tdcp

        rd = S3StorageReader(REGION, u, s3client_config=config)
        rd.fs = fs(rd._reader_constructor)  # the reader's ranges are planned on this constructor
        t = template(r)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tdcp.load(t, storage_reader=rd)
        return t

    impls.append(
        Impl("s3torchconnector DCP", True, "", dsave, dload, "S3StorageWriter(thread_count=2) / S3StorageReader")
    )
    return impls, notes

"""torch.distributed.checkpoint (DCP) on every ckptio URI, with a crash-safe commit: the public API.

:class:`StorageWriter` and :class:`StorageReader` subclass torch's ``StorageWriter`` /
``StorageReader`` directly, so torch's planners, resharding and ``async_save`` staging work
unchanged. They do not go through ``FileSystemBase``: that seam commits by write-then-rename
(copy + delete on object stores), serializes every tensor with ``torch.save`` (CRC32 over every
byte) and loads each item through ``torch.load`` on a stream. Here each data object is one
streaming :meth:`Backend.open_writer`, the metadata is one create-only write, and loads are
ranged reads straight into the destination tensors.

The package, by responsibility:

* :mod:`~ckptio.dcp.layout`: object names, constants, the per-item ``ckptio`` record;
* :mod:`~ckptio.dcp.zipframe`: the ``torch.save`` zip framing written around each tensor;
* :mod:`~ckptio.dcp.writer`: :class:`StorageWriter` and its memory budget;
* :mod:`~ckptio.dcp.reader`: :class:`StorageReader`, ranged and coalesced reads;
* :mod:`~ckptio.dcp.metadata`: the restricted ``.metadata`` unpickler, data object name checks,
  and the commit protocol (commit, uncommit, :func:`discard`, :func:`is_complete`);
* :mod:`~ckptio.dcp.checks`: what the reader checks before reading (nothing runs, nothing huge
  is allocated);
* :mod:`~ckptio.dcp.inspection`: :func:`inspect` and :func:`verify` (``ckptio info``/``verify``);
* :mod:`~ckptio.dcp.quiet`: torch's DCP log records skipped while nothing receives them.

The functions below wrap torch's ``dcp.save``/``load``/``async_save`` and raise the failed rank's
error instead of torch's ``CheckpointException`` (:func:`surface_error`).
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import dataclasses
import os
import warnings
from collections.abc import Iterator
from typing import Any

from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlanner, SavePlanner

from ..context import resolve  # noqa: F401 - kept importable as ckptio.dcp.resolve
from ..errors import CkptioError
from .inspection import inspect, verify
from .layout import CHECKSUM_BLOCK, DATA_SUFFIX, DCP_VERSION, FORMAT_VERSION, METADATA_NAME, note
from .metadata import discard, is_complete, loads_metadata
from .quiet import quiet_dcp_log
from .reader import StorageReader
from .writer import StorageWriter

__all__ = [
    "StorageWriter",
    "StorageReader",
    "save",
    "load",
    "async_save",
    "is_complete",
    "discard",
    "loads_metadata",
    "surface_error",
    "inspect",
    "verify",
    "METADATA_NAME",
    "DATA_SUFFIX",
    "DCP_VERSION",
    "CHECKSUM_BLOCK",
    "FORMAT_VERSION",
]


# ---------------------------------------------------------------------------------------------
# conveniences
#
# torch's dcp.save/load raise CheckpointException, a BaseException (``except Exception`` misses it)
# holding each failed rank's exception. StorageWriter/StorageReader used with torch's own functions
# keep that behaviour; the functions below (and Checkpointer) raise the underlying error instead.


def surface_error(
    exc: CheckpointException, action: str, uri: str | os.PathLike, metadata_error: BaseException | None = None
) -> BaseException:
    """The exception to raise instead of torch's ``CheckpointException`` ``exc`` (kept as its ``__cause__``).

    The failure of the lowest failed rank that is a ckptio error or an ``OSError`` (or a
    ``KeyboardInterrupt``-like ``BaseException``) is re-raised with a note naming the rank; any
    other failure becomes a :class:`CkptioError` listing every rank's error.
    ``metadata_error``: what the reader's ``read_metadata`` raised, which torch's load reports
    only as an ``AssertionError`` ("metadata is None").
    """
    failures = sorted(((r, x) for r, (x, _tb) in exc.failures.items()), key=lambda f: f[0])
    summary = "; ".join(f"rank {r}: {type(x).__name__}: {x}" for r, x in failures[:4]) or str(exc)
    if len(failures) > 4:
        summary += f"; and {len(failures) - 4} more ranks"
    where = f"ckptio.dcp: {action} of {os.fspath(uri)}"
    for r, x in failures:
        if isinstance(x, AssertionError) and metadata_error is not None:
            x = metadata_error
        if isinstance(x, (CkptioError, OSError)) or not isinstance(x, Exception):
            others = f" (all failures: {summary})" if len(failures) > 1 else ""
            note(x, f"{where} failed on rank {r}{others}")
            x.__cause__ = exc
            return x
    err = CkptioError(f"{where} failed: {summary}")
    err.__cause__ = exc
    return err


def _surfaced(fut: cf.Future, uri: str | os.PathLike) -> cf.Future:
    out: cf.Future = cf.Future()

    def done(f: cf.Future) -> None:
        try:
            out.set_result(f.result())
        except CheckpointException as e:
            out.set_exception(surface_error(e, "save", uri))
        except BaseException as e:  # noqa: BLE001 - handed on through the future
            out.set_exception(e)

    fut.add_done_callback(done)
    return out


@contextlib.contextmanager
def _single_process() -> Iterator[None]:
    """torch warns on every save/load without ``torch.distributed`` that it "assumes the intent is to save
    (load) in a single process": through ckptio that is the documented use, so the warning is skipped then
    (only then, and only that one)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_SINGLE_PROCESS, category=UserWarning)
        yield


_SINGLE_PROCESS = r"torch\.distributed is (disabled, )?unavailable or uninitialized, assuming the intent is to"


def save(
    state_dict: dict[str, Any],
    uri: str | os.PathLike,
    *,
    planner: SavePlanner | None = None,
    process_group: Any = None,
    **options: Any,
) -> Metadata:
    """``torch.distributed.checkpoint.save`` to ``uri`` with a :class:`StorageWriter` built from ``options``.

    Failures raise the failed rank's ckptio error or ``OSError`` (see :func:`surface_error`), not
    torch's ``CheckpointException``.
    """
    import torch.distributed.checkpoint as dcp

    writer = StorageWriter(uri, **options)
    try:
        with quiet_dcp_log(), _single_process():
            return dcp.save(state_dict, storage_writer=writer, planner=planner, process_group=process_group)
    except CheckpointException as e:
        raise surface_error(e, "save", uri) from e


def async_save(
    state_dict: dict[str, Any],
    uri: str | os.PathLike,
    *,
    planner: SavePlanner | None = None,
    process_group: Any = None,
    **options: Any,
):
    """``torch.distributed.checkpoint.async_save`` to ``uri``; returns torch's future (or its
    ``AsyncSaveResponse``) whose upload fails with the errors :func:`save` raises."""
    import torch.distributed.checkpoint as dcp

    try:
        with quiet_dcp_log(), _single_process():  # the staging part; the upload runs on in torch's thread
            res = dcp.async_save(
                state_dict, storage_writer=StorageWriter(uri, **options), planner=planner, process_group=process_group
            )
    except CheckpointException as e:
        raise surface_error(e, "save", uri) from e
    if isinstance(res, cf.Future):
        return _surfaced(res, uri)
    return dataclasses.replace(res, upload_completion=_surfaced(res.upload_completion, uri))


def load(
    state_dict: dict[str, Any],
    uri: str | os.PathLike,
    *,
    planner: LoadPlanner | None = None,
    process_group: Any = None,
    storage_reader: StorageReader | None = None,
    **options: Any,
) -> None:
    """``torch.distributed.checkpoint.load`` from ``uri`` into ``state_dict`` (in place), through
    ``storage_reader`` if given (one made for ``uri`` from ``options`` else).

    Failures raise as for :func:`save` (a missing ``.metadata``: :class:`IncompleteCheckpointError`).
    """
    import torch.distributed.checkpoint as dcp

    if storage_reader is not None and options:
        raise TypeError(f"load(): options {sorted(options)} go to the StorageReader; pass them there")
    reader = StorageReader(uri, **options) if storage_reader is None else storage_reader
    try:
        with quiet_dcp_log(), _single_process():
            dcp.load(state_dict, storage_reader=reader, planner=planner, process_group=process_group)
    except CheckpointException as e:
        raise surface_error(e, "load", uri, reader.metadata_error) from e

"""The on-disk names and constants of ckptio's DCP layout, and the small pieces the writer and the reader share.

Layout (compatible with torch's ``FileSystemWriter``/``FileSystemReader`` both ways)::

    <uri>/__<rank>_<n>.<attempt>.distcp   items back to back; a tensor item is a torch.save zip archive
    <uri>/.metadata                       pickled ``Metadata``: the commit marker, written last

``<attempt>`` (16 hex digits) is chosen by the coordinator for each save and shipped to every rank
in its plan (:class:`Prefix`), so a save never writes a name that another save's ``.metadata``
refers to. Readers follow the names recorded in ``.metadata`` (torch's reader too), so checkpoints
written by torch or by older ckptio (``__<rank>_<n>.distcp``) load unchanged.

Every item's storage entry (torch's ``_StorageInfo``) carries an extra :data:`INFO_ATTR` attribute
(torch's readers ignore it): data offset, dtype, shape and xxh3-64 checksums per block of
:data:`CHECKSUM_BLOCK` bytes.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch
import xxhash

from .. import uri as _uri
from ..backends.base import Backend
from ..context import resolve
from ..dcp_names import DATA_SUFFIX as DATA_SUFFIX
from ..dcp_names import METADATA_NAME as METADATA_NAME
from ..errors import note  # noqa: F401  # re-exported: the dcp modules import it from here

DCP_VERSION = "1.0.0"  # torch.distributed.checkpoint.filesystem.CURRENT_DCP_VERSION
CHECKSUM_BLOCK = 8 * 1024 * 1024  # bytes per xxh3-64 checksum inside a tensor
FORMAT_VERSION = 1
INFO_ATTR = "ckptio"  # extra attribute on torch's _StorageInfo; torch's reader ignores it


def merge_backend_options(part_size: int | None, concurrency: int | None, options: dict[str, Any]) -> dict[str, Any]:
    opts = dict(options)
    if part_size is not None:
        opts["part_size"] = int(part_size)
    if concurrency is not None:
        opts["concurrency"] = int(concurrency)
    return opts


def metadata_name(rank: int | None, use_collectives: bool) -> str:
    return METADATA_NAME if use_collectives or rank is None else f"__{rank}{METADATA_NAME}"


def uint8_view(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous CPU tensor (shares memory)."""
    return t.reshape(-1).view(torch.uint8)


def block_hashes(mv: memoryview, start: int, block: int) -> list[int]:
    """xxh3-64 of each ``block``-sized piece of ``mv``, which begins at byte ``start`` (a block boundary)."""
    if start % block:
        raise ValueError("checksum ranges must start on a block boundary")
    if not len(mv):
        return [xxhash.xxh3_64_intdigest(b"")]
    return [xxhash.xxh3_64_intdigest(mv[i : i + block]) for i in range(0, len(mv), block)]


class AtURI:
    """What the writer and the reader share: the checkpoint URI, its backend and paths under it."""

    _options: dict[str, Any]
    _given: Backend | None = None

    def _set_uri(self, uri: str | os.PathLike) -> None:
        """``backend``: where the data objects are; ``data_backend``: the backend they are written and
        read through (a wrapper of ``backend`` given by the caller, e.g. the Checkpointer's
        :class:`~ckptio.incremental.IncrementalBackend`, else ``backend`` itself). ``.metadata``
        always goes through ``backend``."""
        self.uri = os.fspath(uri)
        self.backend, self.root = resolve(self.uri, **self._options)
        self.data_backend = self._given if self._given is not None else self.backend

    @property
    def checkpoint_id(self) -> str:
        return self.uri

    def _path(self, name: str) -> str:
        return _uri.join_path(self.root, name)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        try:
            resolve(checkpoint_id)
        except Exception:
            return False
        return True


@dataclasses.dataclass
class Prefix:
    """A rank's data object names: ``<prefix><n>.<attempt>.distcp`` (shipped to the rank in its plan)."""

    prefix: str
    attempt: str = ""

    def name(self, n: int) -> str:
        return f"{self.prefix}{n}.{self.attempt}{DATA_SUFFIX}" if self.attempt else f"{self.prefix}{n}{DATA_SUFFIX}"

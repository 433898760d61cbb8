"""torch.distributed.checkpoint (DCP) on every ckptio URI, with a crash-safe commit.

:class:`StorageWriter` and :class:`StorageReader` subclass torch's ``StorageWriter`` /
``StorageReader`` directly, so torch's planners, resharding and ``async_save`` staging work
unchanged. They do not go through ``FileSystemBase``: that seam commits by write-then-rename
(copy + delete on object stores), serializes every tensor with ``torch.save`` (CRC32 over every
byte) and loads each item through ``torch.load`` on a stream. Here each data object is one
streaming :meth:`Backend.open_writer`, the metadata is one create-only write, and loads are
ranged reads straight into the destination tensors.

Layout (compatible with torch's ``FileSystemWriter``/``FileSystemReader`` both ways)::

    <uri>/__<rank>_<n>.<attempt>.distcp   items back to back; a tensor item is a torch.save zip archive
    <uri>/.metadata                       pickled ``Metadata``: the commit marker, written last

``<attempt>`` (16 hex digits) is chosen by the coordinator for each save and shipped to every rank
in its plan, so a save never writes a name that another save's ``.metadata`` refers to. Readers
follow the names recorded in ``.metadata`` (torch's reader too), so checkpoints written by torch or
by older ckptio (``__<rank>_<n>.distcp``) load unchanged.

``.metadata`` is read with a restricted unpickler (:func:`loads_metadata`) that builds only the
classes DCP metadata contains; anything else is refused with a :class:`FormatError`, so a crafted
``.metadata`` cannot run code. Every data object name in it must be a relative path inside the
checkpoint (no empty, ``.`` or ``..`` segment, no leading ``/``, backslash, NUL or ``scheme://``,
not a ``.metadata``; on local disk it must not leave the directory through a symlink), else
reading, verifying or replacing it stops with a :class:`FormatError` naming the entry.

The reader runs no code from the data objects either and allocates nothing from a number in
``.metadata`` before checking it against the stored bytes (:mod:`ckptio.dcp_checks` gives the
rules and the reasoning): a non-tensor item, which the planner unpickles with
``torch.load(weights_only=False)``, must first load with ``torch.load(weights_only=True)`` (or be a
plain ``io.BytesIO``) unless ``allow_pickle=True``; every storage entry a load reads must lie inside
its data object (one ``stat`` per object) without overlapping another.

Each tensor item is written as an uncompressed zip that ``torch.load`` reads (zip CRC fields are
zero, as with ``torch.serialization.set_crc32_options(False)``), with the tensor bytes at a
known offset, so a load reads only the tensor bytes it needs. Every item's
``_StorageInfo`` carries an extra ``ckptio`` attribute (torch's readers ignore it): data
offset, dtype, shape and xxh3-64 checksums per block of ``CHECKSUM_BLOCK`` bytes.

Commit protocol:
1. the coordinator, in ``prepare_global_plan`` (before any rank receives its plan, so before any
   data object is touched), picks the attempt id and refuses an existing ``.metadata`` unless
   ``overwrite=True``, in which case it reads it (to know the data objects it refers to) and
   deletes it;
2. every rank streams its data objects under this attempt's names; each is committed (and
   fsynced where local) before ``write_data`` returns; a rank that fails deletes the ones it wrote;
3. the coordinator writes ``.metadata`` with ``mode="create"``. If another save committed first,
   this save deletes its own data objects and raises :class:`AlreadyExistsError`. Either way, a
   save that removed a ``.metadata`` in step 1 then deletes the data objects that one referred to
   (nothing refers to them any more); a concurrent save's data objects are never touched.
A crash at any point leaves either the old complete checkpoint or a directory without
``.metadata``, which :func:`is_complete` reports as incomplete and the reader refuses. Data objects
of a crashed save stay until the directory is deleted: nothing tells them from a save still running.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import dataclasses
import io
import os
import pickle
import struct
import threading
import uuid
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, cast

import torch
import xxhash
from torch.distributed.checkpoint import storage as _storage
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from . import uri as _uri
from .backends.base import Backend, BytesReader
from .backends.local import LocalBackend, ensure_inside
from .context import resolve
from .dcp_checks import box_problem, entry_problem, pickle_problem, tensor_problem, zip_problem
from .errors import (
    AccessDeniedError,
    AlreadyExistsError,
    CkptioError,
    FormatError,
    IncompleteCheckpointError,
    IntegrityError,
)

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
    "METADATA_NAME",
]

METADATA_NAME = ".metadata"
DATA_SUFFIX = ".distcp"
DCP_VERSION = "1.0.0"  # torch.distributed.checkpoint.filesystem.CURRENT_DCP_VERSION
CHECKSUM_BLOCK = 8 * 1024 * 1024  # bytes per xxh3-64 checksum inside a tensor
FORMAT_VERSION = 1
_INFO_ATTR = "ckptio"  # extra attribute on torch's _StorageInfo; torch's reader ignores it
_COALESCE_MAX = 1024 * 1024  # ranges below this are merged with their neighbours into one read
_COALESCE_GAP = 64 * 1024


# ---------------------------------------------------------------------------------------------
# helpers shared by writer and reader


def _backend_options(part_size: int | None, concurrency: int | None, options: dict[str, Any]) -> dict[str, Any]:
    opts = dict(options)
    if part_size is not None:
        opts["part_size"] = int(part_size)
    if concurrency is not None:
        opts["concurrency"] = int(concurrency)
    return opts


def _metadata_name(rank: int | None, use_collectives: bool) -> str:
    return METADATA_NAME if use_collectives or rank is None else f"__{rank}{METADATA_NAME}"


def is_complete(uri: str | os.PathLike, **backend_options: Any) -> bool:
    """Whether ``uri`` holds a committed DCP checkpoint (its ``.metadata`` exists)."""
    backend, root = resolve(uri, **backend_options)
    return backend.isfile(_uri.join_path(root, METADATA_NAME))


def discard(uri: str | os.PathLike, **backend_options: Any) -> None:
    """Uncommit the DCP checkpoint at ``uri`` (delete its ``.metadata``), then delete the data objects it referred to.

    Nothing else under ``uri`` is touched: data objects of another save of ``uri``, maybe still being
    written, stay. Without a ``.metadata`` this does nothing.
    """
    backend, root = resolve(uri, **backend_options)
    failed = _delete_objects(backend, _uncommit(backend, root, _uri.join_path(root, METADATA_NAME)))
    if failed:
        raise CkptioError(f"uncommitted {os.fspath(uri)!r} but could not delete its data objects: {'; '.join(failed)}")


def _note(e: BaseException, text: str) -> None:
    if hasattr(e, "add_note"):
        e.add_note(text)
    else:  # Python 3.10
        e.__notes__ = [*getattr(e, "__notes__", []), text]  # type: ignore[attr-defined]


def _delete_objects(backend: Backend, uris: Iterable[str]) -> list[str]:
    """Delete each object (one already gone is fine); returns "URI (error)" for each that could not be deleted."""
    failed = []
    for u in uris:
        try:
            backend.delete(u)
        except FileNotFoundError:
            pass
        except Exception as e:  # noqa: BLE001 - reported by every caller
            failed.append(f"{u} ({type(e).__name__}: {e})")
    return failed


# What a DCP ``.metadata`` legitimately contains (torch's FileSystemWriter/FsspecWriter and ckptio's
# writer): the metadata dataclasses, torch.Size, dtypes, layouts (pickled as
# ``torch.serialization._get_layout(name)``), the path torch keeps as checkpoint_id, and containers.
# ckptio's per-item ``ckptio`` attribute holds only plain dicts, lists, ints and strings.
_METADATA_CLASSES: dict[str, frozenset[str]] = {
    "torch.distributed.checkpoint.metadata": frozenset(
        {
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorProperties",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "_MEM_FORMAT_ENCODING",
        }
    ),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    "torch": frozenset({"Size"}),
    "torch.serialization": frozenset({"_get_layout"}),
    "pathlib": frozenset({"Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath"}),
    "collections": frozenset({"OrderedDict"}),
    "builtins": frozenset({"set", "frozenset"}),
}


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file: Any, uri: str) -> None:
        super().__init__(file)
        self._uri = uri

    def find_class(self, module: str, name: str) -> Any:
        if name in _METADATA_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)  # dtypes pickle as the global torch.<name>
        raise FormatError(
            f"{self._uri}: DCP metadata refers to {module}.{name}, which DCP metadata never "
            f"contains; refusing to unpickle it (the file may be crafted to run code)"
        )

    def persistent_load(self, pid: Any) -> Any:
        raise FormatError(f"{self._uri}: DCP metadata holds a persistent reference; refusing to unpickle it")


def loads_metadata(data: bytes | bytearray | memoryview, uri: str = METADATA_NAME) -> Metadata:
    """Unpickle a DCP ``.metadata`` (``uri`` names it in errors), building only DCP metadata classes.

    Raises :class:`FormatError` for any other class (nothing is executed) and for malformed data.
    """
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data), uri).load()
    except FormatError:
        raise
    except Exception as e:  # UnpicklingError, EOFError, a bad enum value, ...
        raise FormatError(f"{uri}: not readable DCP metadata ({type(e).__name__}: {e})") from e
    if not isinstance(metadata, Metadata):
        raise FormatError(f"{uri}: not DCP metadata (holds a {type(metadata).__name__})")
    return metadata


def _name_problem(name: Any) -> str | None:
    """Why ``name`` (a data object name from ``.metadata``) is not a plain relative path; None when it is one."""
    if not isinstance(name, str):
        return f"is a {type(name).__name__}, not a relative path"
    if not name:
        return "is empty"
    for char, what in (("\x00", "a NUL byte"), ("\\", "a backslash")):
        if char in name:
            return f"contains {what}"
    if _uri.scheme_of(name):
        return "is a URI, not a relative path"
    if name.startswith("/"):
        return "is an absolute path"
    segments = name.split("/")
    if any(seg in ("", ".", "..") for seg in segments):
        return "has an empty, '.' or '..' path segment"
    if segments[-1].lower().endswith(METADATA_NAME):
        return "names a metadata file, not a data object"
    return None


def _data_objects(metadata: Metadata, backend: Backend, root: str, meta_uri: str) -> dict[str, str]:
    """Each data object name ``metadata`` refers to -> its URI inside the checkpoint at ``root``.

    A name that is not a plain relative path, or that leaves ``root`` through a symlink (local
    disk), raises :class:`FormatError` naming ``meta_uri`` and the entry.
    """
    storage = metadata.storage_data if metadata.storage_data is not None else {}
    if not isinstance(storage, dict):
        raise FormatError(f"{meta_uri}: storage_data is a {type(storage).__name__}, not a dict: not DCP metadata")
    out: dict[str, str] = {}
    for index, sinfo in storage.items():
        name: Any = getattr(sinfo, "relative_path", None)  # untrusted: checked by _name_problem
        if isinstance(name, str) and name in out:
            continue
        why = _name_problem(name)
        if why is None:
            try:
                ensure_inside(backend, root, _uri.join_path(root, name))
            except AccessDeniedError:
                why = "leaves the checkpoint through a symlink"
        if why is not None:
            raise FormatError(
                f"{meta_uri}: the storage entry of item {getattr(index, 'fqn', index)!r} names the data "
                f"object {name!r}, which {why}; refusing to use it (only names inside the checkpoint "
                f"are followed: the metadata is corrupt or crafted)"
            )
        out[name] = _uri.join_path(root, name)
    return out


def _uncommit(backend: Backend, root: str, meta: str) -> list[str]:
    """Delete the ``.metadata`` at ``meta``; returns the data objects it referred to.

    None when another save removed it first, or when it is unreadable or names objects outside the
    checkpoint (only the marker goes then: its names are not trusted)."""
    try:
        objects = list(_data_objects(loads_metadata(backend.read(meta), meta), backend, root, meta).values())
    except FileNotFoundError:
        return []
    except FormatError:
        objects = []
    try:
        backend.delete(meta)
    except FileNotFoundError:  # a concurrent overwrite deleted it first: its data objects are that save's to delete
        return []
    return objects


def _uint8(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous CPU tensor (shares memory)."""
    return t.reshape(-1).view(torch.uint8)


def _block_hashes(mv: memoryview, start: int, block: int) -> list[int]:
    """xxh3-64 of each ``block``-sized piece of ``mv``, which begins at byte ``start`` (a block boundary)."""
    if start % block:
        raise ValueError("checksum ranges must start on a block boundary")
    if not len(mv):
        return [xxhash.xxh3_64_intdigest(b"")]
    return [xxhash.xxh3_64_intdigest(mv[i : i + block]) for i in range(0, len(mv), block)]


# ---------------------------------------------------------------------------------------------
# torch.save-compatible archive framing for one tensor, written without touching the data


class _StorageRef:
    pass


class _Rebuild:
    def __init__(self, ref: _StorageRef, shape: tuple[int, ...], stride: tuple[int, ...]) -> None:
        self.args: tuple[Any, ...] = (ref, 0, shape, stride, False, collections.OrderedDict())

    def __reduce__(self):  # the same reduction torch.Tensor uses
        return (torch._utils._rebuild_tensor_v2, self.args)


def _storage_type(dtype: torch.dtype):
    return getattr(torch, torch.storage._dtype_to_storage_type_map()[dtype])


def _pickle_tensor(dtype: torch.dtype, shape: tuple[int, ...], numel: int) -> bytes:
    ref = _StorageRef()
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= max(s, 1)
    stride.reverse()

    class _P(pickle.Pickler):
        def persistent_id(self, obj):
            if obj is ref:
                return ("storage", _storage_type(dtype), "0", "cpu", numel)
            return None

    buf = io.BytesIO()
    _P(buf, protocol=2).dump(_Rebuild(ref, tuple(shape), tuple(stride)))
    return buf.getvalue()


_ALIGN = 64
_U32 = 0xFFFFFFFF


class _ZipFraming:
    """Header and trailer bytes of a stored (uncompressed) zip around one tensor's bytes."""

    def __init__(self, dtype: torch.dtype, shape: tuple[int, ...], nbytes: int) -> None:
        numel = 1
        for s in shape:
            numel *= s
        records: list[tuple[str, bytes | int]] = [
            ("archive/data.pkl", _pickle_tensor(dtype, shape, numel)),
            ("archive/.format_version", b"1"),
            ("archive/.storage_alignment", str(_ALIGN).encode()),
            ("archive/byteorder", b"little"),
            ("archive/data/0", nbytes),  # the tensor itself, streamed by the caller
            ("archive/version", b"3\n"),
            ("archive/.data/serialization_id", uuid.uuid4().hex.encode().ljust(40, b"0")),
        ]
        head, tail = bytearray(), bytearray()
        central = bytearray()
        pos = 0
        zip64 = False
        self.data_offset = -1
        for name, payload in records:
            size = payload if isinstance(payload, int) else len(payload)
            out = head if self.data_offset < 0 else tail
            local, big = self._local_header(name.encode(), size, pos)
            zip64 |= big or pos >= _U32
            out += local
            if isinstance(payload, int):
                self.data_offset = pos + len(local)
            else:
                out += payload
            central += self._central_header(name.encode(), size, pos)
            pos += len(local) + size
        cd_offset, cd_size = pos, len(central)
        tail += central
        n = len(records)
        if zip64 or cd_offset >= _U32:
            z64 = cd_offset + cd_size
            tail += struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 45, 45, 0, 0, n, n, cd_size, cd_offset)
            tail += struct.pack("<IIQI", 0x07064B50, 0, z64, 1)
            tail += struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, n, n, min(cd_size, _U32), _U32, 0)
        else:
            tail += struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, n, n, cd_size, cd_offset, 0)
        self.head, self.tail = bytes(head), bytes(tail)
        self.total = len(self.head) + nbytes + len(self.tail)

    @staticmethod
    def _local_header(name: bytes, size: int, pos: int) -> tuple[bytes, bool]:
        big = size >= _U32
        extra = struct.pack("<HHQQ", 1, 16, size, size) if big else b""
        fixed = 30 + len(name) + len(extra)
        pad = (-(pos + fixed + 4)) % _ALIGN  # "FB" padding field, like torch, aligns the data
        extra += struct.pack("<HH", 0x4246, pad) + b"Z" * pad
        s32 = _U32 if big else size
        hdr = struct.pack(
            "<IHHHHHIIIHH", 0x04034B50, 45 if big else 20, 0, 0, 0, 0x21, 0, s32, s32, len(name), len(extra)
        )
        return hdr + name + extra, big

    @staticmethod
    def _central_header(name: bytes, size: int, pos: int) -> bytes:
        vals: list[int] = []
        s32 = size
        if size >= _U32:
            s32 = _U32
            vals += [size, size]
        off32 = pos
        if pos >= _U32:
            off32 = _U32
            vals.append(pos)
        extra = struct.pack("<HH" + "Q" * len(vals), 1, 8 * len(vals), *vals) if vals else b""
        hdr = struct.pack(
            "<IHHHHHHIIIHHHHHII",
            0x02014B50,
            45,
            45 if vals else 20,
            0,
            0,
            0,
            0x21,
            0,
            s32,
            s32,
            len(name),
            len(extra),
            0,
            0,
            0,
            0,
            off32,
        )
        return hdr + name + extra


# ---------------------------------------------------------------------------------------------
# writer


def _item_nbytes(item: WriteItem) -> int:
    if item.tensor_data is None:
        return 0
    n = torch._utils._element_size(item.tensor_data.properties.dtype)
    for s in item.tensor_data.size:
        n *= s
    return n


def _split(items: Sequence[WriteItem], bins: int) -> list[list[WriteItem]]:
    """Items into at most ``bins`` groups of similar byte size (one data object per group)."""
    bins = max(1, min(bins, len(items)))
    groups: list[list[WriteItem]] = [[] for _ in range(bins)]
    sizes = [0] * bins
    for i, it in enumerate(x for x in items if x.type == WriteItemType.BYTE_IO):
        groups[i % bins].append(it)
    for it in sorted((x for x in items if x.type != WriteItemType.BYTE_IO), key=_item_nbytes, reverse=True):
        j = min(range(bins), key=sizes.__getitem__)
        groups[j].append(it)
        sizes[j] += _item_nbytes(it)
    return [g for g in groups if g]


def _tensor_chunks(t: torch.Tensor, max_bytes: int) -> Iterator[memoryview]:
    """The bytes of ``t`` in row-major order, as memoryviews; copies only non-contiguous or non-CPU slabs."""
    t = t.detach()
    if t.is_cpu and t.is_contiguous():
        if t.numel():
            yield memoryview(_uint8(t).numpy())  # type: ignore[arg-type]  # numpy's stubs: ndarray.__buffer__ on 3.12+ only
        return
    if t.dim() == 0 or t.numel() == 0:
        if t.numel():
            yield memoryview(_uint8(t.cpu().contiguous()).numpy())  # type: ignore[arg-type]  # numpy's stubs: ndarray.__buffer__ on 3.12+ only
        return
    row = max(1, t[0].numel() * t.element_size())
    step = max(1, max_bytes // row)
    for i in range(0, t.shape[0], step):
        yield memoryview(_uint8(t[i : i + step].to("cpu").contiguous()).numpy())  # type: ignore[arg-type]  # numpy's stubs: ndarray.__buffer__ on 3.12+ only


class _AtURI:
    """What the writer and the reader share: the checkpoint URI, its backend and paths under it."""

    _options: dict[str, Any]

    def _set_uri(self, uri: str | os.PathLike) -> None:
        self.uri = os.fspath(uri)
        self.backend, self.root = resolve(self.uri, **self._options)

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
class _Prefix:
    """A rank's data object names: ``<prefix><n>.<attempt>.distcp``."""

    prefix: str
    attempt: str = ""

    def name(self, n: int) -> str:
        return f"{self.prefix}{n}.{self.attempt}{DATA_SUFFIX}" if self.attempt else f"{self.prefix}{n}{DATA_SUFFIX}"


class StorageWriter(_AtURI, _storage.StorageWriter):
    """Write a DCP checkpoint to any ckptio URI.

    ``thread_count`` data objects per rank are written concurrently (each streamed with bounded
    memory by its backend writer); ``part_size``/``concurrency`` go to the backend (multipart part
    size and parallel parts per object); ``overwrite`` allows replacing a committed checkpoint;
    ``checksums=False`` skips recording checksums; ``durable=False`` skips fsync on local
    storage; ``max_buffer_bytes`` caps upload buffers on object stores (default max(64 MiB,
    10% of the rank's payload)) by lowering objects and parts in flight. Other keyword arguments
    are backend options (as for :func:`ckptio.resolve`).
    """

    def __init__(
        self,
        uri: str | os.PathLike,
        *,
        thread_count: int = 4,
        part_size: int | None = None,
        concurrency: int | None = None,
        overwrite: bool = False,
        checksums: bool = True,
        durable: bool = True,
        max_buffer_bytes: int | None = None,
        **backend_options: Any,
    ) -> None:
        super().__init__()
        self.max_buffer_bytes = max_buffer_bytes
        if int(thread_count) < 1:
            raise ValueError(f"thread_count must be >= 1, got {thread_count!r}")
        self.thread_count = int(thread_count)
        self.overwrite = bool(overwrite)
        self.checksums = bool(checksums)
        self.durable = bool(durable)
        self._options = _backend_options(part_size, concurrency, backend_options)
        self._set_uri(uri)
        self.save_id = uuid.uuid4().hex
        self.rank: int | None = None
        self.is_coordinator = False
        self.use_collectives = True
        self._replaced: list[str] = []  # data objects of the checkpoint this save replaces (coordinator)

    # ---- the StorageWriter protocol --------------------------------------------------------
    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id:
            self._set_uri(checkpoint_id)
        self.save_id = uuid.uuid4().hex
        self._replaced = []

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        self.rank = kwargs.get("rank")
        self.use_collectives = kwargs.get("use_collectives", True)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.uri, save_id=self.save_id)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        if not self.use_collectives and self.rank is not None:
            plan = dataclasses.replace(plan, storage_data=_Prefix(f"__{self.rank}_"))
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        # Runs on the coordinator before any rank gets its plan, hence before any data is written.
        meta = self._path(_metadata_name(self.rank, self.use_collectives))
        self._replaced = []
        if self.backend.isfile(meta):
            if not self.overwrite:
                raise AlreadyExistsError(
                    meta, f"a complete checkpoint already exists at {self.uri!r}; pass overwrite=True to replace it"
                )
            self._replaced = _uncommit(self.backend, self.root, meta)  # deleted after the commit attempt
        attempt = uuid.uuid4().hex[:16]  # this save's data object names: no other save writes or deletes them
        return [
            dataclasses.replace(
                p, storage_data=_Prefix(p.storage_data.prefix if p.storage_data is not None else f"__{i}_", attempt)
            )
            for i, p in enumerate(plans)
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        groups = _split(plan.items, self.thread_count)
        cancel = threading.Event()
        jobs = [(plan.storage_data.name(n), g) for n, g in enumerate(groups)]
        results: list[WriteResult] = []
        workers = self._bound_memory(sum(_item_nbytes(i) for i in plan.items), len(jobs))
        try:
            if workers <= 1:
                for name, g in jobs:
                    results += self._write_object(name, g, planner, cancel)
            else:
                with cf.ThreadPoolExecutor(workers, thread_name_prefix="ckptio-dcp-write") as pool:
                    futs = [pool.submit(self._write_object, name, g, planner, cancel) for name, g in jobs]
                    try:
                        for f in futs:
                            results += f.result()
                    except BaseException:
                        cancel.set()
                        raise
        except BaseException as e:  # this save will not commit: its objects are debris (names only it uses)
            failed = _delete_objects(self.backend, [self._path(name) for name, _ in jobs])
            if failed:
                _note(e, f"ckptio.dcp: could not delete this save's data objects: {'; '.join(failed)}")
            raise
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def _bound_memory(self, payload: int, objects: int) -> int:
        """Objects to write at once, and the write backend's parts in flight, within the memory budget.

        Backends with a ``max_buffer_bytes`` option (S3, GCS) get a share of the budget each; other
        object-store writers buffer about ``(concurrency + 1) * part_size`` per object (and the
        client may copy each part in flight once more); local files are written straight from
        tensor memory. The budget is ``max_buffer_bytes``, by default max(64 MiB, payload / 10).
        """
        self._write_backend = self.backend
        if isinstance(self.backend, LocalBackend) or objects == 0:
            return objects
        budget = self.max_buffer_bytes or max(64 << 20, payload // 10)
        if hasattr(self.backend, "max_buffer_bytes"):
            # Object-store writers bound their own copies by ``max_buffer_bytes`` and upload large
            # tensor writes straight from tensor memory: split the budget over the objects in flight
            # and keep each writer's full part concurrency.
            workers = max(1, min(objects, self.thread_count))
            share = max(1, budget // workers)
            if "max_buffer_bytes" not in self._options and share != self.backend.max_buffer_bytes:
                self._write_backend, _ = resolve(self.uri, **{**self._options, "max_buffer_bytes": share})
            return workers
        part = self.backend.part_size
        per_part = 2 * part  # the part buffer plus the client's copy of it
        parts = max(1, budget // per_part)  # parts this rank may hold at once
        workers = max(1, min(objects, parts // 2))
        concurrency = self.backend.concurrency
        if "concurrency" not in self._options:
            concurrency = max(1, min(concurrency, parts // workers - 1))
            if concurrency != self.backend.concurrency:
                self._write_backend, _ = resolve(self.uri, **{**self._options, "concurrency": concurrency})
        return workers

    def _write_object(
        self, name: str, items: list[WriteItem], planner: SavePlanner, cancel: threading.Event
    ) -> list[WriteResult]:
        uri = self._path(name)
        results: list[WriteResult] = []
        item: WriteItem | None = None
        chunk = 8 << 20  # largest staging copy for a non-contiguous or non-CPU tensor
        try:
            with self._write_backend.open_writer(uri, mode="overwrite", durable=self.durable) as w:
                offset = 0
                for item in items:
                    if cancel.is_set():
                        raise RuntimeError(f"cancelled: another data object of this rank failed ({uri})")
                    data = planner.resolve_data(item)
                    info: dict[str, Any] = {"v": FORMAT_VERSION}
                    if item.type == WriteItemType.BYTE_IO:
                        buf = data.getbuffer() if isinstance(data, io.BytesIO) else memoryview(data)  # type: ignore[arg-type]  # a bytes-like object
                        w.write(buf)
                        length = len(buf)
                        if self.checksums:
                            info["xxh3"] = [xxhash.xxh3_64_intdigest(buf)]
                            info["block"] = max(length, 1)
                        del buf
                    else:
                        t = cast(torch.Tensor, data).detach()  # a tensor item resolves to a tensor
                        nbytes = t.numel() * t.element_size()
                        z = _ZipFraming(t.dtype, tuple(t.shape), nbytes)
                        w.write(z.head)
                        hashes: list[int] = []
                        h = xxhash.xxh3_64() if self.checksums else None
                        filled = 0
                        for mv in _tensor_chunks(t, chunk):
                            w.write_borrowed(mv)  # tensors stay unchanged until write_data returns
                            if h is not None:  # block hashes over a stream of arbitrary-size pieces
                                pos = 0
                                while pos < len(mv):
                                    take = min(len(mv) - pos, CHECKSUM_BLOCK - filled)
                                    h.update(mv[pos : pos + take])
                                    pos, filled = pos + take, filled + take
                                    if filled == CHECKSUM_BLOCK:
                                        hashes.append(h.intdigest())
                                        h.reset()
                                        filled = 0
                        if h is not None and (filled or not hashes):
                            hashes.append(h.intdigest())
                        w.write(z.tail)
                        length = z.total
                        info.update(
                            data=z.data_offset,
                            nbytes=nbytes,
                            dtype=str(t.dtype).removeprefix("torch."),
                            shape=list(t.shape),
                        )
                        if self.checksums:
                            info["xxh3"], info["block"] = hashes, CHECKSUM_BLOCK
                    sinfo = _StorageInfo(name, offset, length)
                    setattr(sinfo, _INFO_ATTR, info)
                    results.append(WriteResult(index=item.index, size_in_bytes=length, storage_data=sinfo))
                    offset += length
        except Exception as e:
            what = f"item {item.index.fqn!r}" if item is not None else "opening"
            _note(e, f"ckptio.dcp: rank {self.rank}: writing data object {uri} ({what}) failed")
            raise
        return results

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        metadata.version = DCP_VERSION
        metadata.storage_data = {wr.index: wr.storage_data for rank in results for wr in rank}
        metadata.storage_meta = self.storage_meta()
        meta = self._path(_metadata_name(self.rank, self.use_collectives))
        data = pickle.dumps(metadata, protocol=pickle.HIGHEST_PROTOCOL)
        own = {self._path(sinfo.relative_path) for sinfo in metadata.storage_data.values()}
        # the data objects of the .metadata this save removed: nothing refers to them any more
        replaced, self._replaced = [u for u in self._replaced if u not in own], []
        try:
            self.backend.write(meta, data, mode="create", durable=True)  # the commit
        except FileExistsError as e:
            err = AlreadyExistsError(
                meta, f"another save committed {self.uri!r} while this one was writing; this save is discarded"
            )
            failed = _delete_objects(self.backend, [*sorted(own), *replaced])
            if failed:
                _note(err, f"ckptio.dcp: could not delete data objects nothing refers to: {'; '.join(failed)}")
            raise err from e
        failed = _delete_objects(self.backend, replaced)
        if failed:
            warnings.warn(
                f"ckptio.dcp: saved {self.uri!r}, but could not delete data objects of the checkpoint it "
                f"replaced: {'; '.join(failed)}",
                stacklevel=2,
            )


# ---------------------------------------------------------------------------------------------
# reader


@dataclasses.dataclass
class _Unit:
    """One item to load, once its byte ranges have arrived."""

    req: ReadItem
    obj: str  # data object URI
    finish: Callable[[], None]
    futures: list[cf.Future] = dataclasses.field(default_factory=list)
    temp_bytes: int = 0


def _copy_into(planner: LoadPlanner, req: ReadItem, dest: torch.Tensor, src: torch.Tensor, where: str) -> None:
    """Copy a stored tensor into the planner's destination and commit it, refusing a shape mismatch."""
    if dest.size() != src.size():
        raise IntegrityError(
            f"{where}: stored shape {tuple(src.shape)} does not match the destination {tuple(dest.shape)}"
        )
    dest.copy_(src)
    planner.commit_tensor(req, dest)


def _contiguous_span(shape: Sequence[int], offsets: Sequence[int], lengths: Sequence[int]) -> tuple[int, int] | None:
    """Element range ``[start, stop)`` of a sub-box in a row-major array, if the box is contiguous there."""
    d = 0
    while d < len(shape) and lengths[d] == 1:
        d += 1
    if any(lengths[i] != shape[i] for i in range(d + 1, len(shape))):
        return None
    start, stride = 0, 1
    for i in reversed(range(len(shape))):
        start += offsets[i] * stride
        stride *= shape[i]
    count = 1
    for n in lengths:
        count *= n
    return start, start + count


class StorageReader(_AtURI, _storage.StorageReader):
    """Read a DCP checkpoint (ckptio's or torch's ``FileSystemWriter``/``FsspecWriter`` layout) from any URI.

    Reads are ranged: only the bytes of the requested items (widened to checksum blocks when
    ``verify``) are fetched, in ``part_size`` pieces, ``thread_count`` at a time (default: the
    backend's ``concurrency``, at least 4), straight into
    the destination tensors when they match the stored layout. ``verify=False`` skips checksums.
    Non-tensor items reach the planner (whose ``load_bytes`` unpickles them) only when they are
    plain data, else a :class:`FormatError` names the item; ``allow_pickle=True`` skips that check
    for checkpoints you trust. Offsets and sizes from ``.metadata`` are checked against the stored
    data before anything is allocated (see :mod:`ckptio.dcp_checks`).
    """

    def __init__(
        self,
        uri: str | os.PathLike,
        *,
        verify: bool = True,
        thread_count: int | None = None,
        part_size: int | None = None,
        concurrency: int | None = None,
        allow_pickle: bool = False,
        **backend_options: Any,
    ) -> None:
        super().__init__()
        if thread_count is not None and int(thread_count) < 1:
            raise ValueError(f"thread_count must be >= 1, got {thread_count!r}")
        self.verify = bool(verify)
        self.allow_pickle = bool(allow_pickle)
        self._options = _backend_options(part_size, concurrency, backend_options)
        self._set_uri(uri)
        # ranged requests in flight; by default as many as the backend runs per object (at least 4)
        self.thread_count = int(thread_count) if thread_count is not None else max(4, self.backend.concurrency)
        self.storage_data: dict[MetadataIndex, Any] = {}
        self.load_id = uuid.uuid4().hex
        self.rank: int | None = None
        self._metadata_error: BaseException | None = None  # torch's load reports it only as "metadata is None"
        self._meta_uri = self._path(METADATA_NAME)
        self._objects: dict[str, str] = {}  # data object name in the metadata -> URI, checked to be inside
        self._sizes: dict[str, int] = {}  # data object URI -> its size (one stat each)
        self._metadata: Metadata | None = None

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        self.storage_data = {}
        self._objects = {}
        self._sizes = {}
        self._metadata = None
        self._metadata_error = None
        if checkpoint_id:
            self._set_uri(checkpoint_id)
        self._meta_uri = self._path(METADATA_NAME)
        self.load_id = uuid.uuid4().hex

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        try:
            metadata = self._read_metadata(self._path(_metadata_name(rank, rank is None)))
        except Exception as e:
            if rank is None:
                self._metadata_error = e
            raise
        storage_meta = getattr(metadata, "storage_meta", None) or StorageMeta()
        storage_meta.load_id = self.load_id
        metadata.storage_meta = storage_meta
        return metadata

    def _read_metadata(self, meta: str) -> Metadata:
        try:
            data = self.backend.read(meta)
        except FileNotFoundError:
            if self.backend.isdir(self.root):
                raise IncompleteCheckpointError(
                    f"checkpoint {self.uri!r} is incomplete: it has no {_uri.basename(meta)} (the save was "
                    f"interrupted or is still running)"
                ) from None
            raise
        metadata = loads_metadata(data, meta)
        _data_objects(metadata, self.backend, self.root, meta)  # refuse names outside the checkpoint up front
        self._meta_uri = meta
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if metadata.storage_data is None:
            raise IncompleteCheckpointError(f"checkpoint {self.uri!r}: metadata has no storage_data")
        self._objects = _data_objects(metadata, self.backend, self.root, self._meta_uri)
        self.storage_data = metadata.storage_data
        self._metadata, self._sizes = metadata, {}
        self.rank = kwargs.get("rank")

    # ---- checks before anything is allocated (see ckptio.dcp_checks) -------------------------
    def _malformed(self, index: MetadataIndex, why: str, obj: str | None = None) -> FormatError:
        where = obj or self._meta_uri
        return FormatError(
            f"{where}: item {index.fqn!r} (offset {list(index.offset or [])}) {why}: the "
            f"checkpoint's {METADATA_NAME} is corrupt or crafted; nothing was loaded"
        )

    def _check_entries(self, entries: dict[MetadataIndex, bool]) -> None:
        """Check the storage entries ``entries`` (index -> holds a tensor) before any of them is read.

        Each must be sound (:func:`entry_problem`), lie inside its data object (one ``stat`` per
        object) and overlap no other entry of the batch: a crafted ``.metadata`` can then make a
        load allocate no more than the data objects hold.
        """
        by_object: dict[str, list[tuple[int, int, MetadataIndex]]] = {}
        for index, tensor in entries.items():
            sinfo = self.storage_data.get(index)
            if sinfo is None:
                raise self._malformed(index, "has no storage entry")
            why = entry_problem(sinfo, tensor, CHECKSUM_BLOCK)
            if why is not None:
                raise self._malformed(index, why, self._objects.get(sinfo.relative_path))
            by_object.setdefault(self._objects[sinfo.relative_path], []).append(
                (sinfo.offset, sinfo.offset + sinfo.length, index)
            )
        for obj, spans in by_object.items():
            if obj not in self._sizes:
                self._sizes[obj] = self.backend.stat(obj).size
            size, end, last = self._sizes[obj], 0, None
            for start, stop, index in sorted(spans, key=lambda s: s[:2]):
                if stop > size:
                    raise IntegrityError(
                        f"{obj} is truncated, or the checkpoint's {METADATA_NAME} is corrupt or "
                        f"crafted: item {index.fqn!r} has bytes [{start}, {stop}), past its end "
                        f"({size} bytes); nothing was loaded"
                    )
                if start < end and last is not None:
                    raise self._malformed(
                        index, f"has bytes [{start}, {stop}), which overlap those of item {last.fqn!r}", obj
                    )
                if stop > end:
                    end, last = stop, index

    def _check_plan(self, plan: LoadPlan) -> None:
        self._check_entries({req.storage_index: req.type != LoadItemType.BYTE_IO for req in plan.items})
        for req in plan.items:
            sinfo = self.storage_data[req.storage_index]
            info = getattr(sinfo, _INFO_ATTR, None)
            if (
                req.type != LoadItemType.BYTE_IO
                and info is not None
                and not getattr(sinfo, "transform_descriptors", None)
            ):
                why = box_problem(info["shape"], tuple(req.storage_offsets), tuple(req.lengths))
                if why is not None:
                    raise self._malformed(req.storage_index, f"is read at {why}", self._objects[sinfo.relative_path])

    def check_tensors(self, fqns: Iterable[str]) -> None:
        """Refuse, with a :class:`FormatError`, any tensor in ``fqns`` whose size in the metadata is not
        backed by stored bytes; call it (after ``set_up_storage_reader``) before allocating such
        tensors from the metadata, as the Checkpointer does for entries its state lacks."""
        if self._metadata is None:
            raise RuntimeError("check_tensors needs set_up_storage_reader first")
        entries: dict[MetadataIndex, bool] = {}
        for fqn in fqns:
            why, indices = tensor_problem(fqn, self._metadata.state_dict_metadata.get(fqn), self.storage_data)
            if why is not None:
                raise self._malformed(MetadataIndex(fqn), why)
            entries.update(dict.fromkeys(indices, True))
        self._check_entries(entries)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    # ---- reading ---------------------------------------------------------------------------
    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        piece = self.backend.part_size
        window = max(4 * piece * self.thread_count, 256 << 20)  # temp bytes allowed in flight
        pending: collections.deque[_Unit] = collections.deque()
        temp_in_flight = 0
        small: dict[str, list[tuple[int, int, memoryview, _Unit]]] = {}

        self._check_plan(plan)
        with cf.ThreadPoolExecutor(self.thread_count, thread_name_prefix="ckptio-dcp-read") as pool:

            def fetch(unit: _Unit, obj: str, start: int, target: memoryview) -> None:
                n = len(target)
                if n < _COALESCE_MAX:
                    small.setdefault(obj, []).append((start, start + n, target, unit))
                    return
                for off in range(0, n, piece):
                    unit.futures.append(pool.submit(self._read_exact, obj, start + off, target[off : off + piece]))

            def drain(limit: int) -> None:
                nonlocal temp_in_flight
                while pending and (temp_in_flight > limit or limit < 0):
                    u = pending.popleft()
                    for f in u.futures:
                        f.result()
                    u.finish()
                    temp_in_flight -= u.temp_bytes

            try:
                for req in sorted(plan.items, key=self._order):
                    unit = self._plan_item(req, planner, fetch)
                    pending.append(unit)
                    temp_in_flight += unit.temp_bytes
                    if temp_in_flight > window:
                        self._submit_small(pool, small)
                        drain(window // 2)
                self._submit_small(pool, small)
                drain(-1)
            except BaseException:
                for u in pending:
                    for f in u.futures:
                        f.cancel()
                raise
        fut: Future = Future()
        fut.set_result(None)
        return fut

    def _order(self, req: ReadItem) -> tuple[str, int]:
        s = self.storage_data[req.storage_index]
        return (s.relative_path, s.offset)

    def _read_exact(self, obj: str, start: int, target: memoryview) -> None:
        n = self.backend.readinto(obj, target, start)
        if n != len(target):
            raise IntegrityError(
                f"data object {obj} is truncated: wanted bytes [{start}, {start + len(target)}), got {n}"
            )

    def _submit_small(self, pool: cf.ThreadPoolExecutor, small: dict[str, list]) -> None:
        """Coalesce nearby small ranges of each object into single reads, then scatter into their targets."""
        for obj, ranges in small.items():
            ranges.sort(key=lambda r: r[0])
            groups: list[list] = []
            for r in ranges:
                if (
                    groups
                    and r[0] - groups[-1][-1][1] <= _COALESCE_GAP
                    and r[1] - groups[-1][0][0] <= 4 * _COALESCE_MAX
                ):
                    groups[-1].append(r)
                else:
                    groups.append([r])
            for g in groups:
                start, stop = g[0][0], max(r[1] for r in g)
                f = pool.submit(self._read_scatter, obj, start, stop, [(a, b, t) for a, b, t, _ in g])
                for *_, unit in g:
                    unit.futures.append(f)
        small.clear()

    def _read_scatter(self, obj: str, start: int, stop: int, parts: list[tuple[int, int, memoryview]]) -> None:
        if len(parts) == 1:
            return self._read_exact(obj, start, parts[0][2])
        buf = bytearray(stop - start)
        self._read_exact(obj, start, memoryview(buf))
        for a, b, t in parts:
            t[:] = buf[a - start : b - start]

    def _plan_item(self, req: ReadItem, planner: LoadPlanner, fetch: Callable) -> _Unit:
        sinfo = self.storage_data[req.storage_index]
        obj = self._objects[sinfo.relative_path]
        info = getattr(sinfo, _INFO_ATTR, None)
        what = f"item {req.storage_index.fqn!r} (offset {list(req.storage_index.offset or [])})"
        if info is None or getattr(sinfo, "transform_descriptors", None):
            return self._plan_foreign(req, planner, sinfo, obj, fetch)
        hashes = info.get("xxh3") if self.verify else None
        block = info.get("block", CHECKSUM_BLOCK)

        def check(mv: memoryview, start: int) -> None:
            if hashes is None:
                return
            got = _block_hashes(mv, start, block)
            first = start // block
            for i, h in enumerate(got):
                if hashes[first + i] != h:
                    raise IntegrityError(
                        f"checksum mismatch in {obj}, {what}, bytes [{start + i * block}, "
                        f"{min(start + (i + 1) * block, start + len(mv))}) of its data: the checkpoint is corrupt"
                    )

        if req.type == LoadItemType.BYTE_IO:
            buf = bytearray(sinfo.length)
            unit = _Unit(req, obj, lambda: None, temp_bytes=len(buf))

            def finish_bytes() -> None:
                check(memoryview(buf), 0)
                self._load_bytes(req, planner, buf, obj)

            unit.finish = finish_bytes
            fetch(unit, obj, sinfo.offset, memoryview(buf))
            return unit

        dtype = getattr(torch, info["dtype"])
        shape = tuple(info["shape"])
        esize = torch._utils._element_size(dtype)
        nbytes = info["nbytes"]
        base = sinfo.offset + info["data"]
        dest = planner.resolve_tensor(req).detach()
        span = _contiguous_span(shape, req.storage_offsets, req.lengths)
        a, b = (span[0] * esize, span[1] * esize) if span is not None else (0, nbytes)
        lo, hi = a, b
        if hashes is not None:  # widen to whole checksum blocks
            lo, hi = (a // block) * block, min(nbytes, -(-b // block) * block)
        direct = (
            lo == a
            and hi == b
            and span is not None
            and dest.is_cpu
            and dest.is_contiguous()
            and dest.dtype == dtype
            and dest.numel() * esize == b - a
        )
        if direct:
            target = _uint8(dest)
            unit = _Unit(req, obj, lambda: None)
        else:
            target = torch.empty(hi - lo, dtype=torch.uint8)
            unit = _Unit(req, obj, lambda: None, temp_bytes=hi - lo)

        def finish_tensor() -> None:
            check(memoryview(target.numpy()), lo)  # type: ignore[arg-type]  # numpy's stubs: ndarray.__buffer__ on 3.12+ only
            if direct:
                planner.commit_tensor(req, dest)
                return
            raw = target[a - lo : b - lo].view(dtype)
            if span is not None:
                src = raw.view(tuple(req.lengths))
            else:
                src = raw.view(shape)
                for d, (o, n) in enumerate(zip(req.storage_offsets, req.lengths, strict=True)):
                    src = src.narrow(d, o, n)
            _copy_into(planner, req, dest, src, f"{obj}, {what}")

        unit.finish = finish_tensor
        if hi > lo:
            fetch(unit, obj, base + lo, memoryview(target.numpy()))  # type: ignore[arg-type]  # numpy's stubs: ndarray.__buffer__ on 3.12+ only
        return unit

    def _load_bytes(self, req: ReadItem, planner: LoadPlanner, data: Any, obj: str) -> None:
        """Hand the non-tensor item ``data`` to the planner, which unpickles it: refused unless it is plain data."""
        why = None if self.allow_pickle else zip_problem(data) or pickle_problem(data)
        if why is not None:
            raise FormatError(
                f"checkpoint {self.uri!r}: the non-tensor item {req.storage_index.fqn!r} ({obj}) {why}; "
                f"ckptio unpickles only plain data by default (other pickles can run code from the "
                f"file). If you trust the checkpoint, load it with allow_pickle=True"
            )
        planner.load_bytes(req, io.BytesIO(data))

    def _plan_foreign(self, req: ReadItem, planner: LoadPlanner, sinfo: Any, obj: str, fetch: Callable) -> _Unit:
        """An item written by torch's writers: one ranged read of the item, then torch's own decoding."""
        buf = torch.empty(sinfo.length, dtype=torch.uint8)
        unit = _Unit(req, obj, lambda: None, temp_bytes=sinfo.length)

        def finish() -> None:
            stream: Any = BytesReader(buf.numpy(), obj)  # type: ignore[arg-type]  # an ndarray is bytes-like
            descriptors = getattr(sinfo, "transform_descriptors", None)
            if descriptors:
                from torch.distributed.checkpoint.filesystem import _StorageReaderTransforms

                stream = _StorageReaderTransforms().transform_load_stream(req, descriptors, stream)
                if not stream.seekable():
                    stream = io.BytesIO(stream.read())
            if req.type == LoadItemType.BYTE_IO:
                self._load_bytes(req, planner, stream.read(), obj)
                return
            from torch.distributed._shard._utils import narrow_tensor_by_index

            why = zip_problem(buf.numpy()) if not descriptors else None
            if why is not None:
                raise FormatError(f"{obj}: item {req.storage_index.fqn!r} {why}; refusing to load it")
            t = torch.load(stream, map_location="cpu", weights_only=True)
            if not isinstance(t, torch.Tensor):
                raise FormatError(f"{obj}: item {req.storage_index.fqn!r} holds a {type(t).__name__}, not a tensor")
            t = narrow_tensor_by_index(t, req.storage_offsets, req.lengths)
            _copy_into(planner, req, planner.resolve_tensor(req).detach(), t, f"{obj}, item {req.storage_index.fqn!r}")

        unit.finish = finish
        fetch(unit, obj, sinfo.offset, memoryview(buf.numpy()))  # type: ignore[arg-type]  # numpy's stubs: ndarray.__buffer__ on 3.12+ only
        return unit


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
            _note(x, f"{where} failed on rank {r}{others}")
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
    **options: Any,
) -> None:
    """``torch.distributed.checkpoint.load`` from ``uri`` into ``state_dict`` (in place).

    Failures raise as for :func:`save` (a missing ``.metadata``: :class:`IncompleteCheckpointError`).
    """
    import torch.distributed.checkpoint as dcp

    reader = StorageReader(uri, **options)
    try:
        dcp.load(state_dict, storage_reader=reader, planner=planner, process_group=process_group)
    except CheckpointException as e:
        raise surface_error(e, "load", uri, reader._metadata_error) from e

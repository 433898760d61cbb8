"""``torch.save`` files (``.pt``, ``.pth``, ``.ckpt``, ``.pth.tar``).

Loads default to ``weights_only=True`` (no code execution); pass ``weights_only=False`` (or
``allow_pickle=True``, the name the other formats use) only for files you trust. A local (or
node-cached) file is read in place (``backend.local_file``). An object of a storage whose reads are
local (memory://) is read from memory (over :data:`IN_MEMORY_MAX`, through a reader that puts each
record straight into its tensor). A remote object is fetched into anonymous memory, its first part by
the one request that also tells its size and the rest by parallel ranged reads, and torch's zip reader
reads those buffers (over a remote stream it would issue one small sequential request per record);
one over :data:`IN_MEMORY_MAX` goes through a temporary file. ``mmap=True`` works everywhere
(``backend.get_local_path``); the mapping outlives the temporary file.

``inspect`` / ``verify`` (``ckptio info`` / ``ckptio verify``) read the pickle with
:class:`_TorchInspector`, an unpickler that builds stand-ins (:class:`TensorInfo`, :class:`_Opaque`)
instead of tensors and calls nothing it does not know, and check the zip CRC32 of every member.

Before torch (or the inspector) sees an archive (``weights_only`` loads, ``inspect``, ``verify``),
:func:`archive_problem` bounds what its records decompress to (at most :data:`INFLATE_MAX` times the
file) and :func:`pickle_problem` walks its ``data.pkl`` (:mod:`ckptio.formats.pickle_scan`): no
memo bomb, no ``BUILD`` on a global, no call that allocates from a small argument (torch's
allow-list admits ``bytearray(n)``, ``torch.FloatTensor(n)``, ``torch.UntypedStorage(n)``).
Legacy (non-zip) files go to torch unchecked. Bytes that are no torch.save file (another format's,
junk) never reach ``torch.load``, whatever ``weights_only`` says (:mod:`.sniff`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import errno
import io
import math
import os
import pickle
import re
import struct
import tempfile
import zipfile
import zlib
from collections.abc import Sequence
from typing import IO, Any

from .. import torch_internals as _ti
from ..backends.base import Backend, copy_to_file
from ..backends.readers import BytesReader, PiecesReader
from ..errors import CkptioError, FormatError, IntegrityError, note
from ..osio import anonymous
from ..threads import Pool, executor
from . import pickle_scan, sniff, torch_files
from .base import StreamFormat, dtype_size, flatten, jsonable
from .pickle_guard import guard

IN_MEMORY_MAX = 512 << 20  # a memory:// or remote object up to this size is loaded from memory, not a temporary file
INFLATE_MAX = 16  # an archive's records may decompress to at most this many times the archive's size
_ZIP_MAGIC = b"PK\x03\x04"
_ZIP_ERRORS = (zipfile.BadZipFile, ValueError, EOFError, zlib.error, struct.error)  # what a damaged archive raises


def _damaged(e: BaseException) -> bool:
    """Whether ``e``, raised while zipfile reads an archive, means the archive is damaged (an offset before
    its start fails a local file's seek with EINVAL), not that reading failed (a store's error)."""
    return not isinstance(e, CkptioError) and (isinstance(e, _ZIP_ERRORS) or getattr(e, "errno", 0) == errno.EINVAL)


def archive_problem(z: zipfile.ZipFile, size: int) -> str | None:
    """Why reading the records of ``z`` (an archive of ``size`` bytes) could allocate far beyond it; None if not."""
    total = 0
    for r in z.infolist():
        if r.compress_type == zipfile.ZIP_STORED and r.file_size != r.compress_size:
            return f"has a stored zip record {r.filename!r} whose sizes disagree"
        total += r.file_size
    if total > INFLATE_MAX * max(size, 1 << 16):
        return (
            f"has zip records that decompress to {total} bytes, more than {INFLATE_MAX} times the "
            f"{size}-byte file (a zip bomb?)"
        )
    return None


def _calls(module: str, name: str) -> str | None:
    """Globals torch's allow-list admits that allocate from an int argument ("sized"), or that torch.save
    never calls (tensor and storage classes, which allocate from a size or copy any sequence: "never")."""
    if module == "builtins":
        return "sized" if name in ("bytearray", "bytes") else None
    return "never" if module.partition(".")[0] == "torch" and name.endswith(("Tensor", "Storage")) else None


# the names :func:`_calls` and the budgets check, however a pickle spells a global (GLOBAL's text
# line, STACK_GLOBAL's strings); torch.save's own pickles name none of them (storages pickle as
# torch.FloatStorage..., tensors through _rebuild_tensor_v2), so they skip the walk in Python
_RISKY = re.compile(b"bytearray|bytes|Tensor|TypedStorage|" + _ti.REBUILD_QTENSOR.encode())


def pickle_problem(pkl: bytes | memoryview, size: int) -> str | None:
    """Why unpickling ``pkl`` (the ``data.pkl`` of a ``size``-byte archive) could change shared objects
    or allocate far beyond the archive; None if it cannot (see :mod:`ckptio.formats.pickle_scan`)."""
    if _RISKY.search(pkl) is None:  # nothing to call that allocates: the memo alone, at C speed
        return pickle_scan.memo_problem(pkl)
    budgets = {f"{_ti.REBUILD_MODULE}.{_ti.REBUILD_QTENSOR}": 2}
    return pickle_scan.problem(pkl, calls=_calls, budgets=budgets, limit=size)


def _data_pkl(z: zipfile.ZipFile) -> str | None:
    return next((n for n in z.namelist() if n.endswith("/data.pkl") or n == "data.pkl"), None)


def check_archive(f: IO[bytes], size: int, uri: str) -> None:
    """Raise :class:`FormatError` naming ``uri`` when the zip archive in ``f`` (seekable, ``size`` bytes) has
    an :func:`archive_problem` or its ``data.pkl`` a :func:`pickle_problem`; a legacy (non-zip) file passes.
    ``f`` is left at its start."""
    try:
        if f.read(4) != _ZIP_MAGIC:
            return
        f.seek(0)
        try:
            z = zipfile.ZipFile(f)
            why = archive_problem(z, size)
            name = _data_pkl(z) if why is None else None
            pkl = z.read(name) if name is not None else None
        except (*_ZIP_ERRORS, OSError) as e:  # (a reader's own error is raised by its caller: _load_through_reader)
            raise FormatError(f"{uri}: not a readable torch.save archive ({type(e).__name__}: {e})") from None
        if pkl is not None:
            why = pickle_problem(pkl, size)
        if why is not None:
            raise FormatError(f"{uri}: {why}; refusing to load it (the file is corrupt or crafted)")
    finally:
        f.seek(0)


def _load_checked(f: Any, size: int, uri: str, kw: dict[str, Any]) -> Any:
    import torch

    sniff.expect(uri, "torch", sniff.head_of(f), strict=True)  # no other format reaches an unpickler
    if kw.get("weights_only"):
        with open(f, "rb") if isinstance(f, (str, os.PathLike)) else contextlib.nullcontext(f) as g:
            check_archive(g, size, uri)
    if isinstance(f, (str, os.PathLike)) and os.fspath(f).endswith(".safetensors") and not kw.get("mmap"):
        with open(f, "rb") as g:  # torch.load hands a path named so to safetensors
            return torch.load(g, **kw)
    return torch.load(f, **kw)


class TorchFormat(StreamFormat):
    load_options = frozenset(  # torch.load's, its pickle's (encoding...), and the name the other formats use
        "map_location weights_only mmap allow_pickle pickle_module encoding errors fix_imports buffers".split()
    )
    dump_options = frozenset(
        "durable pickle_module pickle_protocol _use_new_zipfile_serialization _disable_byteorder_record".split()
    )
    open_with = frozenset({"pickle_module"})  # a pickle module of the caller's takes its own load arguments

    def dump_file(self, obj: Any, f: IO, **kw: Any) -> None:
        torch_files.save(obj, f, **kw)  # a failed write's own exception, not the RuntimeError torch raises after it

    def load_file(self, f: IO, **kw: Any) -> Any:
        import torch

        kw.setdefault("weights_only", not kw.pop("allow_pickle", False))
        name, start = getattr(f, "name", "the torch.save file"), f.tell() if f.seekable() else None
        if start:  # torch.load reads from there (it refuses a file it cannot seek): so does the check
            sniff.expect(name, "torch", sniff.head_of(f), strict=True)
        elif start == 0:
            return _load_checked(f, f.seek(0, os.SEEK_END) + f.seek(0), name, kw)
        return torch.load(f, **kw)

    def load(self, backend: Backend, uri: str, **kw: Any) -> Any:
        try:
            return self._load(backend, uri, kw)
        except Exception as e:  # torch's own errors (a torn or junk file) do not say which file
            if uri not in str(e):
                note(e, f"ckptio: loading {uri}")
            raise

    def _load(self, backend: Backend, uri: str, kw: dict[str, Any]) -> Any:
        kw.setdefault("weights_only", not kw.pop("allow_pickle", False))
        if kw.get("mmap", _mmap_default()):  # explicit, or torch's process-wide default
            with backend.get_local_path(uri) as path:
                return _load_checked(path, os.path.getsize(path), uri, kw)
        with backend.local_file(uri) as path:
            if path is not None:  # a local file, a node-cache entry: read in place
                return _load_checked(path, os.path.getsize(path), uri, kw)
        if backend.reads_local:  # memory://, an incremental step's local blocks: no temporary file
            size = backend.stat(uri).size
            if size <= IN_MEMORY_MAX:
                data = backend.read(uri)
                if backend.assembled(uri):
                    check_members(data, uri)
                return _load_checked(io.BytesIO(data), size, uri, kw)
            if backend.assembled(uri):  # read twice: once for the CRCs, once into the tensors
                with backend.open_reader(uri) as f:
                    check_members(f, uri)
            return _load_through_reader(backend, uri, size, kw)
        return _load_remote(backend, uri, kw)

    def inspect(self, backend: Backend, uri: str) -> dict[str, Any]:
        return inspect_torch(backend, uri)

    def verify(self, backend: Backend, uri: str) -> dict[str, Any]:
        return verify_torch(backend, uri)


def _mmap_default() -> bool:
    """torch's process-wide default for ``torch.load(mmap=...)`` (``torch.utils.serialization.config``)."""
    try:
        from torch.utils.serialization import config

        return bool(config.load.mmap)
    except (ImportError, AttributeError):  # a torch without the setting
        return False


def _load_through_reader(backend: Backend, uri: str, size: int, kw: dict[str, Any]) -> Any:
    """``torch.load`` through a buffered reader over the backend (bounded memory: each record is read
    straight into its tensor); the backend's own error (damaged, missing) is the one raised."""

    raw = torch_files.ErrorKeepingReader(backend.pin_version(uri), uri, size)  # one version (memory://: a snapshot)
    try:
        return _load_checked(io.BufferedReader(raw, buffer_size=1 << 20), size, uri, kw)
    except Exception as e:
        if raw.error is not None:
            raise raw.error from e
        raise


def _load_remote(backend: Backend, uri: str, kw: dict[str, Any]) -> Any:
    """``torch.load`` of a remote object fetched into anonymous memory: its first ``part_size`` bytes by
    one request that also tells the object's size (``Backend.read_head``: a small file is one GET, no
    HEAD); the rest, by parallel ranged reads into a second buffer, starts as soon as that reply's
    headers are in, all from the version the first reply came from (``Backend.pin_version``: torch
    checks no CRC, so an object replaced meanwhile would load as a mix). torch's zip reader reads the
    buffers in place. An object over :data:`IN_MEMORY_MAX` goes through a temporary file instead."""

    backend = backend.pin_version(uri)  # head and rest from one version of the object, or IntegrityError
    head = anonymous(min(backend.part_size, IN_MEMORY_MAX))  # faulted in as filled
    part = len(head)
    sizes: list[int] = []
    rest: list[tuple[memoryview, concurrent.futures.Future[int]]] = []
    pool = Pool(1, thread_name_prefix="pt-rest")

    def on_size(size: int) -> None:  # on the IO thread, while the first body is still coming
        sizes.append(size)
        if part < size <= IN_MEMORY_MAX:
            buf = anonymous(size - part)
            rest.append((buf, pool.submit(backend.readinto, uri, buf, part)))

    try:
        n = backend.read_head(uri, head, on_size)
        size = sizes[0] if sizes else backend.stat(uri).size  # (a user backend's read_head that never told)
        if n < min(size, len(head)):
            raise IntegrityError(
                f"{uri}: {n} of the first {min(size, len(head))} bytes came back (changed while read?)"
            )
        if rest:
            buf, fut = rest[0]
            got = fut.result()
            if got != len(buf):
                raise IntegrityError(f"{uri}: truncated: bytes [{n}, {size}) returned only {got} (changed while read?)")
    finally:
        pool.shutdown(wait=True, cancel_futures=True)  # nothing reads on after this returns or raises
    assembled = backend.assembled(uri)
    if n >= size:
        if assembled:
            check_members(head[:size], uri)
        return _load_checked(BytesReader(head[:size], uri), size, uri, kw)
    if rest:
        pieces = PiecesReader([head, rest[0][0]], uri)
        if assembled:
            check_members(pieces, uri)
        return _load_checked(pieces, size, uri, kw)
    with tempfile.TemporaryDirectory(prefix="ckptio-") as tmp:  # over IN_MEMORY_MAX
        path = os.path.join(tmp, "object.pt")
        with open(path, "wb") as f:
            f.write(head[:n])
            del head
            copy_to_file(backend, uri, f, start=n, size=size)
        if assembled:
            with open(path, "rb") as saved:
                check_members(saved, uri)
        return _load_checked(path, size, uri, kw)


def check_members(data: Any, uri: str, names: set[str] | None = None) -> None:
    """The zip CRC32 of every member (or those in ``names``) of the torch archive ``data`` (a buffer:
    without a copy, members hashed in parallel; else a seekable binary file, left at 0), which
    ``torch.load`` never checks; IntegrityError naming the member. For bytes assembled from blocks
    (``Backend.assembled``)."""
    whole = not hasattr(data, "seek")
    f = io.BytesIO(data) if whole else data
    try:
        with zipfile.ZipFile(f) as z:
            infos = [i for i in z.infolist() if names is None or i.filename in names]
            if whole and all(i.compress_type == zipfile.ZIP_STORED for i in infos):
                bad = _crc_stored(memoryview(data).cast("B"), infos)
            else:
                bad = next((i.filename for i in infos if not _crc_ok(z, i)), None)
    except (zipfile.BadZipFile, ValueError, EOFError) as e:
        raise IntegrityError(f"{uri}: not a readable torch archive ({e}): the checkpoint is corrupt") from None
    if not whole:
        f.seek(0)
    if bad is not None:
        raise IntegrityError(f"{uri}: CRC mismatch in archive member {bad}: the checkpoint is corrupt")


def _crc_ok(z: zipfile.ZipFile, info: zipfile.ZipInfo) -> bool:
    """Whether member ``info`` reads back with its CRC32 (zipfile checks it at the member's end)."""
    try:
        with z.open(info) as m:
            while m.read(1 << 20):
                pass
    except zipfile.BadZipFile:
        return False
    return True


def _crc_stored(mv: memoryview, infos: list[zipfile.ZipInfo]) -> str | None:
    """The name of the first stored member of the archive ``mv`` whose CRC32 is wrong, or None."""
    spans = []
    for i in infos:
        h = i.header_offset
        if h + 30 > len(mv) or mv[h : h + 4] != b"PK\x03\x04":  # a local file header
            return i.filename
        start = h + 30 + int.from_bytes(mv[h + 26 : h + 28], "little") + int.from_bytes(mv[h + 28 : h + 30], "little")
        if start + i.compress_size > len(mv):
            return i.filename
        spans.append((i.filename, mv[start : start + i.compress_size], i.CRC))
    total = sum(len(s) for _, s, _ in spans)
    with executor(os.cpu_count() or 1, "pt-crc", total) as pool:  # zlib.crc32 lets go of the GIL
        crcs = list(pool.map(lambda s: zlib.crc32(s[1]), spans))
    return next((name for (name, _, crc), got in zip(spans, crcs, strict=True) if got != crc), None)


# ---------------------------------------------------------------------------------------------
# inspection without loading tensor data: unpickle data.pkl with stand-ins


@dataclasses.dataclass
class TensorInfo:
    dtype: str
    shape: list[int]
    nbytes: int
    storage: str
    parameter: bool = False


class _Opaque:
    """Stand-in for any global the inspector does not allow: records, never executes."""

    _name = "?"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __repr__(self) -> str:
        return f"<{self._name}>"


def _storage_dtype(name: str) -> str:
    import torch

    if name == "UntypedStorage":
        return "uint8"
    try:
        return str(_ti.get_dtype_from_pickle_storage_type(name)).removeprefix("torch.")
    except (ImportError, KeyError, AttributeError):
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return str(getattr(torch, name).dtype).removeprefix("torch.")


class _StorageType:
    def __init__(self, dtype: str) -> None:
        self.dtype = dtype


def _latin1_encode(text: str, encoding: str = "latin1") -> bytes:
    if encoding not in ("latin1", "latin-1") or not isinstance(text, str):
        raise FormatError(f"pickled _codecs.encode with encoding {encoding!r}: only latin1 (torch's bytes) is read")
    return text.encode("latin1")


def _parameter(data: Any, *args: Any) -> Any:
    return dataclasses.replace(data, parameter=True) if isinstance(data, TensorInfo) else data


class _TorchInspector(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        import collections

        import torch

        if module == "collections" and name == "OrderedDict":
            return collections.OrderedDict
        if module == "builtins" and name in (
            "set",
            "frozenset",
            "complex",
            "slice",
            "bytearray",
            "tuple",
            "list",
            "dict",
        ):
            return getattr(__import__("builtins"), name)
        # functions as callables that refuse BUILD (which would change them for the process)
        if module == "_codecs" and name == "encode":
            return guard(_latin1_encode, "_codecs.encode")  # how torch pickles bytes; no other codec
        # torch's private rebuild functions, as torch.save pickles tensors (matched by name)
        if module == _ti.REBUILD_MODULE and name == _ti.REBUILD_TENSOR:
            return guard(self._tensor, f"{module}.{name}")
        if module == _ti.REBUILD_MODULE and name == _ti.REBUILD_PARAMETER:
            return guard(_parameter, f"{module}.{name}")
        if module == "torch" and name.endswith("Storage"):
            return _StorageType(_storage_dtype(name))
        if module == "torch" and name == "Size":
            return tuple
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module == "torch" and name == "device":
            return str
        return type(name, (_Opaque,), {"_name": f"{module}.{name}"})

    @staticmethod
    def _tensor(storage: Any, offset: int, size: Sequence[int], stride: Sequence[int], *args: Any) -> Any:
        if not isinstance(storage, dict):
            return _Opaque(storage)
        numel = math.prod(size)
        return TensorInfo(storage["dtype"], list(size), numel * dtype_size(storage["dtype"]), storage["key"])

    def persistent_load(self, pid: Any) -> Any:
        if isinstance(pid, tuple) and len(pid) >= 5 and pid[0] == "storage":
            st, key, numel = pid[1], str(pid[2]), int(pid[4])
            dtype = st.dtype if isinstance(st, _StorageType) else "uint8"
            return {"dtype": dtype, "key": key, "numel": numel}
        return None


def _open_zip(backend: Backend, uri: str) -> tuple[zipfile.ZipFile, int]:
    """The archive at ``uri`` and its size, its records' sizes checked (:func:`archive_problem`)."""
    f = backend.open_reader(uri)
    try:  # zipfile reads an archive behind any prefix; torch.load and this read only a torch file's bytes
        sniff.expect(uri, "torch", f.read(sniff.HEAD), strict=True)
        size = f.seek(0, os.SEEK_END)
        z = zipfile.ZipFile(f)
        why = archive_problem(z, size)
    except Exception as e:
        f.close()
        if isinstance(e, zipfile.BadZipFile):
            raise FormatError(f"{uri}: not a zip-format torch checkpoint (legacy torch.save or corrupt)") from None
        if not _damaged(e):  # the sniff's FormatError, a store's error
            raise
        raise IntegrityError(  # offsets past either end: a seek before 0, a short read
            f"{uri}: its zip records point outside the file ({e}): the checkpoint is corrupt"
        ) from None
    if why is not None:
        z.close()
        raise FormatError(f"{uri}: {why}; refusing to read it (the file is corrupt or crafted)")
    return z, size


def inspect_torch(backend: Backend, uri: str) -> dict[str, Any]:
    """Keys, dtypes, shapes and sizes of a zip-format ``torch.save`` file; no tensor bytes are read
    and no code runs (:class:`_TorchInspector` records unknown globals instead of calling them)."""
    z, size = _open_zip(backend, uri)
    with z:
        pkl = _data_pkl(z)
        if pkl is None:
            raise FormatError(f"{uri}: zip archive without data.pkl: not a torch checkpoint")
        try:
            data = z.read(pkl)
        except Exception as e:
            if not _damaged(e):
                raise
            raise IntegrityError(f"{uri}: cannot read {pkl} ({e}): the checkpoint is corrupt") from None
        why = pickle_problem(data, size)
        if why is not None:
            raise FormatError(f"{uri}: {pkl} {why}; refusing to read it (the file is corrupt or crafted)")
        try:
            tree = _TorchInspector(io.BytesIO(data)).load()
        except (
            pickle.UnpicklingError,
            EOFError,
            ValueError,
            TypeError,
            AttributeError,
            LookupError,
            zipfile.BadZipFile,
        ) as e:
            raise IntegrityError(f"{uri}: cannot decode {pkl}: {e}") from None
    tensors: list[dict[str, Any]] = []
    storages: dict[str, int] = {}  # storage key -> the most bytes a tensor views of it
    for key, v in flatten(tree, TensorInfo):
        if isinstance(v, TensorInfo):
            tensors.append({"key": key, "dtype": v.dtype, "shape": v.shape, "nbytes": v.nbytes})
            storages[v.storage] = max(storages.get(v.storage, 0), v.nbytes)
    others = {k: jsonable(v) for k, v in flatten(tree, TensorInfo) if not isinstance(v, TensorInfo)}
    return {"format": "torch", "tensors": tensors, "tensor_bytes": sum(storages.values()), "values": others}


def verify_torch(backend: Backend, uri: str) -> dict[str, Any]:
    """The CRC32 of every zip member, then the pickle (as :func:`inspect_torch`)."""
    z, _ = _open_zip(backend, uri)
    with z:
        try:
            bad = z.testzip()  # reads every member and checks its CRC32
        except Exception as e:
            if not _damaged(e):
                raise
            raise IntegrityError(f"{uri}: a zip member cannot be read ({e}): the checkpoint is corrupt") from None
        if bad is not None:
            raise IntegrityError(f"{uri}: CRC mismatch in archive member {bad}: the checkpoint is corrupt")
        members = len(z.namelist())
    inspect_torch(backend, uri)
    return {"checked": members, "unchecked": 0, "what": "zip CRC32 of every member"}

"""Read-only recognition of the seeds' own checkpoint layouts, so a run started with Meta DINOv3's or
NVIDIA Cosmos's checkpointer resumes under ckptio. Nothing here writes, renames or deletes.

DINOv3 (``dinov3/checkpointer``), root ``output_dir/ckpt``::

    <iteration>/          a torch DCP checkpoint (``.metadata`` + ``__<rank>_<n>.distcp``) of the keys
                          ``iteration``, ``model.*``, ``optimizer.*``; named ``str(iteration)``, unpadded
    <iteration>_keep/     a kept copy (hard links) of that step, which DINOv3's retention never deletes

A step is complete once its directory holds ``.metadata`` (DINOv3 writes a temporary directory and
renames it; only canonical integer names count, so ckptio's own zero-padded step directories and a
temporary ``199k3x_q2a`` never do, nor a directory holding ckptio's ``checkpoint.json``).

Cosmos (imaginaire checkpointers), root ``<job>/checkpoints``, three variants (``SeedSteps.layout``)::

    flat    (DDP)             iter_<09d>.pt (the trainer key) iter_<09d>_model.pt _optim.pt _scheduler.pt
    by-key  (cosmos-predict2) model/iter_<09d>.pt optim/... scheduler/... trainer/...
    dcp     (DCP)             iter_<09d>/model/ optim/ scheduler/ trainer/   each a torch DCP checkpoint
    latest_checkpoint.txt     the pointer: "iter_<09d>.pt\\n" ("iter_<09d>\\n" for dcp)

A step is complete once every key has its file (``.pt`` of nonzero size) or DCP ``.metadata``.
:meth:`SeedSteps.latest` is the pointer's step if complete, else the newest complete one (with a
:class:`CheckpointWarning`); for ``.pt`` files it also checks that each file of its pick ends with a
zip end record (Cosmos writes in place, so a killed save can leave a torn file), stepping back if not.

:func:`find` also looks one level down (``root/ckpt``, ``root/checkpoints``), so the job directory works
as well. Every URI is read through ckptio's backends: local, ``s3://``, ``gs://``, aliases.
"""

from __future__ import annotations

import abc
import re
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from .. import markers
from .. import uri as _uri
from ..backends.base import Backend, ObjectInfo
from ..context import resolve
from ..errors import FormatError, IncompleteCheckpointError, NotFoundError
from ..io import load
from ..threads import Pool
from .manifest import MARKER_NAME, CheckpointWarning

KEYS = ("model", "optim", "scheduler", "trainer")  # Cosmos's KEYS_TO_SAVE
POINTER = "latest_checkpoint.txt"
DCP_METADATA = ".metadata"
KEEP_SUFFIX = "_keep"
# ASCII digits ("\d" takes '٠' and other digits int() reads), at most 20 (no step is past 2**64)
_FLAT = re.compile(r"iter_([0-9]{9,20})(?:_(model|optim|scheduler))?\.pt")
_ITER = re.compile(r"iter_([0-9]{9,20})(\.pt)?")
_ZIP_END = b"PK\x05\x06"  # end of central directory record; torch.save writes no zip comment
_ZIP_START = b"PK\x03\x04"

T = TypeVar("T")
R = TypeVar("R")


@dataclass(frozen=True)
class SeedTarget:
    """One seed checkpoint to read. ``fmt``: ``"dcp"`` (DINOv3: ``uri`` is the DCP directory),
    ``"pt-parts"`` (Cosmos ``.pt`` files: ``files`` maps each key to its file, ``uri`` is the directory
    holding them) or ``"dcp-parts"`` (Cosmos DCP: ``files`` maps each key to its DCP directory, ``uri`` is
    the step's directory)."""

    step: int
    fmt: str
    uri: str
    files: Mapping[str, str] = field(default_factory=dict)


class SeedSteps(abc.ABC):
    """The checkpoints of one seed under one root, as listed when :func:`find` ran (call it again to
    see later changes). ``kind``: ``"dinov3"`` or ``"cosmos"``; ``uri``: the directory holding them."""

    kind: str
    layout: str

    def __init__(self, uri: str, backend: Backend, root: str) -> None:
        self.uri, self.backend, self.root = uri, backend, root

    @abc.abstractmethod
    def steps(self) -> list[int]:
        """Steps of the complete checkpoints, ascending."""

    @abc.abstractmethod
    def target(self, step: int) -> SeedTarget:
        """What to read for ``step``; ``NotFoundError``/``IncompleteCheckpointError`` if it is not complete."""

    def pointer(self) -> int | None:
        """The step the seed's own pointer names (checked for its form only), or None."""
        return None

    def intact(self, step: int) -> bool:
        """Whether the files of complete ``step`` look whole (beyond being present)."""
        return True

    def latest(self) -> int | None:
        """The pointer's step if it is complete, else the newest complete step (with a warning); None if none."""
        steps = self.steps()
        ptr = self.pointer()
        if ptr is not None and ptr in steps and self.intact(ptr):
            return ptr
        for s in reversed(steps):
            if s != ptr and self.intact(s):
                if ptr is not None or s != steps[-1]:
                    why = f"{POINTER} names step {ptr}, which" if ptr is not None else f"step {steps[-1]}"
                    warnings.warn(
                        f"{self.uri}: {why} is not a complete {self.kind} checkpoint; using step {s}",
                        CheckpointWarning,
                        stacklevel=2,
                    )
                return s
        return None

    def _missing(self, step: int, what: str) -> Exception:
        if step in self._seen():
            return IncompleteCheckpointError(f"{self.kind} checkpoint {what} of step {step} is incomplete")
        return NotFoundError(self.uri, f"no {self.kind} checkpoint of step {step} in")

    @abc.abstractmethod
    def _seen(self) -> set[int]:
        """Every step with any file or directory (complete or not)."""


# ---- DINOv3 ---------------------------------------------------------------------------------------
class DinoSteps(SeedSteps):
    kind = "dinov3"
    layout = "dcp"

    def __init__(self, uri: str, backend: Backend, root: str, dirs: dict[str, bool]) -> None:
        super().__init__(uri, backend, root)
        self._dirs = dirs  # directory name -> complete

    def _of(self, kept: bool) -> dict[int, str]:
        out = {}
        for name, ok in self._dirs.items():
            if ok and name.endswith(KEEP_SUFFIX) == kept:
                out[int(name.removesuffix(KEEP_SUFFIX))] = name
        return out

    def steps(self) -> list[int]:
        return sorted(self._of(kept=False))

    def kept(self) -> list[int]:
        """Steps with a complete ``<step>_keep`` copy, ascending."""
        return sorted(self._of(kept=True))

    def target(self, step: int) -> SeedTarget:
        """The step's directory, or its ``_keep`` copy when only that is complete."""
        name = self._of(kept=False).get(step) or self._of(kept=True).get(step)
        if name is None:
            raise self._missing(step, _uri.join_path(self.uri, str(step)))
        return SeedTarget(step, "dcp", _uri.join_path(self.uri, name))

    def _seen(self) -> set[int]:
        return {int(n.removesuffix(KEEP_SUFFIX)) for n in self._dirs}


def _dino_name(name: str) -> bool:
    """``str(iteration)`` of a DINOv3 step (no leading zeros, ASCII digits), optionally ``_keep``."""
    n = name.removesuffix(KEEP_SUFFIX)
    return n.isascii() and n.isdigit() and str(int(n)) == n


def _find_dino(uri: str, backend: Backend, root: str, entries: Sequence[ObjectInfo]) -> DinoSteps | None:
    names = [e for e, is_dir in _children(root, entries) if is_dir and _dino_name(e)]
    if not names:
        return None

    def check(name: str) -> tuple[bool, bool]:
        d = _uri.join_path(root, name)
        return backend.isfile(_uri.join_path(d, DCP_METADATA)), backend.isfile(_uri.join_path(d, MARKER_NAME))

    found = dict(zip(names, _map(backend, check, names), strict=True))
    dirs = {n: meta for n, (meta, ours) in found.items() if not ours}  # ckptio's own steps are not DINOv3's
    if not any(dirs.values()):
        return None
    return DinoSteps(uri, backend, root, dirs)


# ---- Cosmos ---------------------------------------------------------------------------------------
class CosmosSteps(SeedSteps):
    kind = "cosmos"

    def __init__(self, uri: str, backend: Backend, root: str, layout: str, parts: dict[int, dict[str, str]]) -> None:
        super().__init__(uri, backend, root)
        self.layout = layout
        self._parts = parts  # step -> key -> resolved path of the key's file (or DCP directory) found

    def steps(self) -> list[int]:
        return sorted(s for s, p in self._parts.items() if len(p) == len(KEYS))

    def _seen(self) -> set[int]:
        return set(self._parts)

    def pointer(self) -> int | None:
        shown = _uri.join_path(self.uri, POINTER)
        try:
            data = markers.read(self.backend, _uri.join_path(self.root, POINTER), shown, markers.MAX_POINTER_BYTES)
            text = markers.text(data, shown).strip()
            m = _ITER.fullmatch(_uri.basename(text))
            if m is None:
                raise FormatError(f"{shown}: names no step: {text[:80]!r}")
        except FileNotFoundError:
            return None
        except FormatError as e:
            warnings.warn(f"ignoring malformed Cosmos pointer: {e}", CheckpointWarning, stacklevel=3)
            return None
        return int(m.group(1))

    def intact(self, step: int) -> bool:
        if self.layout == "dcp":
            return True
        return all(_map(self.backend, lambda p: zip_whole(self.backend, p), list(self._parts[step].values())))

    def target(self, step: int) -> SeedTarget:
        name = f"iter_{step:09d}"
        if step not in self.steps():
            where = _uri.join_path(self.uri, name) if self.layout == "dcp" else f"{self.uri} ({name}*)"
            raise self._missing(step, where)
        if self.layout == "flat":
            files = {k: f"{name}.pt" if k == "trainer" else f"{name}_{k}.pt" for k in KEYS}
            return SeedTarget(step, "pt-parts", self.uri, {k: _uri.join_path(self.uri, f) for k, f in files.items()})
        if self.layout == "by-key":
            return SeedTarget(step, "pt-parts", self.uri, {k: _uri.join_path(self.uri, k, f"{name}.pt") for k in KEYS})
        d = _uri.join_path(self.uri, name)
        return SeedTarget(step, "dcp-parts", d, {k: _uri.join_path(d, k) for k in KEYS})


def _find_cosmos(uri: str, backend: Backend, root: str, entries: Sequence[ObjectInfo]) -> CosmosSteps | None:
    kids = _children(root, entries)
    files = {n: e for (n, is_dir), e in zip(kids, entries, strict=True) if not is_dir}
    dirs = {n for n, is_dir in kids if is_dir}
    flat: dict[int, dict[str, str]] = {}
    for name, e in files.items():
        m = _FLAT.fullmatch(name)
        if m and e.size > 0:
            flat.setdefault(int(m.group(1)), {})[m.group(2) or "trainer"] = _uri.join_path(root, name)
    if flat:
        return CosmosSteps(uri, backend, root, "flat", flat)
    present = [k for k in KEYS if k in dirs]
    if present:
        by_key: dict[int, dict[str, str]] = {}
        listings = _map(backend, lambda k: _list(backend, _uri.join_path(root, k)), present)
        for key, listed in zip(present, listings, strict=True):
            sub = _uri.join_path(root, key)
            for (name, is_dir), e in zip(_children(sub, listed), listed, strict=True):
                m = _ITER.fullmatch(name)
                if m and m.group(2) and not is_dir and e.size > 0:
                    by_key.setdefault(int(m.group(1)), {})[key] = _uri.join_path(sub, name)
        if by_key:
            return CosmosSteps(uri, backend, root, "by-key", by_key)
    iters = [n for n in dirs if (m := _ITER.fullmatch(n)) and not m.group(2)]
    if iters:
        pairs = [(n, k) for n in iters for k in KEYS]
        metas = _map(backend, lambda p: backend.isfile(_uri.join_path(root, p[0], p[1], DCP_METADATA)), pairs)
        dcp: dict[int, dict[str, str]] = {int(n[5:]): {} for n in iters}
        for (n, k), ok in zip(pairs, metas, strict=True):
            if ok:
                dcp[int(n[5:])][k] = _uri.join_path(root, n, k)
        return CosmosSteps(uri, backend, root, "dcp", dcp)
    if POINTER in files:  # a pointer with nothing it could name: still Cosmos's root, no complete step
        return CosmosSteps(uri, backend, root, "flat", {})
    return None


def zip_whole(backend: Backend, path: str) -> bool:
    """False for a zip (torch.save's format) without its end record: a torn write. A legacy
    (non-zip) torch file cannot be checked this way and counts as whole."""
    size = backend.stat(path).size
    if size >= 22 and backend.read_range(path, size - 22, size)[:4] == _ZIP_END:
        return True
    return backend.read_range(path, 0, min(4, size)) != _ZIP_START


# ---- shared ---------------------------------------------------------------------------------------
def _list(backend: Backend, root: str) -> list[ObjectInfo]:
    try:
        return list(backend.list(root, recursive=False))
    except (FileNotFoundError, NotADirectoryError):
        return []


def _children(root: str, entries: Sequence[ObjectInfo]) -> list[tuple[str, bool]]:
    """(name, is_dir) of each entry, in order; entries not directly under ``root`` get the name ``""``."""
    base = root.rstrip("/")
    out = []
    for e in entries:
        u = e.uri.rstrip("/")
        name = _uri.basename(u)
        out.append((name if u == _uri.join_path(base, name).rstrip("/") else "", e.is_dir))
    return out


def _map(backend: Backend, fn: Callable[[T], R], items: Sequence[T]) -> list[R]:
    """``fn`` over ``items``, in order; on an object store several requests at once."""
    if len(items) <= 1 or backend.reads_local:
        return [fn(i) for i in items]
    with Pool(min(len(items), backend.concurrency), thread_name_prefix="ckptio-seeds") as ex:
        return list(ex.map(fn, items))


def find(root_uri: str) -> SeedSteps | None:
    """The seed checkpoints under ``root_uri`` (Cosmos's, else DINOv3's), or under ``root_uri/checkpoints``
    (Cosmos) or ``root_uri/ckpt`` (DINOv3) when ``root_uri`` itself holds neither; None if there are none.

    DINOv3 counts only with at least one complete step (or ``_keep`` copy); Cosmos as soon as its
    pointer or one of its files is there (``steps()`` may then be empty)."""
    root_uri = str(root_uri).rstrip("/") or str(root_uri)
    backend, root = resolve(root_uri)
    entries = _list(backend, root)
    found = _find_cosmos(root_uri, backend, root, entries) or _find_dino(root_uri, backend, root, entries)
    if found is not None:
        return found
    names = {n for n, is_dir in _children(root, entries) if is_dir}
    for sub, finder in (("checkpoints", _find_cosmos), ("ckpt", _find_dino)):
        if sub in names:
            d = _uri.join_path(root, sub)
            hit = finder(_uri.join_path(root_uri, sub), backend, d, _list(backend, d))
            if hit is not None:
                return hit
    return None


def read_parts(target: SeedTarget, keys: Iterable[str], map_location: Any = "cpu") -> dict[str, Any]:
    """Load the ``.pt`` file of each of ``keys`` of a ``"pt-parts"`` target, and only those, with
    ``ckptio.load(uri, weights_only=True)`` (no code runs): key -> the object torch.save stored."""
    if target.fmt != "pt-parts":
        raise ValueError(
            f"{target.uri}: a {target.fmt!r} checkpoint has no .pt parts; read it with ckptio.dcp.load "
            f"({'target.uri' if target.fmt == 'dcp' else 'target.files[key]'})"
        )
    keys = list(keys)
    unknown = [k for k in keys if k not in target.files]
    if unknown:
        raise KeyError(f"{target.uri}: step {target.step} has no parts {unknown}; it has {sorted(target.files)}")
    return {k: load(target.files[k], weights_only=True, map_location=map_location) for k in keys}

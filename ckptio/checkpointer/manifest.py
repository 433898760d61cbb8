"""The layout under a Checkpointer's root: step directory names, the commit marker and the latest pointer.

Layout under ``root`` (any URI: local path, ``s3://``, ``gs://``, ``memory://``, an alias)::

    root/latest.txt                 the latest pointer: the step directory's name and a newline
    root/000000001000/              one directory per step: the step, zero-padded to 12 digits
        state.pt | state.fpk        format "pt" / "fpk": the whole state in one file
        __*.distcp .metadata        format "dcp": a ckptio.dcp checkpoint (its .metadata written last)
        checkpoint.json             the commit marker, written last, create-only

A directory whose name is the step padded to 12 digits is ckptio's (committed or the debris of a
killed save); another all-digit name (``199``, written by hand or by another program: DINOv3 writes
unpadded step directories) is a step only once it holds ``checkpoint.json``. Without one it is not
ckptio's: it is neither listed, written into nor deleted (logged once at INFO).

A step directory is a checkpoint once its ``checkpoint.json`` exists (``list()`` shows only those); it is
deleted marker first, so a crash mid-delete leaves an uncommitted directory, never a committed one with
files missing. A pointer naming an incomplete or missing checkpoint is not trusted: :meth:`Layout.latest`
falls back to the newest complete checkpoint and says which (a :class:`CheckpointWarning`).

The marker is checked before anything it names is read (:func:`_check_manifest`): it cannot choose a
deserializer or a path.
"""

from __future__ import annotations

import builtins
import os
import re
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from .. import markers
from .. import uri as _uri
from ..backends.base import Backend
from ..context import resolve
from ..errors import CkptioError, FormatError, IncompleteCheckpointError, NotFoundError, Redacting, logger
from ..threads import Pool

log = logger("ckptio.checkpointer")

MARKER_NAME = "checkpoint.json"
POINTER_NAME = "latest.txt"
STEP_DIGITS = 12
MAX_STEP_DIGITS = 20  # a step past 2**64 is no step: a longer all-digit name is another file's
FORMATS = ("dcp", "fpk", "pt")
_DATA_FILE = {"pt": "state.pt", "fpk": "state.fpk"}
_FILE_FORMAT = {"pt": "torch", "fpk": "fastpickle"}  # the ckptio format each data file is read with, whatever its name


def _is_step_name(name: str) -> bool:
    """ASCII digits only (``str.isdigit`` also takes '²' and other characters ``int()`` refuses), at
    most :data:`MAX_STEP_DIGITS` of them."""
    return len(name) <= MAX_STEP_DIGITS and name.isascii() and name.isdigit()


def _is_own_name(name: str) -> bool:
    """The name ckptio gives a step directory: the step zero-padded to :data:`STEP_DIGITS` digits."""
    return _is_step_name(name) and name == f"{int(name):0{STEP_DIGITS}d}"


class CheckpointWarning(Redacting, RuntimeWarning):
    """A checkpoint choice the caller should know about (fallback, partial restore, replaced step)."""


@dataclass(frozen=True)
class CheckpointInfo:
    step: int
    uri: str


def step_of_name(u: str) -> int:
    """The step of a checkpoint without a marker: the number its name ends with (``1000``, ``step100.pt``,
    ``iter_000001000_model.pt``: a DINOv3 step directory, a Cosmos file), else 0."""
    found = re.findall(r"[0-9]+", _uri.basename(u.rstrip("/")))
    return int(found[-1]) if found and len(found[-1]) <= MAX_STEP_DIGITS else 0


def _parse_manifest(data: bytes, marker: str) -> Any:
    try:
        return markers.loads(data, marker)
    except FormatError as e:
        raise FormatError(f"{e}; the commit marker is damaged") from None


def read_manifest(backend: Backend, path: str, marker: str) -> Any:
    """The commit marker at ``path`` (resolved; ``marker``: its URI, for errors), parsed, not yet
    checked (:func:`_check_manifest`); at most :data:`~ckptio.markers.MAX_JSON_BYTES` are read."""
    try:
        data = markers.read(backend, path, marker, markers.MAX_JSON_BYTES)
    except FormatError as e:
        raise FormatError(f"{e}; the commit marker is damaged") from None
    return _parse_manifest(data, marker)


def _check_manifest(m: Any, marker: str) -> tuple[int, str, str | None]:
    """(step, format, data file name) of a commit marker, checked before anything it names is read
    (its ``content`` key too: a data file read through the content store, :mod:`.content`).

    The marker cannot choose a deserializer or a path: its format must be one of :data:`FORMATS`
    (each loads without running code unless the caller opts in), its files plain names inside the
    step directory with that format's extension; the file is then read as that format, whatever its
    name.
    """

    def bad(key: str, why: str) -> FormatError:
        return FormatError(
            f"{marker}: key {key!r} {why}; ckptio never writes such a commit marker (it was edited "
            f"or damaged), so nothing was loaded"
        )

    if not isinstance(m, dict):
        raise FormatError(
            f"{marker}: holds a JSON {type(m).__name__}, not an object; ckptio never writes such a "
            f"commit marker (it was edited or damaged), so nothing was loaded"
        )
    fmt = m.get("format")
    if not isinstance(fmt, str) or fmt not in FORMATS:
        raise bad("format", f"is {fmt!r}, not one of {list(FORMATS)}")
    step = m.get("step")
    if type(step) is not int or step < 0:
        raise bad("step", f"is {step!r}, not a non-negative int")
    files = m.get("files", [])
    if not isinstance(files, list) or not all(isinstance(f, str) for f in files):
        raise bad("files", f"is {files!r}, not a list of file names")
    for f in files:
        if f in ("", ".", "..") or any(c in f for c in "/\\:\0"):
            raise bad("files", f"names {f!r}, not a file directly inside the checkpoint directory")
    name = (files[0] if files else _DATA_FILE[fmt]) if fmt in _DATA_FILE else None
    if name is not None and not name.endswith("." + fmt):
        raise bad("files", f"names {name!r} for a {fmt!r} checkpoint, whose data file ends in '.{fmt}'")
    content = m.get("content")
    if content is not None and content != "xxh3_128":
        raise bad("content", f"is {content!r}; incremental checkpoints have 'xxh3_128'")
    return step, fmt, name


_BARE_FILES = {".pt": "pt", ".pth": "pt", ".fpk": "fpk"}  # a bare data file, by extension


def target_of_uri(u: str) -> tuple[int, str, str, str | None, bool]:
    """(step, directory URI, format, data file name, incremental) of the checkpoint directory or bare
    ``.pt``/``.pth``/``.fpk`` file ``u`` (another run's too; its step is the marker's, else the number its
    name ends with, else 0); ``IncompleteCheckpointError`` if ``u`` is neither."""
    backend, d = resolve(u)
    fmt = _BARE_FILES.get(os.path.splitext(d)[1])
    if fmt is not None and backend.isfile(d):
        return step_of_name(u), _uri.parent(u), fmt, _uri.basename(u), False
    if backend.isfile(_uri.join_path(d, MARKER_NAME)):
        marker = _uri.join_path(u, MARKER_NAME)
        m = read_manifest(backend, _uri.join_path(d, MARKER_NAME), marker)
        s, fmt, name = _check_manifest(m, marker)
        return s, u, fmt, name, m.get("content") is not None
    if backend.isfile(_uri.join_path(d, ".metadata")):
        return step_of_name(u), u, "dcp", None, False
    raise IncompleteCheckpointError(
        f"{u} is not a complete checkpoint (no {MARKER_NAME}, no DCP .metadata, not a .pt/.pth/.fpk file)"
    )


class Layout:
    """The step directories, commit markers and latest pointer under one root (the user's ``root_uri``).

    Caches the directory name of each step (unpadded ones too) and the markers read or written.
    """

    def __init__(self, root_uri: str) -> None:
        self.root_uri = root_uri
        self.backend, self.root = resolve(root_uri)
        self.names: dict[int, str] = {}
        self.manifests: dict[int, dict[str, Any]] = {}
        self.foreign: set[str] = set()  # all-digit directories without a marker: not ckptio's (step_dirs)
        self.started: set[int] = set()  # steps this process began saving and has not committed (retention)

    # ---- paths -----------------------------------------------------------------------------
    def name(self, step: int) -> str:
        return self.names.get(step) or f"{step:0{STEP_DIGITS}d}"

    def dir(self, step: int) -> str:
        """The resolved (backend) path of the directory for ``step``."""
        return _uri.join_path(self.root, self.name(step))

    def uri(self, step: int) -> str:
        """The (unresolved) URI of the directory for ``step``."""
        return _uri.join_path(self.root_uri, self.name(step))

    def user_uri(self, step: int, *names: str) -> str:
        return _uri.join_path(self.uri(step), *names)

    # ---- queries -----------------------------------------------------------------------------
    def committed(self, step: int, names: dict[int, str] | None = None) -> bool:
        name = (names or {}).get(step) or self.name(step)
        return self.backend.isfile(_uri.join_path(self.root, name, MARKER_NAME))

    def committed_among(self, steps: Iterable[int], names: dict[int, str] | None = None) -> builtins.list[int]:
        """Those of ``steps`` that are committed (in the directories ``names`` gives, else their own),
        ascending; an object store is asked about several at once (one request each, in parallel)."""
        steps = sorted(steps)

        def committed(s: int) -> bool:
            return self.committed(s, names)

        if len(steps) <= 1 or self.backend.reads_local:
            return [s for s in steps if committed(s)]
        with Pool(min(len(steps), self.backend.concurrency), thread_name_prefix="ckptio-ls") as ex:
            return [s for s, ok in zip(steps, ex.map(committed, steps), strict=True) if ok]

    def step_dirs(self) -> dict[int, str]:
        """Step -> directory name of every step directory of ckptio's directly under root (complete or
        not): padded names, and other all-digit names that hold a marker (the rest: :attr:`foreign`)."""
        root = self.root.rstrip("/")
        out: dict[int, str] = {}
        try:
            entries = builtins.list(self.backend.list(self.root, recursive=False))
        except (FileNotFoundError, NotADirectoryError):
            return out
        others: dict[int, str] = {}
        for info in entries:
            u = info.uri.rstrip("/")
            name = _uri.basename(u)
            # only direct children of this root: "root-2/..." or "root/x/5" never match
            if not info.is_dir or not _is_step_name(name) or u != _uri.join_path(root, name).rstrip("/"):
                continue
            if _is_own_name(name):
                out[int(name)] = name
            elif name not in self.foreign and int(name) not in others:
                others[int(name)] = name
        marked = self.committed_among(others, others)
        found = [others[s] for s in sorted(others) if s not in marked]
        if found:
            self.foreign.update(found)
            log.info(
                "%s: ignoring %d director%s that ckptio did not write (all-digit names without %s, e.g. "
                "another program's steps): %s; ckptio neither lists nor deletes them",
                self.root_uri,
                len(found),
                "y" if len(found) == 1 else "ies",
                MARKER_NAME,
                ", ".join(found[:10]) + (", ..." if len(found) > 10 else ""),
            )
        out.update({s: others[s] for s in marked if s not in out})  # a padded name wins
        self.names = dict(out)
        return out

    def list(self) -> builtins.list[int]:
        """Steps of the complete checkpoints under root, ascending."""
        return self.committed_among(self.step_dirs())

    def pointer(self) -> int | None:
        """The step the latest pointer names (checked for its form only), or None (a warning if it is
        malformed: then :meth:`latest` falls back to the newest complete checkpoint)."""
        shown = f"{self.root_uri}/{POINTER_NAME}"
        try:
            data = markers.read(self.backend, _uri.join_path(self.root, POINTER_NAME), shown, markers.MAX_POINTER_BYTES)
            text = markers.text(data, shown).strip()
            name = _uri.basename(text)
            if not _is_step_name(name):
                raise FormatError(f"{shown}: names no step directory: {text[:80]!r}")
        except FileNotFoundError:
            return None
        except FormatError as e:
            warnings.warn(f"ignoring malformed latest pointer: {e}", CheckpointWarning, stacklevel=4)
            return None
        self.names.setdefault(int(name), name)
        return int(name)

    def latest(self) -> int | None:
        """Step of the latest complete checkpoint: the pointer's, else (missing or incomplete) the newest complete."""
        ptr = self.pointer()
        if ptr is not None and self.committed(ptr):
            return ptr
        steps = self.list()
        why = "is missing" if ptr is None else f"names step {ptr}, which is not a complete checkpoint"
        if not steps:
            if ptr is not None:
                warnings.warn(
                    f"{self.root_uri}: the latest pointer {why} and no complete checkpoint exists",
                    CheckpointWarning,
                    stacklevel=3,
                )
            return None
        warnings.warn(
            f"{self.root_uri}: the latest pointer {why}; using the newest complete checkpoint, "
            f"step {steps[-1]} ({self.uri(steps[-1])})",
            CheckpointWarning,
            stacklevel=3,
        )
        return steps[-1]

    def manifest(self, step: int) -> dict[str, Any]:
        """The commit marker's contents for ``step`` (format, files, metrics, time)."""
        m = self.manifests.get(step)
        if m is None:
            try:
                path = _uri.join_path(self.dir(step), MARKER_NAME)
                m = read_manifest(self.backend, path, self.user_uri(step, MARKER_NAME))
            except FileNotFoundError:
                if self.backend.isdir(self.dir(step)):
                    raise IncompleteCheckpointError(
                        f"checkpoint {self.uri(step)} is incomplete (no {MARKER_NAME})"
                    ) from None
                raise NotFoundError(self.uri(step), "no checkpoint for this step") from None
            self.manifests[step] = m
        return m

    def resolve_target(self, step: Any) -> tuple[int | None, str | None, str | None, str | None, bool]:
        """(step, directory URI, format, data file name, incremental) to load; None when there is nothing yet.

        ``step``: ``"latest"``, an int, or the URI of any checkpoint directory (another run's too).
        """
        if (isinstance(step, int) and not isinstance(step, bool)) or step == "latest":
            if step == "latest":
                step = self.latest()
                if step is None:
                    return None, None, None, None, False
            else:
                self.step_dirs()  # learns the directory names (unpadded ones too)
            m = self.manifest(step)
            _, fmt, name = _check_manifest(m, self.user_uri(step, MARKER_NAME))
            return step, self.uri(step), fmt, name, m.get("content") is not None
        if isinstance(step, (str, os.PathLike)):
            return target_of_uri(os.fspath(step).rstrip("/"))
        raise TypeError(f"step must be 'latest', an int or a URI, got {step!r}")

    # ---- changes -------------------------------------------------------------------------------
    def begin(self, step: int) -> None:
        """A save of ``step`` starts here: its cached marker is forgotten, and until it commits what it
        leaves is this process's own debris (:func:`.retention.prune`)."""
        self.manifests.pop(step, None)
        self.started.add(step)

    def commit(self, step: int, manifest: dict[str, Any]) -> None:
        """Write the marker (create-only: the checkpoint is complete from here on), then the pointer."""
        data = markers.dumps(manifest, self.user_uri(step, MARKER_NAME), indent=1, sort_keys=True)
        self.backend.write(_uri.join_path(self.dir(step), MARKER_NAME), data, mode="create")
        self.manifests[step] = manifest
        self.started.discard(step)
        self.backend.write(_uri.join_path(self.root, POINTER_NAME), (self.name(step) + "\n").encode(), mode="overwrite")

    def uncommit(self, step: int) -> None:
        """Remove the marker of ``step``, so its data can be touched."""
        self.backend.delete(_uri.join_path(self.dir(step), MARKER_NAME))

    def delete(self, step: int) -> None:
        """Delete checkpoint ``step``; if it is the latest, the pointer moves to the newest remaining one."""
        if step not in self.step_dirs():
            raise NotFoundError(self.uri(step), "no checkpoint for this step")
        was_latest = self.pointer() == step
        self.discard(step)
        if was_latest:
            rest = self.list()
            ptr = _uri.join_path(self.root, POINTER_NAME)
            if rest:
                self.backend.write(ptr, (self.name(rest[-1]) + "\n").encode(), mode="overwrite")
            else:
                self.backend.delete(ptr)

    def discard(self, step: int) -> None:
        """Delete the directory of ``step``, marker first; the pointer is left as it is."""
        d = self.dir(step)
        self.manifests.pop(step, None)
        try:
            self.uncommit(step)
        except FileNotFoundError:
            pass
        self.rmtree(d)
        log.info("deleted checkpoint %s", self.uri(step))

    def rmtree(self, d: str) -> None:
        prefix = d.rstrip("/") + "/"
        try:
            entries = [i for i in self.backend.list(d, recursive=True) if not i.is_dir]
        except (FileNotFoundError, NotADirectoryError):
            return
        if any(not i.uri.startswith(prefix) for i in entries):  # never follow a backend outside the directory
            raise CkptioError(f"refusing to delete {d}: its listing has entries outside it")
        self.backend.rmtree(d)

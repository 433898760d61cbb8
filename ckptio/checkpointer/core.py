"""``Checkpointer``: crash-safe, resumable training checkpoints on any ckptio URI.

Layout under ``root`` (any URI: local path, ``s3://``, ``gs://``, ``memory://``, an alias)::

    root/latest.txt                 the latest pointer: the step directory's name and a newline
    root/000000001000/              one directory per step: the step, zero-padded to 12 digits
        state.pt | state.fpk        format "pt" / "fpk": the whole state in one file
        __*.distcp .metadata        format "dcp": a ckptio.dcp checkpoint (its .metadata written last)
        checkpoint.json             the commit marker, written last, create-only

Any all-digit directory name is read as a step (so unpadded names written by hand also work).

Commit protocol of ``save(step, state)``:

1. if ``root/<step>/`` exists but is not committed it is debris of a crashed save and is wiped; a
   committed one is replaced only when it is not the latest (its marker is removed first). With
   ``dcp`` only the DCP checkpoint there is discarded (its ``.metadata`` and the data objects that
   names, :func:`ckptio.dcp.discard`), never the whole directory: DCP names data objects per save,
   so of two saves of one step at once the first DCP commit wins and the other raises
   :class:`AlreadyExistsError` (only a save starting between another's DCP commit and its marker
   replaces that one's data);
2. the data objects are written (each atomic on its own; DCP commits its ``.metadata`` last);
3. ``checkpoint.json`` (format, step, metrics, files) is written with ``mode="create"``: from here on the
   checkpoint is complete; ``list()`` shows only directories with this marker;
4. ``latest.txt`` is replaced atomically (local: rename; object stores: one PUT);
5. retention deletes old checkpoints of this root (marker first, so a crash mid-delete leaves an
   uncommitted directory, never a committed one with files missing), never the latest.

Before its first save, rank 0 also discards what killed saves left under root and storage keeps:
S3 multipart uploads and local temporary files (``.latest.txt.ckptio-tmp-*``) of the pointer and
of step directories, started more than ``stale_after`` seconds ago (6 hours by default, so never
a save still running in another process), through the backend's ``list_pending_writes``.

A crash anywhere leaves the pointer naming a complete checkpoint, or naming an incomplete/missing
one, in which case :meth:`Checkpointer.latest` falls back to the newest complete checkpoint and says
which (a :class:`CheckpointWarning`). Under ``torch.distributed`` every rank calls ``save``/``load``;
DCP data is written by all ranks, ``pt``/``fpk`` files, the marker, the pointer and cleanup by rank 0,
with outcomes shared over a gloo group whose collectives time out after ``timeout`` seconds.

Async save (``async_save=True``): ``save`` copies every tensor into staging buffers kept between
saves (one copy of the state at most; reallocated only when shapes change), then returns; a single
background thread persists and commits. The next ``save``/``load``/``wait`` first waits for it and
re-raises its exception if it failed.
"""

from __future__ import annotations

import builtins
import concurrent.futures as cf
import copy
import functools
import json
import logging
import os
import random
import sys
import threading
import time
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch

from .. import uri as _uri
from ..context import resolve
from ..errors import AlreadyExistsError, CkptioError, FormatError, IncompleteCheckpointError, NotFoundError

__all__ = [
    "Checkpointer",
    "CheckpointWarning",
    "CheckpointInfo",
    "LoadResult",
    "RNGState",
    "MARKER_NAME",
    "POINTER_NAME",
]

log = logging.getLogger("ckptio.checkpointer")

MARKER_NAME = "checkpoint.json"
POINTER_NAME = "latest.txt"
STEP_DIGITS = 12
FORMATS = ("dcp", "fpk", "pt")
_DATA_FILE = {"pt": "state.pt", "fpk": "state.fpk"}
_FILE_FORMAT = {"pt": "torch", "fpk": "fastpickle"}  # the ckptio format each data file is read with, whatever its name
STALE_AFTER = 6 * 3600.0


def _is_step_name(name: str) -> bool:
    """ASCII digits only: ``str.isdigit`` also takes '²' and other characters ``int()`` refuses."""
    return name.isascii() and name.isdigit()


class CheckpointWarning(RuntimeWarning):
    """A checkpoint choice the caller should know about (fallback, partial restore, replaced step)."""


@dataclass(frozen=True)
class CheckpointInfo:
    step: int
    uri: str


@dataclass
class LoadResult:
    """What the last :meth:`Checkpointer.load` restored (``Checkpointer.last_load``)."""

    step: int | None
    uri: str | None
    missing_keys: list[str] = field(default_factory=list)
    unexpected_keys: list[str] = field(default_factory=list)


def tree_has(tree: Any, path: Sequence[Any]) -> bool:
    for p in path:
        try:
            tree = tree[p]
        except (KeyError, IndexError, TypeError):
            return False
    return True


def _fill_empty(template: Any, tree: Any) -> None:
    if isinstance(template, dict) and isinstance(tree, dict):
        for k, v in template.items():
            if isinstance(v, (dict, list)) and not v and k not in tree:
                tree[k] = type(v)()
            elif k in tree:
                _fill_empty(v, tree[k])


def _is_stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


class RNGState:
    """A ``Stateful`` holding the process's RNG states (torch CPU and CUDA, Python ``random``, NumPy).

    Put ``RNGState()`` in the state given to ``save``/``load`` to checkpoint and restore them.
    """

    def state_dict(self) -> dict[str, Any]:
        sd: dict[str, Any] = {"torch": torch.get_rng_state(), "python": list(_py_rng_flat())}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            sd["cuda"] = torch.cuda.get_rng_state_all()
        try:
            import numpy as np
        except ImportError:
            return sd
        name, keys, pos, has_gauss, cached = np.random.get_state()
        sd["numpy"] = {
            "name": str(name),
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        }
        return sd

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        torch.set_rng_state(sd["torch"])
        version, *internal, gauss = sd["python"]
        random.setstate((int(version), tuple(int(x) for x in internal), None if gauss is None else float(gauss)))
        if "cuda" in sd and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(sd["cuda"])
        if "numpy" in sd:
            import numpy as np

            n = sd["numpy"]
            np.random.set_state(
                (
                    n["name"],
                    n["keys"].numpy().astype(np.uint32),
                    int(n["pos"]),
                    int(n["has_gauss"]),
                    float(n["cached_gaussian"]),
                )
            )


def _py_rng_flat() -> tuple:
    version, internal, gauss = random.getstate()
    return (version, *internal, gauss)


def _lower_priority(nice: int | None) -> None:
    """Raise the calling thread's nice value (Linux: per thread, inherited by threads it creates)."""
    if nice and sys.platform.startswith("linux"):
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), os.getpriority(os.PRIO_PROCESS, 0) + nice)
        except OSError as e:
            log.debug("could not lower the persist thread's priority: %s", e)


# ---------------------------------------------------------------------------------------------
# staging for async save


class _Stager:
    """Copies a state tree into CPU buffers reused across calls (keyed by path, reallocated on change)."""

    def __init__(self) -> None:
        self._bufs: dict[tuple, torch.Tensor] = {}
        self.nbytes = 0

    def stage(self, tree: Any) -> Any:
        used: set[tuple] = set()
        out = self._stage(tree, (), used)
        for k in set(self._bufs) - used:  # bounded: only buffers of the current state are kept
            del self._bufs[k]
        self.nbytes = sum(b.numel() * b.element_size() for b in self._bufs.values())
        if any(b.is_pinned() for b in self._bufs.values()):
            torch.cuda.synchronize()
        return out

    def _stage(self, obj: Any, path: tuple, used: set[tuple]) -> Any:
        if isinstance(obj, torch.Tensor):
            t = obj.detach()
            if t.layout != torch.strided or t.is_quantized or type(t) is not torch.Tensor:
                return t.clone()  # sparse, quantized, DTensor...: a plain copy, not pooled
            buf = self._bufs.get(path)
            if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                pin = t.device.type == "cuda"
                buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
                self._bufs[path] = buf
            used.add(path)
            buf.copy_(t, non_blocking=buf.is_pinned())
            return buf
        if isinstance(obj, dict):
            try:
                out = type(obj)()
            except TypeError:
                out = {}
            for k, v in obj.items():
                out[k] = self._stage(v, path + (k,), used)
            return out
        if isinstance(obj, list):
            return [self._stage(v, path + (i,), used) for i, v in enumerate(obj)]
        if isinstance(obj, tuple):
            items = [self._stage(v, path + (i,), used) for i, v in enumerate(obj)]
            return type(obj)(*items) if hasattr(obj, "_fields") else tuple(items)
        return copy.deepcopy(obj)


# ---------------------------------------------------------------------------------------------
# restoring in place


def _apply(target: Any, source: Any, prefix: str, res: LoadResult) -> Any:
    """Restore ``source`` into ``target`` in place where possible; returns the value to store."""
    if _is_stateful(target):
        if isinstance(target, torch.nn.Module):
            out = target.load_state_dict(source, strict=False)
            res.missing_keys += [prefix + k for k in out.missing_keys]
            res.unexpected_keys += [prefix + k for k in out.unexpected_keys]
        else:
            target.load_state_dict(source)
        return target
    if isinstance(target, torch.Tensor) and isinstance(source, torch.Tensor):
        if target is source:
            return target
        if target.shape == source.shape and target.dtype == source.dtype:
            with torch.no_grad():
                target.copy_(source)
            return target
        return source
    if isinstance(target, dict) and isinstance(source, Mapping):
        for k in list(target):
            if k not in source:
                res.missing_keys.append(f"{prefix}{k}")
            else:
                target[k] = _apply(target[k], source[k], f"{prefix}{k}.", res)
        for k in source:
            if k not in target:
                res.unexpected_keys.append(f"{prefix}{k}")
                target[k] = source[k]
        return target
    return source


# ---------------------------------------------------------------------------------------------


def _report_background_failure(uri: str, fut: cf.Future) -> None:
    """Log a failed background save at once: if the program ends without another call, the error
    would otherwise vanish. It is still raised by the next ``save``/``wait``/``close``."""
    exc = fut.exception()
    if exc is not None:
        log.error("background save of %s failed; it will be raised by the next save/wait/close: %r", uri, exc)


def _parse_manifest(data: bytes, marker: str) -> Any:
    try:
        return json.loads(data)
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise FormatError(f"{marker}: not valid JSON ({e}); the commit marker is damaged") from None


def _check_manifest(m: Any, marker: str) -> tuple[int, str, str | None]:
    """(step, format, data file name) of a commit marker, checked before anything it names is read.

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
    return step, fmt, name


class Checkpointer:
    """Numbered checkpoints under ``root_uri`` with a latest pointer, retention and async save.

    ``format``: ``"dcp"`` (sharded, every rank writes; see :mod:`ckptio.dcp`), ``"fpk"`` or ``"pt"``
    (one file, written by rank 0). Retention keeps the union of: the ``keep_last`` newest steps, every
    step divisible by ``keep_every``, the ``keep_best`` best by ``metrics[best_metric]`` (``best_mode``
    ``"min"`` or ``"max"``), and always the latest; with no rule set nothing is deleted.
    ``process_group``: the group to coordinate over (default: a new gloo group when
    ``torch.distributed`` is initialized); ``timeout``: seconds for each collective.
    ``stale_after``: seconds after which an unfinished write under root is taken for the debris of a
    killed save and discarded before the first save (see above); ``None``: never.
    ``background_nice``: the async persist thread (and the threads it starts) runs at this nice
    increment on Linux, so background I/O yields the CPU to training; ``None`` leaves it unchanged.
    ``save_options``/``load_options`` go to the format's save/load (``ckptio.dcp.save``/``load`` or
    ``ckptio.dump``/``load``); ``weights_only`` applies to ``pt`` loads. With ``"dcp"``, failures raise the
    failed rank's error as :func:`ckptio.dcp.save`/``load`` do, never torch's ``CheckpointException``.
    ``load`` runs no code from the files by default (see :meth:`load`'s ``allow_pickle``).
    """

    def __init__(
        self,
        root_uri: str | os.PathLike,
        *,
        format: str = "dcp",
        keep_last: int | None = None,
        keep_every: int | None = None,
        keep_best: int | None = None,
        best_metric: str | None = None,
        best_mode: str = "min",
        async_save: bool = False,
        process_group: Any = None,
        timeout: float = 600.0,
        weights_only: bool = True,
        save_options: Mapping[str, Any] | None = None,
        load_options: Mapping[str, Any] | None = None,
        background_nice: int | None = 10,
        stale_after: float | None = STALE_AFTER,
    ) -> None:
        if format not in FORMATS:
            raise ValueError(f"format must be one of {FORMATS}, got {format!r}")
        for name, v in (("keep_last", keep_last), ("keep_every", keep_every), ("keep_best", keep_best)):
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ValueError(f"{name} must be a positive int or None, got {v!r}")
        if keep_best is not None and not best_metric:
            raise ValueError("keep_best needs best_metric= (the metrics key to rank checkpoints by)")
        if best_mode not in ("min", "max"):
            raise ValueError(f"best_mode must be 'min' or 'max', got {best_mode!r}")
        if stale_after is not None and not float(stale_after) >= 0:
            raise ValueError(f"stale_after must be >= 0 seconds or None, got {stale_after!r}")
        self.root_uri = os.fspath(root_uri).rstrip("/") or os.fspath(root_uri)
        self.format = format
        self.keep_last, self.keep_every, self.keep_best = keep_last, keep_every, keep_best
        self.best_metric, self.best_mode = best_metric, best_mode
        self.async_save = bool(async_save)
        self.background_nice = background_nice
        self.timeout = float(timeout)
        self.weights_only = bool(weights_only)
        self.save_options = dict(save_options or {})
        self.load_options = dict(load_options or {})
        self.stale_after = None if stale_after is None else float(stale_after)
        self._swept = stale_after is None
        self.last_load: LoadResult | None = None
        self._backend, self._root = resolve(self.root_uri)
        self._names: dict[int, str] = {}
        self._manifests: dict[int, dict[str, Any]] = {}
        self._stager = _Stager()
        self._pool: cf.ThreadPoolExecutor | None = None
        self._future: cf.Future | None = None
        self._lock = threading.Lock()
        self._pg = None
        self._rank, self._world = 0, 1
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            self._rank, self._world = dist.get_rank(), dist.get_world_size()
            self._pg = (
                process_group
                if process_group is not None
                else dist.new_group(backend="gloo", timeout=timedelta(seconds=self.timeout))
            )

    def __repr__(self) -> str:
        return f"Checkpointer({self.root_uri!r}, format={self.format!r})"

    # ---- paths -----------------------------------------------------------------------------
    def _name(self, step: int) -> str:
        return self._names.get(step) or f"{step:0{STEP_DIGITS}d}"

    def _dir(self, step: int) -> str:
        return _uri.join_path(self._root, self._name(step))

    def uri(self, step: int) -> str:
        """The (unresolved) URI of the directory for ``step``."""
        return _uri.join_path(self.root_uri, self._name(step))

    def _user_uri(self, step: int, *names: str) -> str:
        return _uri.join_path(self.uri(step), *names)

    # ---- queries -----------------------------------------------------------------------------
    def _committed(self, step: int) -> bool:
        return self._backend.isfile(_uri.join_path(self._dir(step), MARKER_NAME))

    def _step_dirs(self) -> dict[int, str]:
        """Step -> directory name of every step directory directly under root (complete or not)."""
        root = self._root.rstrip("/")
        out: dict[int, str] = {}
        try:
            entries = list(self._backend.list(self._root, recursive=False))
        except (FileNotFoundError, NotADirectoryError):
            return out
        for info in entries:
            u = info.uri.rstrip("/")
            name = _uri.basename(u)
            # only direct children of this root: "root-2/..." or "root/x/5" never match
            if not info.is_dir or not _is_step_name(name) or u != _uri.join_path(root, name).rstrip("/"):
                continue
            step = int(name)
            if step not in out or name == f"{step:0{STEP_DIGITS}d}":
                out[step] = name
        self._names = dict(out)
        return out

    def list(self) -> list[int]:
        """Steps of the complete checkpoints under root, ascending."""
        return sorted(s for s in self._step_dirs() if self._committed(s))

    def _pointer(self) -> int | None:
        try:
            text = self._backend.read(_uri.join_path(self._root, POINTER_NAME)).decode("utf-8").strip()
        except FileNotFoundError:
            return None
        name = _uri.basename(text)
        if not _is_step_name(name):
            warnings.warn(
                f"ignoring malformed latest pointer {self.root_uri}/{POINTER_NAME}: {text[:80]!r}",
                CheckpointWarning,
                stacklevel=3,
            )
            return None
        self._names.setdefault(int(name), name)
        return int(name)

    def latest(self) -> int | None:
        """Step of the latest complete checkpoint: the pointer's, else (missing or incomplete) the newest complete."""
        ptr = self._pointer()
        if ptr is not None and self._committed(ptr):
            return ptr
        steps = self.list()
        why = "is missing" if ptr is None else f"names step {ptr}, which is not a complete checkpoint"
        if not steps:
            if ptr is not None:
                warnings.warn(
                    f"{self.root_uri}: the latest pointer {why} and no complete checkpoint exists",
                    CheckpointWarning,
                    stacklevel=2,
                )
            return None
        warnings.warn(
            f"{self.root_uri}: the latest pointer {why}; using the newest complete checkpoint, "
            f"step {steps[-1]} ({self.uri(steps[-1])})",
            CheckpointWarning,
            stacklevel=2,
        )
        return steps[-1]

    def manifest(self, step: int) -> dict[str, Any]:
        """The commit marker's contents for ``step`` (format, files, metrics, time)."""
        m = self._manifests.get(step)
        if m is None:
            try:
                data = self._backend.read(_uri.join_path(self._dir(step), MARKER_NAME))
            except FileNotFoundError:
                if self._backend.isdir(self._dir(step)):
                    raise IncompleteCheckpointError(
                        f"checkpoint {self.uri(step)} is incomplete (no {MARKER_NAME})"
                    ) from None
                raise NotFoundError(self.uri(step), "no checkpoint for this step") from None
            m = _parse_manifest(data, self._user_uri(step, MARKER_NAME))
            self._manifests[step] = m
        return m

    # ---- distributed helpers -------------------------------------------------------------------
    def _on_rank0(self, fn, *args: Any) -> Any:
        """Run ``fn`` on rank 0 and give every rank its result, or raise its error on every rank."""
        result, err = None, None
        if self._rank == 0:
            try:
                result = fn(*args)
            except BaseException as e:  # noqa: BLE001 - re-raised below, on every rank
                err = e
        if self._pg is not None:
            import torch.distributed as dist

            box = [(result, None if err is None else f"{type(err).__name__}: {err}")]
            dist.broadcast_object_list(box, src=dist.get_global_rank(self._pg, 0), group=self._pg)
            result, msg = box[0]
            if err is None and msg is not None:
                raise CkptioError(f"rank 0 failed: {msg}")
        if err is not None:
            raise err
        return result

    def _barrier(self) -> None:
        if self._pg is not None:
            import torch.distributed as dist

            dist.monitored_barrier(group=self._pg, timeout=timedelta(seconds=self.timeout), wait_all_ranks=True)

    # ---- save --------------------------------------------------------------------------------
    def save(self, step: int, state: Mapping[str, Any], *, metrics: Mapping[str, float] | None = None) -> None:
        """Save ``state`` (parts by name; tensors, containers, ``Stateful`` objects) as checkpoint ``step``."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        if not isinstance(state, Mapping) or not state:
            raise TypeError("state must be a non-empty mapping of part name -> state")
        if self.keep_best is not None and (metrics is None or self.best_metric not in metrics):
            warnings.warn(
                f"save({step}): metrics lack {self.best_metric!r}; this checkpoint never counts as best",
                CheckpointWarning,
                stacklevel=2,
            )
        self.wait()
        sd = {k: (v.state_dict() if _is_stateful(v) else v) for k, v in state.items()}
        metrics = {k: float(v) for k, v in (metrics or {}).items()}
        if not self.async_save:
            self._persist(step, sd, metrics)
            return
        staged = self._stager.stage(sd)
        if self._pool is None:
            self._pool = cf.ThreadPoolExecutor(
                1,
                thread_name_prefix="ckptio-checkpointer",
                initializer=_lower_priority,
                initargs=(self.background_nice,),
            )
        self._future = self._pool.submit(self._persist, step, staged, metrics)
        self._future.add_done_callback(functools.partial(_report_background_failure, self.uri(step)))

    def wait(self) -> None:
        """Wait for the background save, if any; re-raise its exception if it failed."""
        with self._lock:
            fut, self._future = self._future, None
        if fut is not None:
            fut.result()

    def close(self) -> None:
        """Wait for the background save (raising its error) and stop the background thread."""
        try:
            self.wait()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _persist(self, step: int, sd: dict[str, Any], metrics: dict[str, float]) -> None:
        t0 = time.perf_counter()
        self._on_rank0(self._prepare, step)
        files = self._write_data(step, sd)
        manifest = {
            "step": step,
            "format": self.format,
            "files": files,
            "parts": sorted(map(str, sd)),
            "metrics": metrics,
            "time": time.time(),
            "world_size": self._world,
        }
        self._on_rank0(self._commit, step, manifest)
        log.info("saved checkpoint %s in %.2fs", self.uri(step), time.perf_counter() - t0)

    def _abort_stale_writes(self) -> None:
        """Discard the unfinished writes killed saves left under root (``stale_after``); once."""
        prefix = self._root.rstrip("/") + "/"

        def ours(uri: str) -> bool:  # the pointer, or something in a step directory
            rel = uri[len(prefix) :] if uri.startswith(prefix) else ""
            return rel == POINTER_NAME or ("/" in rel and _is_step_name(rel.split("/", 1)[0]))

        cutoff = time.time() - (self.stale_after or 0.0)
        try:
            stale = [w for w in self._backend.list_pending_writes(self._root) if w.since <= cutoff and ours(w.uri)]
            for w in stale:
                self._backend.abort_pending_write(w)
        except PermissionError as e:
            warnings.warn(
                f"{self.root_uri}: cannot discard the unfinished writes of killed saves ({e}); they stay "
                "until removed otherwise (S3: grant s3:ListBucketMultipartUploads and "
                "s3:AbortMultipartUpload, or add a lifecycle rule); stale_after=None skips this",
                CheckpointWarning,
                stacklevel=2,
            )
        else:
            if stale:
                log.info(
                    "discarded %d unfinished write(s) of killed saves under %s: %s",
                    len(stale),
                    self.root_uri,
                    ", ".join(sorted({w.uri for w in stale})),
                )
        self._swept = True

    def _prepare(self, step: int) -> None:
        if not self._swept:
            self._abort_stale_writes()
        d = self._dir(step)
        self._manifests.pop(step, None)
        if self._committed(step):
            if self._pointer() == step:
                raise AlreadyExistsError(
                    self.uri(step), "this step is the latest checkpoint; delete it first to save it again"
                )
            warnings.warn(
                f"replacing the existing checkpoint {self.uri(step)} (not the latest)", CheckpointWarning, stacklevel=2
            )
            self._backend.delete(_uri.join_path(d, MARKER_NAME))  # uncommit before touching its data
        if self.format == "dcp":
            from .. import dcp

            # not the whole directory: another save of this step may be writing its own data objects there
            dcp.discard(self.uri(step))
        else:
            self._rmtree(d)  # debris of a crashed save, or the uncommitted old data

    def _write_data(self, step: int, sd: dict[str, Any]) -> builtins.list[str]:
        if self.format == "dcp":
            from .. import dcp

            dcp.save(sd, self.uri(step), process_group=self._pg, **self.save_options)
            return []
        return self._on_rank0(self._write_file, step, sd)

    def _write_file(self, step: int, sd: dict[str, Any]) -> builtins.list[str]:
        from ..io import dump

        name = _DATA_FILE[self.format]
        dump(sd, self._user_uri(step, name), **self.save_options)
        return [name]

    def _commit(self, step: int, manifest: dict[str, Any]) -> None:
        data = json.dumps(manifest, indent=1, sort_keys=True).encode()
        self._backend.write(_uri.join_path(self._dir(step), MARKER_NAME), data, mode="create")
        self._manifests[step] = manifest
        self._backend.write(
            _uri.join_path(self._root, POINTER_NAME), (self._name(step) + "\n").encode(), mode="overwrite"
        )
        self._cleanup(step)

    # ---- retention -----------------------------------------------------------------------------
    def _keep(self, steps: Sequence[int], latest: int) -> set[int]:
        if self.keep_last is None and self.keep_every is None and self.keep_best is None:
            return set(steps)
        keep = {latest}
        if self.keep_last is not None:
            keep.update(sorted(steps)[-self.keep_last :])
        if self.keep_every is not None:
            keep.update(s for s in steps if s % self.keep_every == 0)
        if self.keep_best is not None:
            scored = []
            for s in steps:
                try:
                    v = self.manifest(s).get("metrics", {}).get(self.best_metric)
                except FileNotFoundError:
                    continue
                if v is not None:
                    scored.append((v if self.best_mode == "min" else -v, -s, s))
            keep.update(s for *_, s in sorted(scored)[: self.keep_best])
        return keep

    def _cleanup(self, latest: int) -> None:
        dirs = self._step_dirs()
        complete = [s for s in dirs if self._committed(s)]
        doomed = [s for s in complete if s not in self._keep(complete, latest)]
        debris = [s for s in dirs if s not in complete and s < latest]
        for s in sorted(doomed) + sorted(debris):
            if s != latest:
                self._delete(s)

    # ---- delete ----------------------------------------------------------------------------------
    def delete(self, step: int) -> None:
        """Delete checkpoint ``step``; if it is the latest, the pointer moves to the newest remaining one."""
        self.wait()

        def run() -> None:
            if step not in self._step_dirs():
                raise NotFoundError(self.uri(step), "no checkpoint for this step")
            was_latest = self._pointer() == step
            self._delete(step)
            if was_latest:
                rest = self.list()
                ptr = _uri.join_path(self._root, POINTER_NAME)
                if rest:
                    self._backend.write(ptr, (self._name(rest[-1]) + "\n").encode(), mode="overwrite")
                else:
                    self._backend.delete(ptr)

        self._on_rank0(run)
        self._barrier()

    def _delete(self, step: int) -> None:
        d = self._dir(step)
        self._manifests.pop(step, None)
        try:
            self._backend.delete(_uri.join_path(d, MARKER_NAME))  # uncommit first
        except FileNotFoundError:
            pass
        self._rmtree(d)
        log.info("deleted checkpoint %s", self.uri(step))

    def _rmtree(self, d: str) -> None:
        prefix = d.rstrip("/") + "/"
        try:
            entries = [i for i in self._backend.list(d, recursive=True) if not i.is_dir]
        except (FileNotFoundError, NotADirectoryError):
            return
        if any(not i.uri.startswith(prefix) for i in entries):  # never follow a backend outside the directory
            raise CkptioError(f"refusing to delete {d}: its listing has entries outside it")
        self._backend.rmtree(d)

    # ---- load ------------------------------------------------------------------------------------
    def _resolve_target(self, step: Any) -> tuple[int | None, str | None, str | None, str | None]:
        """(step, directory URI, format, data file name) to load; all None when there is nothing yet."""
        if (isinstance(step, int) and not isinstance(step, bool)) or step == "latest":
            if step == "latest":
                step = self.latest()
                if step is None:
                    return None, None, None, None
            else:
                self._step_dirs()  # learns the directory names (unpadded ones too)
            _, fmt, name = _check_manifest(self.manifest(step), self._user_uri(step, MARKER_NAME))
            return step, self.uri(step), fmt, name
        if isinstance(step, (str, os.PathLike)):
            u = os.fspath(step).rstrip("/")
            backend, d = resolve(u)
            if backend.isfile(_uri.join_path(d, MARKER_NAME)):
                marker = _uri.join_path(u, MARKER_NAME)
                s, fmt, name = _check_manifest(
                    _parse_manifest(backend.read(_uri.join_path(d, MARKER_NAME)), marker), marker
                )
                return s, u, fmt, name
            if backend.isfile(_uri.join_path(d, ".metadata")):
                return 0, u, "dcp", None
            for fmt, name in _DATA_FILE.items():
                if d.endswith(name[5:]) and backend.isfile(d):
                    return 0, _uri.parent(u), fmt, _uri.basename(u)
            raise IncompleteCheckpointError(
                f"{u} is not a complete checkpoint (no {MARKER_NAME}, no DCP .metadata, not a .pt/.fpk file)"
            )
        raise TypeError(f"step must be 'latest', an int or a URI, got {step!r}")

    def load(
        self,
        state: dict[str, Any],
        *,
        step: Any = "latest",
        keys: Iterable[str] | None = None,
        strict: bool = True,
        cache: Any = None,
        allow_pickle: bool = False,
    ) -> int | None:
        """Restore ``state`` in place from a checkpoint; returns its step, or ``None`` if there is none yet.

        ``step``: ``"latest"``, an int, or the URI of any checkpoint directory (another run's too).
        ``keys``: the parts to restore (default: every part of ``state``). ``strict=False`` restores
        what matches and reports missing/unexpected keys (warning and ``self.last_load``);
        ``strict=True`` raises ``KeyError`` on any mismatch. ``cache`` (True, a directory or a mapping)
        reads the data through the node-local cache (:mod:`ckptio.backends.cached`).

        The checkpoint's own format is used (any of :data:`FORMATS`, whatever this Checkpointer saves).
        Loading runs no code from it: the commit marker cannot pick another deserializer or a path (its
        format and file names are checked), ``pt`` files load with ``weights_only``, ``fpk`` files
        unpickle nothing, ``dcp`` non-tensor items load only if they are plain data
        (:mod:`ckptio.dcp_checks`). For a checkpoint you trust, ``allow_pickle=True`` loads pickled
        objects in ``fpk`` and ``dcp`` files and ``pt`` files with ``weights_only=False``.
        """
        self.wait()
        s, d, fmt, name = self._on_rank0(self._resolve_target, step)
        if s is None:
            log.warning("no checkpoint under %s yet; nothing restored", self.root_uri)
            self.last_load = LoadResult(None, None)
            return None
        parts = list(state) if keys is None else list(keys)
        unknown = [k for k in parts if k not in state]
        if unknown:
            raise KeyError(f"keys {unknown} are not in the state given to load()")
        res = LoadResult(s, d)
        if fmt == "dcp":
            source, ckpt_parts = self._read_dcp(d, {k: state[k] for k in parts}, cache, allow_pickle)
        else:
            from ..io import load as _load

            kw = dict(self.load_options)
            if allow_pickle:
                kw["allow_pickle"] = True
            if cache is not None:
                kw["cache"] = cache
            if fmt == "pt":
                kw.setdefault("weights_only", self.weights_only and not kw.get("allow_pickle", False))
                kw.setdefault("map_location", "cpu")
            data_uri = _uri.join_path(d, name)
            source = _load(data_uri, file_format=_FILE_FORMAT[fmt], **kw)
            if not isinstance(source, Mapping):
                raise FormatError(f"{data_uri}: holds a {type(source).__name__}, not a checkpoint's mapping of parts")
            ckpt_parts = list(source)
        for k in parts:
            if k not in source:
                res.missing_keys.append(k)
            else:
                state[k] = _apply(state[k], source[k], f"{k}.", res)
        if keys is None:
            res.unexpected_keys += [k for k in ckpt_parts if k not in state]
        self.last_load = res
        if res.missing_keys or res.unexpected_keys:
            msg = (
                f"checkpoint {d} (step {s}) does not match the state: missing keys {res.missing_keys}, "
                f"unexpected keys {res.unexpected_keys}"
            )
            if strict:
                raise KeyError(msg + " (pass strict=False to restore what matches)")
            warnings.warn(msg, CheckpointWarning, stacklevel=2)
        log.info("restored step %d from %s", s, d)
        return s

    def _read_dcp(
        self, d: str, state: dict[str, Any], cache: Any = None, allow_pickle: bool = False
    ) -> tuple[dict[str, Any], builtins.list[str]]:
        """Read the parts in ``state`` from a DCP checkpoint: into the state's own tensors where they match,
        into new tensors for entries the state lacks (e.g. a fresh optimizer's moments)."""
        from torch.distributed.checkpoint._nested_dict import flatten_state_dict
        from torch.distributed.checkpoint._traverse import set_element
        from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        from .. import dcp

        opts = dict(self.load_options)
        if cache is not None:
            opts["cache"] = cache
        if allow_pickle:
            opts["allow_pickle"] = True
        reader = dcp.StorageReader(d, **opts)
        md = reader.read_metadata()
        template = {k: (v.state_dict() if _is_stateful(v) else v) for k, v in state.items()}
        flat, mappings = flatten_state_dict(template)
        tree: dict[str, Any] = {}
        for fqn, value in flat.items():  # a copy of the structure holding only what the checkpoint has
            meta = md.state_dict_metadata.get(fqn)
            if meta is None or (
                isinstance(meta, TensorStorageMetadata)
                and (not isinstance(value, torch.Tensor) or value.shape != meta.size)
            ):
                continue  # absent, or read into a new tensor below (a shape mismatch is reported by _apply)
            set_element(tree, mappings[fqn], value)
        new = {}
        for fqn in md.state_dict_metadata:
            path = (md.planner_data or {}).get(fqn)
            if path and path[0] in state and not (fqn in flat and tree_has(tree, path)):
                new[fqn] = path
        reader.set_up_storage_reader(md, True)
        reader.check_tensors(f for f in new if isinstance(md.state_dict_metadata[f], TensorStorageMetadata))
        for fqn, path in new.items():
            meta = md.state_dict_metadata[fqn]
            value = (
                torch.empty(meta.size, dtype=meta.properties.dtype) if isinstance(meta, TensorStorageMetadata) else None
            )
            set_element(tree, path, value)
        for k in tree:
            _fill_empty(template[k], tree[k])  # DCP stores no empty containers (e.g. an unstepped optimizer's state)
        if tree:
            dcp.load(tree, d, planner=DefaultLoadPlanner(), process_group=self._pg, **opts)
        for k, v in state.items():  # DCP paths store dict keys as str: optimizers index state by int
            st = tree.get(k, {}).get("state") if isinstance(v, torch.optim.Optimizer) else None
            if isinstance(st, dict):
                tree[k]["state"] = {int(i) if isinstance(i, str) and i.isdigit() else i: x for i, x in st.items()}
        return tree, sorted({p[0] for p in (md.planner_data or {}).values() if p})

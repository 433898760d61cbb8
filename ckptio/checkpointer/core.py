"""The ``Checkpointer`` class: the save and load sequences, run on every rank, delegating each step.

Commit protocol of ``save(step, state)``:

1. if ``root/<step>/`` exists but is not committed it is debris of a crashed save and is wiped; a
   committed one is replaced only when it is not the latest (its marker is removed first). With
   ``dcp`` only the DCP checkpoint there is discarded (its ``.metadata`` and the data objects that
   names, :func:`ckptio.dcp.discard`), never the whole directory: DCP names data objects per save,
   so of two saves of one step at once the first DCP commit wins and the other raises
   :class:`AlreadyExistsError` (only a save starting between another's DCP commit and its marker
   replaces that one's data, and one starting between another's marker and its pointer replaces
   that committed step as any step that is not the latest: both then return, and the step holds
   exactly the later one's complete state);
2. the data objects are written (each atomic on its own; DCP commits its ``.metadata`` last;
   :mod:`.formats`);
3. ``checkpoint.json`` (format, step, metrics, files) is written with ``mode="create"``: from here on the
   checkpoint is complete; ``list()`` shows only directories with this marker (:mod:`.manifest`);
4. ``latest.txt`` is replaced atomically (local: rename; object stores: one PUT);
5. retention deletes old checkpoints of this root (:mod:`.retention`), never the latest.

A crash anywhere leaves the pointer naming a complete checkpoint, or naming an incomplete/missing
one, in which case :meth:`Checkpointer.latest` falls back to the newest complete checkpoint and says
which (a :class:`CheckpointWarning`). Under ``torch.distributed`` every rank calls ``save``/``load``;
DCP data is written by all ranks, ``pt``/``fpk`` files, the marker, the pointer and cleanup by rank 0,
with outcomes shared over a gloo group whose collectives time out after ``timeout`` seconds.
Async save: :mod:`.staging`. Tiered (``local_tier=``): steps 1-4 run on the local tier, which then
evicts (``keep_local``) instead of step 5; the step is replicated to root in the background, where
retention runs after its commit (:mod:`.tiered`, :mod:`.replication`).
"""

from __future__ import annotations

import builtins
import contextlib
import math
import os
import time
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from .. import uri as _uri
from ..errors import AlreadyExistsError, CkptioError, StateMismatchError, logger
from . import formats
from . import retention as _retention
from .content import CONTENT_HASH, CONTENT_KEY, Content
from .group import Group
from .manifest import FORMATS, CheckpointWarning, Layout
from .retention import STALE_AFTER, RetentionPolicy, abort_stale_writes, check_rules, cleanup
from .sources import Target, seed_latest
from .sources import resolve as resolve_uri
from .staging import Background, _Stager
from .state import LoadResult, SaveResult, metric_values
from .statedict import Parts
from .tiered import Tier, open_layouts, tier_options

log = logger("ckptio.checkpointer")
_UNKNOWN = object()


class Checkpointer:
    """Numbered checkpoints under ``root_uri`` with a latest pointer, retention and async save.

    ``format``: ``"dcp"`` (sharded, every rank writes; see :mod:`ckptio.dcp`), ``"fpk"`` or ``"pt"``
    (one file, written by rank 0). Retention keeps the union of: the ``keep_last`` newest steps, every
    step with ``(step + keep_every_offset) % keep_every == 0``, the ``keep_best`` best by
    ``metrics[best_metric]`` (``best_mode`` ``"min"`` or ``"max"``), the kept steps (:meth:`keep`) and
    always the latest; with no rule set nothing is deleted. ``retention``: a policy, ``"all"``,
    ``"last"``, ``"best"``, ``"last_and_best"`` or ``"none"`` (:mod:`.retention`).
    ``process_group``: the group to coordinate over (default: a new gloo group when
    ``torch.distributed`` is initialized); ``timeout``: seconds for each collective.
    ``stale_after``: seconds after which an unfinished write or another's uncommitted step directory
    under root is taken for a killed save's debris and discarded (:mod:`.retention`); ``None``: never.
    ``background_nice``: the async persist thread (and the threads it starts) runs at this nice
    increment on Linux, so background I/O yields the CPU to training; ``None`` leaves it unchanged.
    ``save_options``/``load_options`` go to the format's save/load (``ckptio.dcp.save``/``load`` or
    ``ckptio.dump``/``load``); ``weights_only`` applies to ``pt`` loads. With ``"dcp"``, failures raise the
    failed rank's error as :func:`ckptio.dcp.save`/``load`` do, never torch's ``CheckpointException``.
    ``load`` runs no code from the files by default (see :meth:`load`'s ``allow_pickle``).
    ``incremental=True``: data already stored under root is not written again
    (:mod:`.content`); content no kept step references is deleted after ``content_grace`` seconds.
    ``last_save``: what the last finished save wrote (:class:`SaveResult`).
    ``local_tier``, ``keep_local``, ``max_pending``, ``on_backlog``: tiered saves (commit to a node-local
    directory, replicate to root in the background; default: the settings' ``[checkpointer]`` table):
    :mod:`.tiered`, :mod:`.replication`.
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
        keep_every_offset: int = 0,
        retention: str | RetentionPolicy | None = None,
        async_save: bool = False,
        process_group: Any = None,
        timeout: float = 600.0,
        weights_only: bool = True,
        save_options: Mapping[str, Any] | None = None,
        load_options: Mapping[str, Any] | None = None,
        background_nice: int | None = 10,
        stale_after: float | None = STALE_AFTER,
        incremental: bool = False,
        content_grace: float = 3600.0,
        local_tier: str | os.PathLike | bool | None = None,
        keep_local: int | None = None,
        max_pending: int | None = None,
        on_backlog: str | None = None,
    ) -> None:
        if format not in FORMATS:
            raise ValueError(f"format must be one of {FORMATS}, got {format!r}")
        policy, keep_last, keep_best = check_rules(
            keep_last, keep_every, keep_best, best_metric, best_mode, keep_every_offset, retention
        )
        if stale_after is not None and not float(stale_after) >= 0:
            raise ValueError(f"stale_after must be >= 0 seconds or None, got {stale_after!r}")
        if not float(content_grace) >= 0:
            raise ValueError(f"content_grace must be >= 0 seconds, got {content_grace!r}")
        self.root_uri = os.fspath(root_uri).rstrip("/") or os.fspath(root_uri)
        self.format = format
        self.keep_last, self.keep_every, self.keep_best = keep_last, keep_every, keep_best
        self.retention, self.keep_every_offset = policy, keep_every_offset
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
        self.last_save: SaveResult | None = None
        tier_dir, tier_opts = tier_options(self.root_uri, local_tier, keep_local, max_pending, on_backlog, incremental)
        remote, self._layout = open_layouts(self.root_uri, tier_dir) if tier_dir else (None, Layout(self.root_uri))
        self._content = Content(self._layout, content_grace) if incremental else None
        self._stager = _Stager()
        self._background = Background()
        self._group = Group(process_group, self.timeout)
        self._pg, self._rank, self._world = self._group.pg, self._group.rank, self._group.world
        self._tier = None if remote is None else Tier(remote, self._layout, self, self._rank, self._world, **tier_opts)
        self._latest_known: Any = _UNKNOWN  # the pointer's step as this Checkpointer last saw it

    def __repr__(self) -> str:
        return f"Checkpointer({self.root_uri!r}, format={self.format!r})"

    # ---- queries -----------------------------------------------------------------------------
    def uri(self, step: int) -> str:
        """The (unresolved) URI of the directory for ``step`` (tiered: at the remote root)."""
        return self._layout.uri(step) if self._tier is None else self._tier.remote.uri(step)

    def list(self) -> builtins.list[int]:
        """Steps of the complete checkpoints under root (tiered: on either tier), ascending. Under a process
        group every rank calls it: rank 0 lists and tells the others."""
        self._settle()
        return self._group.on_rank0(self._layout.list if self._tier is None else self._tier.list)

    def latest(self, durable: str | None = None) -> int | None:
        """Step of the latest complete checkpoint: the pointer's, else (missing or incomplete) the newest complete
        (tiered: on either tier, or ``durable="local"``/``"remote"``: on this node's tier/at root). Rank 0 reads
        the pointer and tells the other ranks (every rank calls it)."""
        if self._tier is None and durable is not None:
            raise ValueError("durable= needs a tiered Checkpointer (local_tier=)")
        self._settle()
        if self._tier is None:
            return self._group.on_rank0(self._layout.latest)
        return self._group.on_rank0(self._tier.latest, durable)

    def manifest(self, step: int) -> dict[str, Any]:
        """The commit marker's contents for ``step`` (format, files, metrics, time)."""
        return self._layout.manifest(step) if self._tier is None else self._tier.manifest(step)

    def status(self) -> dict[int, str]:
        """Tiered: step -> ``"local"``, ``"replicating"``, ``"remote"`` or ``"local+remote"`` (:mod:`.tiered`)."""
        if self._tier is None:
            raise ValueError("status() needs a tiered Checkpointer (local_tier=)")
        self._settle()
        return self._group.on_rank0(self._tier.status)

    # ---- save --------------------------------------------------------------------------------
    def save(
        self,
        step: int,
        state: Mapping[str, Any],
        *,
        metrics: Mapping[str, Any] | None = None,
        overwrite: bool = False,
    ) -> None:
        """Save ``state`` (parts by name; tensors, containers, modules, optimizers and other ``Stateful``
        objects at any depth: :mod:`.statedict`) as checkpoint ``step``: the state after training step
        ``step``, so a resume runs ``step + 1`` next (:meth:`resume`). ``metrics``: numbers (tensors are
        read with ``.item()``) kept in the marker, for ``keep_best``. Saving the latest step again raises
        :class:`AlreadyExistsError` here, at the call; ``overwrite=True`` replaces it in place (as DINOv3 does; a
        crash meanwhile leaves the previous complete step, if retention kept one, as the latest)."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        if not isinstance(state, Mapping) or not state:
            raise TypeError("state must be a non-empty mapping of part name -> state")
        metrics = metric_values(metrics)
        score = metrics.get(self.best_metric) if self.best_metric else None
        if self.keep_best is not None and (score is None or math.isnan(score)):
            warnings.warn(
                f"save({step}): metrics lack {self.best_metric!r} (or it is NaN); this checkpoint never counts as best",
                CheckpointWarning,
                stacklevel=2,
            )
        self._background.wait()
        if not overwrite:
            self._refuse_latest(step)
        if self._tier is not None:
            self._tier.admit(step)
        sd = Parts(state, files=self.format != "dcp", group=self._group).state_dicts()
        if not self.async_save:
            self._persist(step, sd, metrics, overwrite)
            return
        staged = self._stager.stage(sd)
        self._background.submit(self.uri(step), self.background_nice, self._persist, step, staged, metrics, overwrite)

    def prepare(self, state: Mapping[str, Any]) -> None:
        """Async saves: allocate and fault in the staging buffers for a state shaped like ``state`` in the
        background thread, so the first ``save`` blocks only for the copy. Memory: one CPU copy of the state's
        tensors (pinned for CUDA ones), which the first async save would allocate anyway, held until ``close``.
        Call it after the first optimizer step (optimizer state created later is allocated by the save that
        meets it); a state whose shapes changed is still saved exactly. Waits for a save in flight first; a
        ``save`` started meanwhile waits for the prepare; its error is raised by the next save/wait/close."""
        if not self.async_save:
            raise ValueError("prepare() prepares async saves' staging buffers: pass async_save=True")
        if not isinstance(state, Mapping) or not state:
            raise TypeError("state must be a non-empty mapping of part name -> state")
        self._background.wait()
        sd = Parts(state, files=self.format != "dcp", group=self._group).state_dicts()
        self._background.submit(f"{self.root_uri} (prepare)", self.background_nice, self._stager.prepare, sd)

    def _refuse_latest(self, step: int) -> None:
        """Raise at the call when ``step`` is the latest checkpoint (the pointer is read once per
        Checkpointer, then followed through its own saves, loads and deletes)."""
        if self._latest_known is _UNKNOWN:
            self._latest_known = self._group.on_rank0(self._layout.pointer)
        if step == self._latest_known:
            raise AlreadyExistsError(
                self.uri(step),
                "this step is the latest checkpoint: resume at the step after it (resume() returns it), "
                "pass overwrite=True to replace it, or delete it first",
            )

    def _settle(self) -> None:
        """Under a process group, wait for the background save first: its collectives and a query's share
        the group, and each rank would order the two on its own."""
        if self._pg is not None:
            self._background.wait()

    def wait(self) -> None:
        """Wait for the background save, if any; re-raise its exception if it failed (tiered: and replication)."""
        self._background.wait()
        if self._tier is not None:
            self._tier.wait(self._pg)

    def close(self) -> None:
        """Wait for the background save (raising its error), stop the background thread (and replicator) and
        free the async saves' staging buffers (a CPU copy of the state; a later save allocates them again)."""
        try:
            self._background.close()
        finally:
            self._stager.release()
            if self._tier is not None:
                self._tier.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _persist(self, step: int, sd: dict[str, Any], metrics: dict[str, float], overwrite: bool = False) -> None:
        if self._tier is None:
            return self._write(step, sd, metrics, overwrite)
        with self._tier.writing(step):  # not evicted from the local tier meanwhile
            return self._write(step, sd, metrics, overwrite)

    def _write(self, step: int, sd: dict[str, Any], metrics: dict[str, float], overwrite: bool = False) -> None:
        t0 = time.perf_counter()
        self._group.on_rank0(self._prepare, step, overwrite)
        if self.format == "dcp" and self._content is not None:
            files = self._content.write_dcp(step, sd, self._pg, self.save_options, self._rank)
        elif self.format == "dcp":
            files = formats.write_dcp(sd, self._layout.uri(step), self._pg, self.save_options)
        elif self._content is not None:
            files = self._group.on_rank0(self._content.write, self.format, step, sd, self.save_options)
        else:
            files = self._group.on_rank0(formats.write_file, self.format, self._layout.uri(step), sd, self.save_options)
        manifest = {
            "step": step,
            "format": self.format,
            "files": files,
            "parts": sorted(map(str, sd)),
            "metrics": metrics,
            "time": time.time(),
            "world_size": self._world,
        }
        if self._content is not None:
            manifest[CONTENT_KEY] = CONTENT_HASH
        if self._tier is not None:  # every rank: the files of every rank's node (DCP); replication scheduled
            self._tier.prepare(step, manifest, self._pg)
        self._group.on_rank0(self._commit, step, manifest)
        self._latest_known = step
        if self._tier is not None and self._rank != 0:
            self._tier.follow(step, manifest)
        took = time.perf_counter() - t0
        logical, written = self._content.last if self._content is not None else (None, None)
        d = self._layout.uri(step)
        self.last_save = SaveResult(step, d, took, logical, written)
        if written is None:
            log.info("saved checkpoint %s in %.2fs", d, took)
        else:
            log.info("saved checkpoint %s in %.2fs: %d bytes, %d written", d, took, logical, written)

    def _prepare(self, step: int, overwrite: bool = False) -> None:
        """Step 1 of the protocol (rank 0): sweep stale writes once, clear the way for ``step``."""
        if not self._swept:
            abort_stale_writes(self._layout, self.stale_after)
            self._swept = True
        self._layout.begin(step)
        if self._layout.committed(step):
            if self._layout.pointer() == step and not overwrite:
                raise AlreadyExistsError(
                    self.uri(step), "this step is the latest checkpoint; pass overwrite=True or delete it first"
                )
            kept = [] if overwrite else _retention.names_of(self._durable, step)
            if kept:
                raise AlreadyExistsError(
                    self.uri(step),
                    f"this step is kept as {kept}; pass overwrite=True to replace it, or unkeep it first",
                )
            if not overwrite:
                warnings.warn(
                    f"replacing the existing checkpoint {self.uri(step)} (not the latest)",
                    CheckpointWarning,
                    stacklevel=2,
                )
            self._layout.uncommit(step)  # uncommit before touching its data
        formats.discard(self.format, self._layout, step)

    def _commit(self, step: int, manifest: dict[str, Any]) -> None:
        if self._tier is not None:
            return self._tier.commit(step, manifest)  # local commit, replication queued, local eviction
        self._layout.commit(step, manifest)
        kept = cleanup(self, self._layout, step)
        if self._content is not None:
            self._content.sweep(kept)

    # ---- delete, keep ----------------------------------------------------------------------------
    def delete(self, step: int) -> None:
        """Delete checkpoint ``step``; if it is the latest, the pointer moves to the newest remaining one.
        A kept step (:meth:`keep`) is refused: ``unkeep`` its names first."""
        self._background.wait()
        self._group.on_rank0(self._delete, step)
        self._latest_known = _UNKNOWN
        self._group.barrier()

    def _delete(self, step: int) -> None:
        names = _retention.names_of(self._durable, step)
        if names:
            raise ValueError(f"{self.uri(step)}: kept as {names}; unkeep({names[0]!r}) first to delete it")
        (self._layout.delete if self._tier is None else self._tier.delete)(step)

    @property
    def _durable(self) -> Layout:
        """The root that holds the kept names and the retention rules apply to (tiered: the remote one)."""
        return self._layout if self._tier is None else self._tier.remote

    def keep(self, step: int, name: str | None = None) -> str:
        """Keep checkpoint ``step`` whatever the retention rules, under ``name`` (default ``"<step>_keep"``,
        DINOv3's); a name already used moves to ``step`` (``"best"``, ``"final"``). Returns the name.
        Every rank calls it (rank 0 writes ``kept.json`` at root)."""
        name = _retention.check_name(f"{step}_keep" if name is None else name)
        self._background.wait()

        def run() -> None:
            def exists() -> bool:
                return step in (self._layout.list() if self._tier is None else self._tier.list())

            _retention.keep(self._durable, step, name, exists)

        self._group.on_rank0(run)
        return name

    def unkeep(self, name: str) -> int:
        """Drop the kept name ``name`` (``KeyError`` if none); returns its step, which the next save's
        retention (or :meth:`prune`) deletes unless a rule or another name keeps it."""
        self._settle()
        return self._group.on_rank0(_retention.unkeep, self._durable, name)

    def kept(self) -> dict[str, int]:
        """Name -> step of the kept checkpoints."""
        self._settle()
        return self._group.on_rank0(_retention.kept, self._durable)

    def prune(self) -> builtins.list[int]:
        """Apply retention now (after :meth:`unkeep`, or to a root saved with other rules); returns the steps
        deleted (tiered: at the remote root; the local tier evicts as after a save)."""
        self._background.wait()
        return self._group.on_rank0(self._prune)

    def _prune(self) -> builtins.list[int]:
        if self._tier is not None:
            return self._tier.prune()
        latest = self._layout.latest()
        if latest is None:
            return []
        kept, deleted = _retention.prune(self, self._layout, latest)
        if self._content is not None:
            self._content.sweep(kept)
        return deleted

    # ---- load ------------------------------------------------------------------------------------
    def load(
        self,
        state: dict[str, Any],
        *,
        step: Any = "latest",
        keys: Iterable[str] | None = None,
        exclude: Iterable[str] | None = None,
        strict: bool = True,
        cache: Any = None,
        allow_pickle: bool = False,
    ) -> int | None:
        """Restore ``state`` in place from a checkpoint; returns its step, or ``None`` if there is none yet
        (the step to run next is that step + 1: :meth:`resume`).

        ``step``: ``"latest"``, an int, or the URI of any checkpoint directory or file (another run's
        too; its step is the marker's, else the number its name ends with, else 0). ``keys``: the parts
        to restore (default: every part of ``state``); ``exclude``: parts not to restore (Cosmos's
        ``keys_not_to_resume``); only the bytes of the parts restored are read (every format).
        ``strict=True`` raises ``KeyError`` naming every missing and unexpected key before anything is
        restored; ``strict=False`` restores what matches and reports the rest (a warning and
        ``self.last_load``), an optimizer's too: the state of the parameters both hold, matched by name
        (:mod:`.matching`). Whatever ``strict``, tensors of other shapes and an optimizer that cannot be
        matched raise :class:`~ckptio.errors.StateMismatchError` (a RuntimeError) before anything is
        restored. ``cache`` (True, a directory or a mapping) reads the data through the node-local cache
        (:mod:`ckptio.cache`). Modules and optimizers (plain, DDP, FSDP2) restore
        through torch's state_dict functions (:mod:`.statedict`).

        The checkpoint's own format is used (any of :data:`FORMATS`, whatever this Checkpointer saves).
        Loading runs no code from it: the commit marker cannot pick another deserializer or a path (its
        format and file names are checked), ``pt`` files load with ``weights_only``, ``fpk`` files
        unpickle nothing, ``dcp`` non-tensor items load only if they are plain data
        (:mod:`ckptio.dcp.checks`). For a checkpoint you trust, ``allow_pickle=True`` loads pickled
        objects in ``fpk`` and ``dcp`` files and ``pt`` files with ``weights_only=False``.
        """
        self._background.wait()
        names = self._names(state, keys, exclude)
        picked = keys is not None or exclude is not None
        with contextlib.nullcontext() if self._tier is None else self._tier.reading():  # no eviction meanwhile
            found = self._read(state, names, picked, step, strict, cache, allow_pickle)
        if found is None:
            log.warning("no checkpoint under %s yet; nothing restored", self.root_uri)
            self.last_load = LoadResult(None, None)
            return None
        t, d, parts, source, ckpt_parts = found
        s = t.step
        given = isinstance(step, (str, os.PathLike)) and step != "latest"
        res = LoadResult(s, os.fspath(step).rstrip("/") if given else d)  # a bare file: the file
        for k in names:
            if k not in source:
                res.missing_keys.append(k)
            else:
                state[k] = parts.restore(k, source[k], res)
        if not picked:
            res.unexpected_keys += [k for k in ckpt_parts if k not in state and k not in t.ignore]
        self.last_load = res
        if step == "latest" and t.seed is None:  # a seed's step is not this root's latest
            self._latest_known = s
        if res.missing_keys or res.unexpected_keys:
            msg = (
                f"checkpoint {d} (step {s}) does not match the state: missing keys {res.missing_keys}, "
                f"unexpected keys {res.unexpected_keys}"
            )
            if strict:  # found only while restoring (the check before found nothing): the rest is restored
                raise KeyError(msg + "; everything else was restored (pass strict=False to restore what matches)")
            warnings.warn(msg, CheckpointWarning, stacklevel=2)
        log.info("restored step %d from %s", s, d)
        return s

    def resume(self, state: dict[str, Any], **options: Any) -> int:
        """Restore the latest checkpoint into ``state`` (:meth:`load`'s options) and return the step to run
        next: the restored step + 1, or 0 when there is no checkpoint yet. ``for step in range(ck.resume(state),
        steps): ...; ck.save(step, state)``."""
        s = self.load(state, **options)
        return 0 if s is None else s + 1

    @staticmethod
    def _names(
        state: Mapping[str, Any], keys: Iterable[str] | None, exclude: Iterable[str] | None
    ) -> builtins.list[str]:
        names = list(state) if keys is None else list(keys)
        unknown = [k for k in names if k not in state]
        if unknown:
            raise KeyError(f"keys {unknown} are not in the state given to load()")
        skip = set(exclude or ())
        unknown = sorted(str(k) for k in skip if k not in state)
        if unknown:
            raise KeyError(f"exclude: {unknown} are not in the state given to load()")
        return [k for k in names if k not in skip]

    def _read(
        self,
        state: dict[str, Any],
        names: builtins.list[str],
        picked: bool,
        step: Any,
        strict: bool,
        cache: Any,
        allow_pickle: bool,
    ) -> tuple[Target, str, Parts, Mapping[str, Any], builtins.list[str]] | None:
        """Resolve ``step`` (tiered: the nearest verified copy) and read the parts ``names``."""
        t = self._group.on_rank0(self._target, step)
        if t is None:
            return None
        s, d, fmt, name, content = t.step, t.uri, t.fmt, t.name, t.content
        if self._tier is not None and self._pg is not None:
            d = self._tier.agree(s, d, self._pg)  # the local copy only if every rank's node has it
        parts = Parts(state, files=fmt != "dcp", group=self._group)

        def check(tree: Mapping[str, Any]) -> None:
            """Every rank, before anything is read into the state or restored (:meth:`Parts.verify`)."""
            extra = [] if picked else [str(k) for k in tree if k not in state and k not in t.ignore]
            parts.verify(names, tree, strict, extra, f"checkpoint {where} (step {s})")

        where = d if name is None else _uri.join_path(d, name)

        def read(d: str) -> tuple[Mapping[str, Any], builtins.list[str]]:
            checked: Callable[[Mapping[str, Any]], None] = check
            if fmt == "pt-parts":
                return formats.read_pt_parts(
                    t.files, names, self.load_options, self.weights_only, cache, allow_pickle, checked
                )
            if fmt == "dcp":  # the ranks agree on the check's outcome before the read's collectives
                checked = self._group.agreed(check)
                return formats.read_dcp(
                    d, parts, names, self.load_options, self._pg, cache, allow_pickle, content, checked
                )
            opts = dict(self.load_options)
            if picked and fmt == "fpk":  # only these parts' bytes
                wanted = list(names)
                opts.setdefault("keys", wanted)
                if not strict:  # those the file lacks are reported missing (its tree is seen before keys= is read)
                    checked = formats.keep_present(wanted, check)
                into = None
            elif picked and fmt == "pt":
                opts.setdefault("keys", names)  # only these parts' bytes (:mod:`ckptio.formats.torch_entries`)
                into = None
            else:
                into = parts.targets(names)  # tensors read in place where they match
            return formats.read_file(fmt, d, name, opts, self.weights_only, cache, allow_pickle, content, into, checked)

        err = None
        try:
            try:
                source, ckpt_parts = read(d)
            except (OSError, CkptioError) as e:
                tier = self._tier if self._world == 1 else None
                if tier is None or not tier.is_local(d) or isinstance(e, StateMismatchError):  # not the copy's fault
                    raise
                d = tier.fallback(s, d, e)  # a damaged local copy: read the remote one
                source, ckpt_parts = read(d)
        except Exception as e:  # noqa: BLE001 - raised below on every rank (one rank's read may fail alone)
            err = e
        try:
            self._group.agree(err)
        finally:  # the error agree raises holds this frame in its traceback: no reference cycle through it
            del err
        return t, d, parts, source, ckpt_parts

    def _target(self, step: Any) -> Target | None:
        """Rank 0: what ``load(step=...)`` reads: a URI as :func:`.sources.resolve` finds it; ``"latest"``
        or a step of this root (tiered: the nearest verified copy); with no checkpoint of its own yet, the
        latest of a seed's layout under root (:mod:`.seeds`)."""
        if isinstance(step, (str, os.PathLike)) and step != "latest":
            return resolve_uri(step)
        target = self._layout.resolve_target if self._tier is None else self._tier.resolve_target
        s, d, fmt, name, content = target(step)
        if s is None or d is None or fmt is None:
            return seed_latest(self.root_uri) if self._tier is None else None
        return Target(s, d, fmt, name, content)

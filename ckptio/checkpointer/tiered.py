"""Tiered checkpoints (``Checkpointer(root, local_tier=DIR, keep_local=2)``): the two roots, what each step's
state is, which copy a restore reads, and what the local tier keeps.

Layout: ``DIR`` (node-local disk) and ``root`` (usually an object store) are both ordinary Checkpointer
roots (:mod:`.manifest`): step directories, ``checkpoint.json`` markers, ``latest.txt``.

Protocol of a save of ``step``:

1. the step is written and committed under ``DIR`` exactly as a local-root Checkpointer commits it; the
   marker also lists every file of the step directory with its size (key ``"sizes"``), so each copy
   can be re-verified against it;
2. the replicator (:mod:`.replication`, one background thread per Checkpointer, rank 0) copies those
   files to ``root/<step>/`` in part-size pieces, checks the sizes the remote root lists, writes the
   same marker there create-only (last: nothing partial is ever committed remotely), then moves
   ``root/latest.txt`` if the step is the newest there, then applies the Checkpointer's ``keep_*``
   retention to ``root``;
3. the local tier keeps the newest ``keep_local`` steps and, whatever their age, every step not yet
   committed remotely (eviction: after each local commit and each replication; marker first).

A step's state (:meth:`Tier.status`): ``"local"`` (committed on this node only, nothing scheduled),
``"replicating"`` (committed locally, replication queued or running), ``"remote"`` (committed at
``root`` only), ``"local+remote"``. A process killed before replication finished leaves the step
``"local"``; the next tiered Checkpointer on that node replicates every local step that ``root`` lacks
(its replicator's first job). A step only a lost node held is gone: ``latest(durable="remote")`` is
what any node can restore.

Restore (:meth:`Tier.resolve_target`): ``"latest"`` is the newest step committed in either root; the
local copy is read when it is committed and every file has the size its marker lists (the format then
checks its own checksums: ``fpk`` payloads, DCP blocks); otherwise, or when reading the local copy
fails (single process), the remote copy is read (through the node-local cache when the caller asks).
"""

from __future__ import annotations

import builtins
import json
import logging
import threading
import warnings
from typing import Any

from .. import uri as _uri
from ..backends.base import ObjectInfo
from ..context import resolve
from ..errors import CkptioError, NotFoundError
from ..transfer import copy_objects
from .manifest import MARKER_NAME, POINTER_NAME, CheckpointWarning, Layout, _parse_manifest
from .replication import Replicator
from .retention import _Rules, cleanup

log = logging.getLogger("ckptio.checkpointer")

SIZES_KEY = "sizes"
STATES = ("local", "replicating", "remote", "local+remote")
DURABLE = (None, "local", "remote")


def file_sizes(layout: Layout, step: int) -> dict[str, int]:
    """Relative name -> size of every file in ``step``'s directory but its marker."""
    d = layout.dir(step).rstrip("/") + "/"
    out = {}
    for info in layout.backend.list(d, recursive=True):
        if not info.is_dir and info.uri.startswith(d):
            rel = info.uri[len(d) :]
            if rel != MARKER_NAME:
                out[rel] = info.size
    return out


def _check_rel(rel: Any, marker: str) -> str:
    if not isinstance(rel, str) or not rel or rel.startswith("/") or ".." in rel.split("/") or "\\" in rel:
        raise CkptioError(f"{marker}: names {rel!r} among its files; ckptio never writes such a marker")
    return rel


def marker_sizes(m: dict[str, Any], marker: str) -> dict[str, int] | None:
    """The ``"sizes"`` of a marker (checked: relative names inside the step, int sizes), or None."""
    sizes = m.get(SIZES_KEY)
    if sizes is None:
        return None
    if not isinstance(sizes, dict) or not all(type(v) is int and v >= 0 for v in sizes.values()):
        raise CkptioError(f"{marker}: key {SIZES_KEY!r} is not a mapping of file name -> size")
    for rel in sizes:
        _check_rel(rel, marker)
    return sizes


def verify(layout: Layout, step: int) -> str | None:
    """Why the copy of ``step`` under ``layout`` cannot be read, or None when it is committed and every
    file its marker lists has that size."""
    try:
        if not layout.committed(step):
            return "not committed there"
        marker = layout.user_uri(step, MARKER_NAME)
        m = _parse_manifest(layout.backend.read(_uri.join_path(layout.dir(step), MARKER_NAME)), marker)
        sizes = marker_sizes(m, marker) if isinstance(m, dict) else None
        if sizes is None:
            return None  # committed by a plain Checkpointer: the format's own checks are all there is
        have = file_sizes(layout, step)
    except (OSError, CkptioError) as e:
        return f"cannot be checked ({e})"
    for rel, size in sizes.items():
        if have.get(rel) != size:
            got = "missing" if rel not in have else f"{have[rel]} bytes"
            return f"{rel} is {got}, its marker says {size} bytes"
    return None


class Tier:
    """The local tier and the remote root of one Checkpointer, and its replicator (rank 0 only)."""

    def __init__(
        self,
        remote: Layout,
        local: Layout,
        rules: _Rules,
        *,
        keep_local: int,
        max_pending: int,
        on_backlog: str,
        nice: int | None,
        start: bool,
    ) -> None:
        if not isinstance(keep_local, int) or isinstance(keep_local, bool) or keep_local < 1:
            raise ValueError(f"keep_local must be a positive int, got {keep_local!r}")
        if _uri.scheme_of(local.root_uri) not in ("", "file"):
            warnings.warn(
                f"local_tier={local.root_uri!r} is not a local path; it is used as the fast tier anyway",
                CheckpointWarning,
                stacklevel=3,
            )
        self.remote, self.local, self.rules, self.keep_local = remote, local, rules, keep_local
        self.replicated: set[int] = set()  # steps known to be committed remotely
        self.replicator: Replicator | None = None
        self._evicting = threading.Lock()  # the save path and the replicator both evict
        if start:  # rank 0: the thread starts by scheduling every local step (re-replication after a restart)
            self.replicator = Replicator(
                self.replicate,
                local.list,
                max_pending=max_pending,
                on_backlog=on_backlog,
                nice=nice,
                name=remote.root_uri,
            )

    # ---- the save path (rank 0) ------------------------------------------------------------------
    def commit(self, step: int, manifest: dict[str, Any]) -> None:
        """Commit ``step`` locally (its marker lists its files' sizes), schedule its replication, evict."""
        manifest = dict(manifest, **{SIZES_KEY: file_sizes(self.local, step)})
        self.replicated.discard(step)
        self.local.commit(step, manifest)
        if self.replicator is not None:
            self.replicator.submit(step)
        self.evict()

    def replicate(self, step: int) -> None:
        """Copy committed local ``step`` to the remote root and commit it there (the replicator's job)."""
        local, remote = self.local, self.remote
        marker = local.user_uri(step, MARKER_NAME)
        try:
            data = local.backend.read(_uri.join_path(local.dir(step), MARKER_NAME))
        except FileNotFoundError:
            return  # deleted or replaced meanwhile: nothing to replicate
        m = _parse_manifest(data, marker)
        sizes = marker_sizes(m, marker) if isinstance(m, dict) else None
        if sizes is None:  # committed by a plain Checkpointer on this root: list what is there
            sizes = file_sizes(local, step)
            m = dict(m, **{SIZES_KEY: sizes})
        remote.step_dirs()
        rmarker = _uri.join_path(remote.dir(step), MARKER_NAME)
        if remote.committed(step):
            theirs = _parse_manifest(remote.backend.read(rmarker), remote.user_uri(step, MARKER_NAME))
            if isinstance(theirs, dict) and theirs.get("time") == m.get("time") and theirs.get(SIZES_KEY) == sizes:
                self._finish(step)  # replicated before (a restart, or killed before the pointer moved)
                return
            warnings.warn(
                f"replacing {remote.uri(step)} with the step committed under {local.root_uri}",
                CheckpointWarning,
                stacklevel=2,
            )
            remote.uncommit(step)
        remote.manifests.pop(step, None)
        remote.rmtree(remote.dir(step))  # debris of an interrupted replication
        pairs = [
            (
                ObjectInfo(_uri.join_path(local.dir(step), *rel.split("/")), size),
                _uri.join_path(remote.dir(step), *rel.split("/")),
            )
            for rel, size in sorted(sizes.items())
        ]
        copy_objects(local.backend, pairs, remote.backend, jobs=min(4, max(1, len(pairs))))
        have = file_sizes(remote, step)
        wrong = {rel: have.get(rel) for rel, size in sizes.items() if have.get(rel) != size}
        if wrong:
            raise CkptioError(f"{remote.uri(step)}: after replication, files differ from the marker's sizes: {wrong}")
        remote.backend.write(rmarker, json.dumps(m, indent=1, sort_keys=True).encode(), mode="create")
        remote.manifests[step] = m
        self._finish(step)

    def _finish(self, step: int) -> None:
        """``step`` is committed remotely: move the remote pointer if it is the newest, retention, eviction."""
        remote = self.remote
        ptr = remote.pointer()
        if ptr is None or step >= ptr or not remote.committed(ptr):
            remote.backend.write(
                _uri.join_path(remote.root, POINTER_NAME), (remote.name(step) + "\n").encode(), mode="overwrite"
            )
            ptr = step
        cleanup(self.rules, remote, ptr)
        self.replicated.add(step)
        log.info("replicated checkpoint %s", remote.uri(step))
        self.evict()

    def evict(self) -> None:
        """Delete local steps past the newest ``keep_local`` that are committed remotely, and local debris."""
        with self._evicting:
            self._evict()

    def _evict(self) -> None:
        local = self.local
        dirs = local.step_dirs()
        complete = sorted(s for s in dirs if local.committed(s))
        if not complete:
            return
        if self.replicator is not None and self.replicator.scanning:
            return  # the steps found at start are not scheduled yet
        busy = self.replicator.pending() if self.replicator is not None else set()
        for s in complete[: -self.keep_local]:
            if s in self.replicated and s not in busy:
                local.discard(s)
        for s in sorted(dirs):
            if s < complete[-1] and s not in complete:
                local.discard(s)  # an uncommitted directory older than the newest: a killed save's

    # ---- queries -----------------------------------------------------------------------------------
    def _remote_steps(self) -> set[int] | None:
        try:
            steps = set(self.remote.list())
        except (OSError, CkptioError) as e:
            warnings.warn(f"{self.remote.root_uri}: cannot list the remote root ({e})", CheckpointWarning, stacklevel=3)
            return None
        self.replicated &= steps
        self.replicated |= steps & set(self.local.names)
        return steps

    def status(self) -> dict[int, str]:
        """Step -> ``"local"``, ``"replicating"``, ``"remote"`` or ``"local+remote"``, ascending."""
        remote = self._remote_steps() or set()
        local = set(self.local.list())
        busy = self.replicator.pending() if self.replicator is not None else set()
        return {s: state_of(s in local, s in remote, s in busy) for s in sorted(local | remote)}

    def list(self) -> builtins.list[int]:
        return sorted(set(self.local.list()) | (self._remote_steps() or set()))

    def latest(self, durable: str | None = None) -> int | None:
        """The newest committed step: on this node's tier (``"local"``), at the remote root
        (``"remote"``), or either (None, what ``load("latest")`` restores)."""
        if durable not in DURABLE:
            raise ValueError(f"durable must be one of {DURABLE}, got {durable!r}")
        found = []
        if durable != "remote":
            found.append(self.local.latest())
        if durable != "local":
            try:
                found.append(self.remote.latest())
            except (OSError, CkptioError) as e:
                if durable == "remote":
                    raise
                warnings.warn(
                    f"{self.remote.root_uri}: cannot read the remote root ({e}); using the local tier only",
                    CheckpointWarning,
                    stacklevel=3,
                )
        steps = [s for s in found if s is not None]
        return max(steps) if steps else None

    def manifest(self, step: int) -> dict[str, Any]:
        return self.local.manifest(step) if self.local.committed(step) else self.remote.manifest(step)

    def resolve_target(self, step: Any) -> tuple[int | None, str | None, str | None, str | None, bool]:
        """What :meth:`Layout.resolve_target` returns, from the nearest copy that verifies."""
        if isinstance(step, str) and step == "latest":
            step = self.latest()
            if step is None:
                return None, None, None, None, False
        if not isinstance(step, int) or isinstance(step, bool):
            return self.local.resolve_target(step)  # the URI of a checkpoint directory
        self.local.step_dirs()
        why = verify(self.local, step)
        if why is None:
            return self.local.resolve_target(step)
        if step in self.local.names:
            warnings.warn(
                f"{self.local.uri(step)}: local copy not used ({why}); reading {self.remote.uri(step)}",
                CheckpointWarning,
                stacklevel=3,
            )
        return self.remote_target(step)

    def remote_target(self, step: int) -> tuple[int | None, str | None, str | None, str | None, bool]:
        try:
            return self.remote.resolve_target(step)  # learns the remote directory names itself
        except NotFoundError:
            raise NotFoundError(
                self.remote.uri(step), f"no checkpoint for step {step} at the remote root nor on this node's tier"
            ) from None

    def agree(self, step: int, d: str, process_group: Any) -> str:
        """Under ``torch.distributed`` (every rank): the local copy ``d`` that rank 0 chose, if every rank
        has it verified on its node; else the remote copy (each rank reads the same)."""
        if not self.is_local(d):
            return d
        import torch.distributed as dist

        ok = verify(self.local, step) is None
        flags: builtins.list[Any] = [None] * dist.get_world_size(process_group)
        dist.all_gather_object(flags, ok, group=process_group)
        if all(flags):
            return d
        rd = self.remote_target(step)[1]
        assert rd is not None
        return rd

    def fallback(self, step: int, d: str, err: BaseException) -> str:
        """Reading the local copy ``d`` of ``step`` failed with ``err``: the remote copy's directory URI."""
        try:
            _, rd, *_ = self.remote_target(step)
        except (OSError, CkptioError):
            raise err from None
        warnings.warn(
            f"{d}: the local copy cannot be read ({type(err).__name__}: {err}); reading {rd}",
            CheckpointWarning,
            stacklevel=3,
        )
        assert rd is not None
        return rd

    def wait(self) -> None:
        if self.replicator is not None:
            self.replicator.wait()

    def close(self) -> None:
        if self.replicator is not None:
            self.replicator.close()

    def is_local(self, d: str | None) -> bool:
        return d is not None and d.startswith(self.local.root_uri.rstrip("/") + "/")

    def delete(self, step: int) -> None:
        """Delete ``step`` from both tiers (waits for the replicator first)."""
        found = False
        for layout in (self.remote, self.local):
            if step in layout.step_dirs():
                layout.delete(step)
                found = True
        self.replicated.discard(step)
        if not found:
            raise NotFoundError(self.remote.uri(step), "no checkpoint for this step on either tier")


def state_of(local: bool, remote: bool, busy: bool) -> str:
    if local and remote:
        return "local+remote"
    if local:
        return "replicating" if busy else "local"
    return "remote"


def status(root_uri: str, local_tier: str | None = None) -> dict[int, str]:
    """Step -> state of a Checkpointer root and (optionally) a node's local tier, as another process sees
    them (a step the owning process is replicating shows ``"local"``)."""
    remote = set(Layout(root_uri.rstrip("/") or root_uri).list())
    local = set(Layout(local_tier.rstrip("/") or local_tier).list()) if local_tier else set()
    return {s: state_of(s in local, s in remote, False) for s in sorted(local | remote)}


def open_layouts(root_uri: str, local_tier: Any) -> tuple[Layout, Layout]:
    """(remote, local) layouts of a tiered Checkpointer."""
    import os

    local = os.fspath(local_tier)
    resolve(local)  # fails early on an unknown scheme
    return Layout(root_uri), Layout(local.rstrip("/") or local)

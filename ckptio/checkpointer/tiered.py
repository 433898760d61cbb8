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
   committed remotely (eviction: after each local commit and each replication; marker first; held
   back while a load of this Checkpointer reads, :meth:`Tier.reading`).

Under ``torch.distributed``: with ``fpk``/``pt`` rank 0 writes, commits and replicates. With ``dcp`` each
rank writes its data objects to its own node's tier; before the local commit the ranks gather every
rank's file sizes (a collective inside ``save``, which every rank calls anyway) into the marker; each
rank's replicator then copies the files it wrote (``__<rank>_*``; rank 0 also ``.metadata``), and rank
0's replicator commits remotely once the remote root lists every file of the marker with its size,
waiting up to the Checkpointer's ``timeout``. The remote root is the rendezvous: no collective runs on
a background thread, so replication can never deadlock with (or be misordered against) training's
collectives; the only collective of replication is in ``wait()``, which every rank calls. Other
nodes' tiers hold no marker; a rank deletes its node's step directories past the newest
``keep_local`` once they are committed remotely.

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
Under ``torch.distributed`` the local copy is read only when every rank's node has it verified
(:meth:`Tier.agree`): a DCP step saved by several nodes is read from the remote root.
"""

from __future__ import annotations

import builtins
import contextlib
import os
import threading
import time
import warnings
import weakref
from collections.abc import Iterator
from typing import Any, Protocol

from .. import markers
from .. import uri as _uri
from ..backends.base import ObjectInfo
from ..context import resolve
from ..errors import CkptioError, NotFoundError, logger
from ..transfer import copy_objects
from .binding import bind, check
from .manifest import MARKER_NAME, POINTER_NAME, CheckpointWarning, Layout, read_manifest
from .replication import ReplicationError, Replicator
from .retention import _Rules, cleanup, is_debris, prune
from .tier_sizes import SIZES_KEY, file_sizes, marker_sizes, verify

log = logger("ckptio.checkpointer")

STATES = ("local", "replicating", "remote", "local+remote")
DURABLE = (None, "local", "remote")


class _Owner(_Rules, Protocol):
    """What a Tier reads of its Checkpointer: the retention rules (applied to the remote root), its format,
    the collectives' ``timeout`` (also how long rank 0 waits for the other ranks' files) and the nice
    increment of background threads."""

    format: str
    timeout: float
    background_nice: int | None


class Tier:
    """The local tier and the remote root of one Checkpointer, and its replicator (rank 0 only)."""

    def __init__(
        self,
        remote: Layout,
        local: Layout,
        owner: _Owner,
        rank: int,
        world: int,
        *,
        keep_local: int,
        max_pending: int,
        on_backlog: str,
    ) -> None:
        if not isinstance(keep_local, int) or isinstance(keep_local, bool) or keep_local < 1:
            raise ValueError(f"keep_local must be a positive int, got {keep_local!r}")
        if _uri.scheme_of(local.root_uri) not in ("", "file"):
            warnings.warn(
                f"local_tier={local.root_uri!r} is not a local path; it is used as the fast tier anyway",
                CheckpointWarning,
                stacklevel=3,
            )
        self.remote, self.local, self.keep_local = remote, local, keep_local
        # the owner's retention rules, read live; held weakly once closed (owner and tier are then no
        # reference cycle), strongly before: the replicator's thread may outlive a dropped, unclosed owner
        self.rules: _Owner = weakref.proxy(owner)
        self._owner: _Owner | None = owner
        self.replicated: set[int] = set()  # steps known to be committed remotely
        self.replicator: Replicator | None = None
        self._evicting = threading.Lock()  # the save path and the replicator both evict; loads pin
        self._readers, self._deferred = 0, False  # loads in progress; an eviction they held back
        self._writing: set[int] = set()  # steps a save of this Checkpointer is writing (never evicted)
        self.rank, self.per_rank, self.timeout = rank, owner.format == "dcp" and world > 1, owner.timeout
        self.owned: dict[int, dict[str, int]] = {}  # step -> every rank's files (DCP, ranks but 0)
        if rank == 0 or self.per_rank:  # the thread starts by scheduling every local step (a restart's)
            self.replicator = Replicator(
                self.replicate,
                local.list,
                max_pending=max_pending,
                on_backlog=on_backlog,
                nice=owner.background_nice,
                name=remote.root_uri,
            )

    @property
    def closed(self) -> bool:
        """By the owner's close(): it saves no more (its replicator has stopped)."""
        return self._owner is None

    # ---- the save path ----------------------------------------------------------------------------
    def admit(self, step: int) -> None:
        """Every rank, before a save: refused once closed (each rank closed it; its replicator has stopped, so
        the step would never be replicated), else wait (or raise) while the replicator's backlog is full."""
        if self.closed:
            raise CkptioError(
                f"save({step}): this Checkpointer of {self.remote.root_uri} with a local tier was closed, which "
                "stopped its replication: make a new Checkpointer to save again (it replicates at start what is not)"
            )
        if self.replicator is not None:
            self.replicator.admit()

    def prepare(self, step: int, manifest: dict[str, Any], process_group: Any) -> None:
        """Every rank, before the commit: the marker's ``"sizes"``: the step directory's files (rank 0),
        or (``per_rank``: DCP under torch.distributed) every rank's own files, gathered."""
        if not self.per_rank:
            if self.rank == 0:
                manifest[SIZES_KEY] = file_sizes(self.local, step)
            return
        import torch.distributed as dist

        parts: builtins.list[Any] = [None] * dist.get_world_size(process_group)
        dist.all_gather_object(parts, self.mine(file_sizes(self.local, step)), group=process_group)
        manifest[SIZES_KEY] = {k: v for part in parts for k, v in part.items()}

    def mine(self, sizes: dict[str, int]) -> dict[str, int]:
        """The files this rank replicates: all of them, or (``per_rank``) the DCP data objects it wrote
        (``__<rank>_*``; rank 0 also ``.metadata``)."""
        if not self.per_rank:
            return dict(sizes)
        return {k: v for k, v in sizes.items() if _owner(k) == self.rank}

    def follow(self, step: int, manifest: dict[str, Any]) -> None:
        """Ranks but 0 (``per_rank``), after rank 0 committed ``step`` locally: replicate their own files."""
        if self.replicator is not None:
            self.owned[step] = manifest[SIZES_KEY]
            self.replicator.submit(step)

    def commit(self, step: int, manifest: dict[str, Any]) -> None:
        """Rank 0: commit ``step`` locally (its marker lists its files' sizes), schedule replication, evict."""
        self.replicated.discard(step)
        self.local.commit(step, manifest)
        if self.replicator is not None:
            self.replicator.submit(step)
        self.evict()

    def replicate(self, step: int) -> None:
        """Copy committed local ``step`` to the remote root and commit it there (the replicator's job)."""
        local, remote = self.local, self.remote
        marker = local.user_uri(step, MARKER_NAME)
        owned = self.owned.pop(step, None)
        if owned is not None and self.rank != 0:
            m: Any = {SIZES_KEY: owned}
        else:
            try:
                m = read_manifest(local.backend, _uri.join_path(local.dir(step), MARKER_NAME), marker)
            except FileNotFoundError:
                return  # deleted or replaced meanwhile (or another node's step): nothing to replicate
        sizes = marker_sizes(m, marker) if isinstance(m, dict) else None
        if sizes is None:  # committed by a plain Checkpointer on this root: list what is there
            sizes = file_sizes(local, step)
            m = dict(m, **{SIZES_KEY: sizes})
        remote.step_dirs()
        if self.rank != 0:  # per_rank: this rank's files; rank 0 commits once every rank's are there
            if not remote.committed(step):
                copy_files(local, remote, step, self.mine(sizes))
            self.evict()
            return
        rmarker = _uri.join_path(remote.dir(step), MARKER_NAME)
        if remote.committed(step):
            theirs = read_manifest(remote.backend, rmarker, remote.user_uri(step, MARKER_NAME))
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
        if not self.per_rank:
            remote.rmtree(remote.dir(step))  # debris of an interrupted replication
        copy_files(local, remote, step, self.mine(sizes))
        await_files(remote, step, sizes, self.timeout if self.per_rank else None)
        data = markers.dumps(m, remote.user_uri(step, MARKER_NAME), indent=1, sort_keys=True)
        remote.backend.write(rmarker, data, mode="create")
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
        cleanup(self.rules, remote, ptr, self._busy() - {step})
        self.replicated.add(step)
        log.info("replicated checkpoint %s", remote.uri(step))
        self.evict()

    def _busy(self) -> set[int]:
        """Steps queued for replication or being replicated."""
        return self.replicator.pending() if self.replicator is not None else set()

    def prune(self) -> builtins.list[int]:
        """Apply retention to the remote root now, then evict; returns the steps deleted remotely."""
        ptr = self.remote.latest()
        deleted = [] if ptr is None else prune(self.rules, self.remote, ptr, self._busy())[1]
        self.evict()
        return deleted

    def evict(self) -> None:
        """Delete local steps past the newest ``keep_local`` that are committed remotely, and local debris
        (ranks but 0 under ``per_rank``: the steps they sent); held back while a load reads (:meth:`reading`)."""
        with self._evicting:
            if self._readers:
                self._deferred = True
            elif self.per_rank and self.rank != 0:
                self._evict_sent()
            else:
                self._evict()

    @contextlib.contextmanager
    def writing(self, step: int) -> Iterator[None]:
        """While a save writes ``step`` on this node: its directory is not evicted (nor taken for debris)."""
        with self._evicting:
            self._writing.add(step)
        try:
            yield
        finally:
            with self._evicting:
                self._writing.discard(step)

    @contextlib.contextmanager
    def reading(self) -> Iterator[None]:
        """While a load picks and reads a copy: nothing is evicted from this node (it is evicted after)."""
        with self._evicting:
            self._readers += 1
        try:
            yield
        finally:
            with self._evicting:
                self._readers -= 1
                again, self._deferred = self._deferred and not self._readers, self._deferred and bool(self._readers)
            if again:
                self.evict()

    def _evict(self) -> None:
        local = self.local
        dirs = local.step_dirs()
        complete = local.committed_among(dirs)
        if not complete:
            return
        if self.replicator is not None and self.replicator.scanning:
            return  # the steps found at start are not scheduled yet
        busy, stale = self._busy() | self._writing, self.rules.stale_after
        for s in complete[: -self.keep_local]:
            if s in self.replicated and s not in busy:
                local.discard(s)
        for s in sorted(dirs):  # an uncommitted directory older than the newest, debris (not another's in progress)
            if s < complete[-1] and s not in complete and s not in self._writing and is_debris(local, s, stale):
                local.discard(s)

    def _evict_sent(self) -> None:
        """Ranks but 0 (``per_rank``): delete this node's step directories that have no marker here (another
        node's tier holds it), past the newest ``keep_local``, once committed remotely."""
        local, busy = self.local, self._busy() | self._writing
        for s in sorted(local.step_dirs())[: -self.keep_local]:
            if s not in busy and not local.committed(s) and self.remote.committed(s):
                local.rmtree(local.dir(s))

    def wait(self, process_group: Any = None) -> None:
        """Every rank: wait for its replicator; under torch.distributed, raise on every rank if any failed."""
        err: BaseException | None = None
        try:
            if self.replicator is not None:
                self.replicator.wait()
        except (ReplicationError, TimeoutError) as e:
            err = e
        if process_group is not None:
            import torch.distributed as dist

            msgs: builtins.list[Any] = [None] * dist.get_world_size(process_group)
            dist.all_gather_object(msgs, None if err is None else str(err), group=process_group)
            failed = [m for m in msgs if m]
            if failed and err is None:
                raise ReplicationError(f"replication failed on another rank: {failed[0]}")
        if err is not None:
            try:
                raise err
            finally:  # the error's traceback holds this frame: no reference cycle through it
                del err
        if self.per_rank and self.rank != 0:
            self.evict()  # rank 0 has committed what this rank sent

    # ---- queries -----------------------------------------------------------------------------------
    def _remote_steps(self) -> set[int] | None:
        try:
            steps = set(self.remote.list())
        except (OSError, CkptioError) as e:
            warnings.warn(f"{self.remote.root_uri}: cannot list the remote root ({e})", CheckpointWarning, stacklevel=3)
            return None
        self.replicated |= steps & set(self.local.names)  # kept when remote retention deletes them later
        return steps

    def status(self) -> dict[int, str]:
        """Step -> ``"local"``, ``"replicating"``, ``"remote"`` or ``"local+remote"``, ascending."""
        remote = self._remote_steps() or set()
        local = set(self.local.list())
        busy = self._busy()
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
        if step in self.local.names and not self.per_rank:  # per_rank: other nodes hold some files
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

    def close(self) -> None:
        try:
            if self.replicator is not None:
                self.replicator.close()
        finally:
            self._owner = None

    def is_local(self, d: str | None) -> bool:
        return d is not None and d.startswith(self.local.root_uri.rstrip("/") + "/")

    def delete(self, step: int) -> None:
        """Delete ``step`` from both tiers (unscheduled first; waits while it is being replicated)."""
        if self.replicator is not None:
            self.replicator.forget(step)
        found = False
        for layout in (self.remote, self.local):
            if step in layout.step_dirs():
                layout.delete(step)
                found = True
        self.replicated.discard(step)
        if not found:
            raise NotFoundError(self.remote.uri(step), "no checkpoint for this step on either tier")


def copy_files(local: Layout, remote: Layout, step: int, sizes: dict[str, int]) -> None:
    """Copy the files ``sizes`` names from ``local``'s directory of ``step`` to ``remote``'s (4 at a time,
    each streamed through a bounded buffer into an atomic writer: :func:`ckptio.transfer.copy_objects`)."""
    pairs = [
        (
            ObjectInfo(_uri.join_path(local.dir(step), *rel.split("/")), size),
            _uri.join_path(remote.dir(step), *rel.split("/")),
        )
        for rel, size in sorted(sizes.items())
    ]
    copy_objects(local.backend, pairs, remote.backend, jobs=min(4, max(1, len(pairs))))


def await_files(remote: Layout, step: int, sizes: dict[str, int], timeout: float | None) -> None:
    """Check that ``remote`` lists every file of ``sizes`` with its size; ``timeout``: wait up to that many
    seconds (the other ranks' files, DCP under torch.distributed)."""
    deadline = time.monotonic() + (timeout or 0.0)
    while True:
        have = file_sizes(remote, step)
        wrong = {rel: have.get(rel) for rel, size in sizes.items() if have.get(rel) != size}
        if not wrong:
            return
        if timeout is None or time.monotonic() > deadline:
            waited = "" if timeout is None else f" (waited {timeout:g}s for every rank's)"
            raise CkptioError(
                f"{remote.uri(step)}: files missing or of another size than the marker's after replication"
                f"{waited}: {wrong}"
            )
        time.sleep(0.1)


def _owner(name: str) -> int:
    """The rank that wrote a DCP data object ``__<rank>_<n>...`` (anything else: rank 0)."""
    head = name.split("_", 3)
    return int(head[2]) if name.startswith("__") and len(head) > 3 and head[2].isdigit() else 0


def state_of(local: bool, remote: bool, busy: bool) -> str:
    if local and remote:
        return "local+remote"
    if local:
        return "replicating" if busy else "local"
    return "remote"


def status(root_uri: str, local_tier: str | None = None) -> dict[int, str]:
    """Step -> state of a Checkpointer root and (optionally) a node's local tier, as another process sees
    them (a step the owning process is replicating shows ``"local"``)."""
    root = Layout(root_uri.rstrip("/") or root_uri)
    tier = Layout(local_tier.rstrip("/") or local_tier) if local_tier else None
    if tier is not None:
        check(tier, root)  # TierInUseError: that tier's steps are another root's
    remote = set(root.list())
    local = set(tier.list()) if tier is not None else set()
    return {s: state_of(s in local, s in remote, False) for s in sorted(local | remote)}


def tier_options(
    root_uri: str,
    local_tier: Any,
    keep_local: int | None,
    max_pending: int | None,
    on_backlog: str | None,
    incremental: bool,
) -> tuple[str | None, dict[str, Any]]:
    """(the local tier directory or None, the Tier's options): explicit arguments, else the settings'
    ``[checkpointer]`` table, else the defaults. With ``local_tier`` unset and the table's
    ``local_tier`` set, a remote root (an object store, not a local path) gets the tier
    ``<local_tier>/<scheme>/<bucket>/<key>`` (after aliases and path mapping); ``local_tier=False``: none."""
    from ..context import default_context

    settings = default_context().settings
    table = settings.checkpointer
    opts = {
        "keep_local": keep_local if keep_local is not None else table.get("keep_local", 2),
        "max_pending": max_pending if max_pending is not None else table.get("max_pending", 4),
        "on_backlog": on_backlog if on_backlog is not None else table.get("on_backlog", "block"),
    }
    out: str | None = None
    if local_tier is None and table.get("local_tier") and not incremental:
        scheme, rest = _uri.split(settings.resolve_alias(settings.map_path(root_uri))[0])
        if scheme not in ("", "file"):
            parts = [p for p in rest.split("/") if p not in ("", ".", "..")]
            out = os.path.join(table["local_tier"], scheme, *parts)
    elif local_tier is not None and local_tier is not False:
        if local_tier is True:
            raise ValueError("local_tier= takes a directory (or False: no tier), not True")
        if incremental:
            raise ValueError("local_tier= does not combine with incremental=True yet")
        out = os.fspath(local_tier)
    return out, opts


def open_layouts(root_uri: str, local_tier: Any) -> tuple[Layout, Layout]:
    """(remote, local) layouts of a tiered Checkpointer."""
    local = os.fspath(local_tier)
    resolve(local)  # fails early on an unknown scheme
    layouts = Layout(root_uri), Layout(local.rstrip("/") or local)
    bind(layouts[1], layouts[0])  # TierInUseError when the tier serves another root
    return layouts

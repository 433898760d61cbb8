"""What a Checkpointer deletes: old checkpoints past its retention rules, and the debris of killed saves.

Retention (the last step of each save's commit) keeps the union of: the ``keep_last`` newest steps,
every step with ``(step + keep_every_offset) % keep_every == 0`` (ckptio counts the step passed to
``save``: offset 0 keeps 0, k, 2k...; DINOv3 saves 0-based iteration ``it`` and keeps
``(it + 1) % k == 0``: ``keep_every_offset=1`` keeps 99, 199...), the ``keep_best`` best by
``metrics[best_metric]`` (``best_mode`` ``"min"`` or ``"max"``; NaN never counts), every kept step (:func:`keep`) and
always the latest committed step; with no rule set nothing is deleted. ``retention=`` names a policy
(DINOv3's ``CheckpointRetentionPolicy``): ``"all"`` (nothing deleted), ``"last"`` (``keep_last``,
default 1), ``"best"`` (``keep_best``, default 1; the latest is still kept: it is what a resume
restores), ``"last_and_best"`` (both), ``"none"`` (only the latest and the kept steps).

It deletes the other complete checkpoints of this root and the uncommitted directories of ckptio's
older than the latest that are debris (marker first, so a crash mid-delete leaves an uncommitted
directory, never a committed one with files missing), never the latest, a kept step, or a step being
written or replicated (``busy``). Directories ckptio did not write are never touched
(:meth:`Layout.step_dirs`). An uncommitted directory is debris when it is this Checkpointer's own (a
save of it that failed: ``Layout.started``) or nothing in it (objects, unfinished writes, the directory)
changed for ``stale_after`` seconds (a killed save's, whichever process it was; ``None``: never):
another process saving to the same root keeps its step in progress changing, so it is left alone.

Kept steps: ``root/kept.json`` maps a name to a step (``{"best": 1200, "final": 5000, "199_keep":
199}``), replaced atomically by :func:`keep` and :func:`unkeep` (one writer at a time: the training
process); a name moves to the step kept last under it. Tiered: at the remote root.

Before its first save, rank 0 also discards what killed saves left under root and storage keeps:
S3 multipart uploads and local temporary files (``.latest.txt.ckptio-tmp-*``) of the pointer, of
step directories and of content objects (``.content/``, :mod:`.content`), started more than
``stale_after`` seconds ago (6 hours by default, so never a save still running in another
process), through the backend's ``list_pending_writes``.
"""

from __future__ import annotations

import contextlib
import enum
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Collection, Sequence
from typing import Protocol

from .. import markers
from .. import uri as _uri
from ..errors import FormatError, NotFoundError, logger
from ..incremental import CONTENT_DIR
from .manifest import POINTER_NAME, CheckpointWarning, Layout, _is_own_name, _is_step_name

log = logger("ckptio.checkpointer")

STALE_AFTER = 6 * 3600.0
KEPT_NAME = "kept.json"


class RetentionPolicy(str, enum.Enum):
    """DINOv3's ``CheckpointRetentionPolicy`` names (``retention=``; the strings work too)."""

    ALL = "all"
    BEST = "best"
    LAST = "last"
    LAST_AND_BEST = "last_and_best"
    NONE = "none"


class _Rules(Protocol):
    """The retention settings (a Checkpointer's attributes of these names)."""

    retention: RetentionPolicy | None
    keep_last: int | None
    keep_every: int | None
    keep_every_offset: int
    keep_best: int | None
    best_metric: str | None
    best_mode: str
    stale_after: float | None


def check_rules(
    keep_last: int | None,
    keep_every: int | None,
    keep_best: int | None,
    best_metric: str | None,
    best_mode: str,
    keep_every_offset: int = 0,
    retention: str | RetentionPolicy | None = None,
) -> tuple[RetentionPolicy | None, int | None, int | None]:
    """Check the rules; returns ``(policy, keep_last, keep_best)`` with the policy's defaults filled in."""
    for name, v in (("keep_last", keep_last), ("keep_every", keep_every), ("keep_best", keep_best)):
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise ValueError(f"{name} must be a positive int or None, got {v!r}")
    if not isinstance(keep_every_offset, int) or isinstance(keep_every_offset, bool):
        raise ValueError(f"keep_every_offset must be an int, got {keep_every_offset!r}")
    if keep_every_offset and keep_every is None:
        raise ValueError("keep_every_offset needs keep_every=")
    policy = None
    if retention is not None:
        try:
            policy = RetentionPolicy(retention.lower() if isinstance(retention, str) else retention)
        except ValueError:
            raise ValueError(
                f"retention must be one of {[p.value for p in RetentionPolicy]} or None, got {retention!r}"
            ) from None
    given = [n for n, v in (("keep_last", keep_last), ("keep_every", keep_every), ("keep_best", keep_best)) if v]
    clash = {
        RetentionPolicy.ALL: given,
        RetentionPolicy.NONE: given,
        RetentionPolicy.LAST: [n for n in given if n == "keep_best"],
        RetentionPolicy.BEST: [n for n in given if n == "keep_last"],
    }.get(policy, [])  # type: ignore[arg-type]
    if clash:
        raise ValueError(f"retention={policy.value!r} does not combine with {', '.join(clash)}")  # type: ignore[union-attr]
    if policy in (RetentionPolicy.LAST, RetentionPolicy.LAST_AND_BEST):
        keep_last = keep_last or 1
    if policy in (RetentionPolicy.BEST, RetentionPolicy.LAST_AND_BEST):
        keep_best = keep_best or 1
    if keep_best is not None and not best_metric:
        raise ValueError("keep_best (and retention='best') needs best_metric= (the metrics key to rank by)")
    if best_mode not in ("min", "max"):
        raise ValueError(f"best_mode must be 'min' or 'max', got {best_mode!r}")
    return policy, keep_last, keep_best


def _keeps_all(rules: _Rules) -> bool:
    if rules.retention is not None:
        return rules.retention is RetentionPolicy.ALL
    return rules.keep_last is None and rules.keep_every is None and rules.keep_best is None


def _keep(rules: _Rules, layout: Layout, steps: Sequence[int], latest: int) -> set[int]:
    if _keeps_all(rules):
        return set(steps)
    keep = {latest}
    if rules.keep_last is not None:
        keep.update(sorted(steps)[-rules.keep_last :])
    if rules.keep_every is not None:
        keep.update(s for s in steps if (s + rules.keep_every_offset) % rules.keep_every == 0)
    if rules.keep_best is not None:
        scored = []
        for s in steps:
            try:
                m = layout.manifest(s)
            except FileNotFoundError:
                continue
            except FormatError as e:  # never deleted for a score it cannot tell
                warnings.warn(f"retention keeps step {s}: {e}", CheckpointWarning, stacklevel=2)
                keep.add(s)
                continue
            metrics = m.get("metrics") if isinstance(m, dict) else None
            v = metrics.get(rules.best_metric) if isinstance(metrics, dict) else None
            if isinstance(v, (int, float)) and not isinstance(v, bool) and v == v:  # NaN: a diverged step, never best
                scored.append((v if rules.best_mode == "min" else -v, -s, s))
        keep.update(s for *_, s in sorted(scored)[: rules.keep_best])
    return keep


_locks: weakref.WeakKeyDictionary[Layout, threading.RLock] = weakref.WeakKeyDictionary()
_locks_lock = threading.Lock()


def _lock(layout: Layout) -> threading.RLock:
    """One lock per root's Layout: retention and keep/unkeep of one Checkpointer (its save path, its
    replicator thread, the caller) never interleave."""
    with _locks_lock:
        return _locks.setdefault(layout, threading.RLock())


def cleanup(rules: _Rules, layout: Layout, latest: int, busy: Collection[int] = ()) -> list[int]:
    """Delete what the rules do not keep, now that ``latest`` is committed; ``busy``: steps being
    written or replicated (never deleted). Returns the complete steps kept (what ``layout.list()``
    would now list, without listing again)."""
    return prune(rules, layout, latest, busy)[0]


def prune(rules: _Rules, layout: Layout, latest: int, busy: Collection[int] = ()) -> tuple[list[int], list[int]]:
    """:func:`cleanup`, returning ``(complete steps kept, complete steps deleted)``."""
    with _lock(layout):
        dirs = layout.step_dirs()
        complete = layout.committed_among(dirs)
        keep = _keep(rules, layout, complete, latest) | {latest} | set(busy)
        doomed = [s for s in complete if s not in keep]
        if doomed:  # read only when something would go: a name may protect it
            kept_steps = set(kept(layout).values())
            doomed = [s for s in doomed if s not in kept_steps]
        debris = [s for s in dirs if s not in complete and s < latest and s not in busy]
        debris = [s for s in debris if is_debris(layout, s, rules.stale_after)]
        for s in sorted(doomed) + sorted(debris):
            layout.discard(s)
            layout.started.discard(s)
        return sorted(set(complete) - set(doomed)), sorted(doomed)


def is_debris(layout: Layout, step: int, stale_after: float | None) -> bool:
    """Whether the uncommitted directory of ``step`` is debris to delete (retention; a local tier's
    eviction): this Checkpointer's own (a save of it that failed) or :func:`abandoned` (a killed save's).
    Anything else may be another saver's step in progress."""
    return step in layout.started or abandoned(layout, step, stale_after)


def abandoned(layout: Layout, step: int, stale_after: float | None) -> bool:
    """Whether nothing in the uncommitted directory of ``step`` (its objects, its unfinished writes, the
    directory itself where it has a time) changed for ``stale_after`` seconds; False where no time is known."""
    if stale_after is None:
        return False
    backend, d = layout.backend, layout.dir(step)
    try:
        times = [i.mtime for i in backend.list(d, recursive=True)] + [backend.stat(d).mtime]
    except (FileNotFoundError, NotADirectoryError):
        return False  # gone meanwhile
    with contextlib.suppress(FileNotFoundError, NotADirectoryError, PermissionError):  # objects' times then
        times += [w.since for w in backend.list_pending_writes(d)]
    known = [t for t in times if t is not None]
    return bool(known) and max(known) <= time.time() - stale_after


# ---- kept steps ------------------------------------------------------------------------------------------


def kept(layout: Layout) -> dict[str, int]:
    """Name -> step of every kept step under ``layout``'s root (``kept.json``; none: ``{}``)."""
    where = _uri.join_path(layout.root_uri, KEPT_NAME)
    fix = "retention stops until it is fixed: rewrite it (or delete it, which drops every kept name)"
    try:
        names = markers.read_json(layout.backend, _uri.join_path(layout.root, KEPT_NAME), where)
    except FileNotFoundError:
        return {}
    except FormatError as e:
        raise FormatError(f"{e}; {fix}") from None
    if not isinstance(names, dict) or not all(type(v) is int and v >= 0 for v in names.values()):
        raise FormatError(f"{where}: not the JSON ckptio writes (name -> step); {fix}")
    return names


def _write_kept(layout: Layout, names: dict[str, int]) -> None:
    data = markers.dumps(dict(sorted(names.items())), _uri.join_path(layout.root_uri, KEPT_NAME), indent=1)
    layout.backend.write(_uri.join_path(layout.root, KEPT_NAME), data, mode="overwrite")


def check_name(name: str) -> str:
    if not isinstance(name, str) or not name or len(name) > 200 or not name.isprintable():
        raise ValueError(f"a kept step's name must be a printable string of 1 to 200 characters, got {name!r}")
    return name


def keep(layout: Layout, step: int, name: str, exists: Callable[[], bool]) -> None:
    """Keep ``step`` under ``name`` (moved there if it named another step); ``exists()``: the step is
    committed (tiered: on either tier), asked under the lock retention holds, so no prune deletes it between."""
    with _lock(layout):
        if not exists():
            raise NotFoundError(layout.uri(step), "no checkpoint for this step to keep")
        names = kept(layout)
        was = names.get(name)
        names[name] = step
        _write_kept(layout, names)
    if was is not None and was != step:
        log.info("%s: the kept name %r moved from step %d to step %d", layout.root_uri, name, was, step)


def unkeep(layout: Layout, name: str) -> int:
    """Drop the kept name ``name``; returns its step (deleted by the next retention if no rule keeps it)."""
    with _lock(layout):
        names = kept(layout)
        if name not in names:
            raise KeyError(f"{_uri.join_path(layout.root_uri, KEPT_NAME)}: no kept step is named {name!r}")
        step = names.pop(name)
        _write_kept(layout, names)
        return step


def names_of(layout: Layout, step: int) -> list[str]:
    """The names under which ``step`` is kept."""
    return sorted(n for n, s in kept(layout).items() if s == step)


def abort_stale_writes(layout: Layout, stale_after: float | None) -> None:
    """Discard the unfinished writes killed saves left under root (``stale_after``)."""
    prefix = layout.root.rstrip("/") + "/"
    steps: set[str] | None = None  # the unpadded step directories of ckptio's, listed when first needed

    def ours(uri: str) -> bool:  # the pointer, or something in a step directory of ckptio's
        nonlocal steps
        rel = uri[len(prefix) :] if uri.startswith(prefix) else ""
        top = rel.split("/", 1)[0] if "/" in rel else None
        if rel == POINTER_NAME or top == CONTENT_DIR or (top is not None and _is_own_name(top)):
            return True
        if top is None or not _is_step_name(top):
            return False
        if steps is None:
            steps = set(layout.step_dirs().values())
        return top in steps

    cutoff = time.time() - (stale_after or 0.0)
    try:
        stale = [w for w in layout.backend.list_pending_writes(layout.root) if w.since <= cutoff and ours(w.uri)]
        for w in stale:
            layout.backend.abort_pending_write(w)
    except PermissionError as e:
        warnings.warn(
            f"{layout.root_uri}: cannot discard the unfinished writes of killed saves ({e}); they stay "
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
                layout.root_uri,
                ", ".join(sorted({w.uri for w in stale})),
            )

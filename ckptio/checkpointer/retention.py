"""What a Checkpointer deletes: old checkpoints past its retention rules, and the debris of killed saves.

Retention (the last step of each save's commit) keeps the union of: the ``keep_last`` newest steps,
every step divisible by ``keep_every``, the ``keep_best`` best by ``metrics[best_metric]`` (``best_mode``
``"min"`` or ``"max"``), and always the latest; with no rule set nothing is deleted. It deletes the other
complete checkpoints of this root and the uncommitted directories older than the latest (marker first,
so a crash mid-delete leaves an uncommitted directory, never a committed one with files missing),
never the latest.

Before its first save, rank 0 also discards what killed saves left under root and storage keeps:
S3 multipart uploads and local temporary files (``.latest.txt.ckptio-tmp-*``) of the pointer, of
step directories and of content objects (``.content/``, :mod:`.content`), started more than
``stale_after`` seconds ago (6 hours by default, so never a save still running in another
process), through the backend's ``list_pending_writes``.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Sequence
from typing import Protocol

from ..errors import logger
from ..incremental import CONTENT_DIR
from .manifest import POINTER_NAME, CheckpointWarning, Layout, _is_step_name

log = logger("ckptio.checkpointer")

STALE_AFTER = 6 * 3600.0


class _Rules(Protocol):
    """The retention settings (a Checkpointer's attributes of these names)."""

    keep_last: int | None
    keep_every: int | None
    keep_best: int | None
    best_metric: str | None
    best_mode: str


def check_rules(
    keep_last: int | None, keep_every: int | None, keep_best: int | None, best_metric: str | None, best_mode: str
) -> None:
    for name, v in (("keep_last", keep_last), ("keep_every", keep_every), ("keep_best", keep_best)):
        if v is not None and (not isinstance(v, int) or v < 1):
            raise ValueError(f"{name} must be a positive int or None, got {v!r}")
    if keep_best is not None and not best_metric:
        raise ValueError("keep_best needs best_metric= (the metrics key to rank checkpoints by)")
    if best_mode not in ("min", "max"):
        raise ValueError(f"best_mode must be 'min' or 'max', got {best_mode!r}")


def _keep(rules: _Rules, layout: Layout, steps: Sequence[int], latest: int) -> set[int]:
    if rules.keep_last is None and rules.keep_every is None and rules.keep_best is None:
        return set(steps)
    keep = {latest}
    if rules.keep_last is not None:
        keep.update(sorted(steps)[-rules.keep_last :])
    if rules.keep_every is not None:
        keep.update(s for s in steps if s % rules.keep_every == 0)
    if rules.keep_best is not None:
        scored = []
        for s in steps:
            try:
                v = layout.manifest(s).get("metrics", {}).get(rules.best_metric)
            except FileNotFoundError:
                continue
            if v is not None:
                scored.append((v if rules.best_mode == "min" else -v, -s, s))
        keep.update(s for *_, s in sorted(scored)[: rules.keep_best])
    return keep


def cleanup(rules: _Rules, layout: Layout, latest: int) -> list[int]:
    """Delete what the rules do not keep, now that ``latest`` is committed; returns the complete steps
    kept (what ``layout.list()`` would now list, without listing again)."""
    dirs = layout.step_dirs()
    complete = layout.committed_among(dirs)
    doomed = [s for s in complete if s not in _keep(rules, layout, complete, latest) and s != latest]
    debris = [s for s in dirs if s not in complete and s < latest]
    for s in sorted(doomed) + sorted(debris):
        layout.discard(s)
    return sorted(set(complete) - set(doomed))


def abort_stale_writes(layout: Layout, stale_after: float | None) -> None:
    """Discard the unfinished writes killed saves left under root (``stale_after``)."""
    prefix = layout.root.rstrip("/") + "/"

    def ours(uri: str) -> bool:  # the pointer, or something in a step directory
        rel = uri[len(prefix) :] if uri.startswith(prefix) else ""
        top = rel.split("/", 1)[0] if "/" in rel else None
        return rel == POINTER_NAME or top == CONTENT_DIR or (top is not None and _is_step_name(top))

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

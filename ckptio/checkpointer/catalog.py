"""What a Checkpointer root holds, without loading anything: ``ckptio info ROOT``.

:func:`catalog` reads the root's listing and each step's commit marker (checked as a load checks it,
:func:`~ckptio.checkpointer.manifest._check_manifest`) and returns one row per step directory: step,
format, bytes stored in its directory (an incremental step's content is counted by ``ckptio du``),
state, where its copies are (``root``; with a node's local tier: ``local``, ``local+remote``,
``remote``), whether it is durable (committed at root), incremental, metrics, save time, the names it
is kept under (``kept.json``, :func:`~ckptio.checkpointer.retention.kept`). A directory without a
marker is ``incomplete`` (a save that was killed or is running); a marker that fails its check is
``damaged``, with the reason. Nothing here imports torch.
"""

from __future__ import annotations

import os
from typing import Any

from .. import uri as _uri
from ..errors import CkptioError, FormatError
from ..threads import Pool
from .binding import check
from .manifest import MARKER_NAME, POINTER_NAME, Layout, _check_manifest, read_manifest
from .retention import kept

__all__ = ["catalog", "is_root"]


def is_root(layout: Layout) -> bool:
    """Whether ``layout.root`` looks like a Checkpointer root: a step directory or a latest pointer."""
    return bool(layout.step_dirs()) or layout.backend.isfile(_uri.join_path(layout.root, POINTER_NAME))


def _rows(layout: Layout) -> dict[int, dict[str, Any]]:
    """Step -> row of every step directory (committed or not): its marker and a listing of it (not of
    the whole root: an incremental root's ``.content`` may hold many objects); an object store is
    asked about several steps at once."""
    steps = sorted(layout.step_dirs())

    def row(step: int) -> dict[str, Any]:
        d = layout.dir(step).rstrip("/") + "/"
        size = sum(i.size for i in layout.backend.list(d, recursive=True) if not i.is_dir and i.uri.startswith(d))
        return _row(layout, step, size)

    if len(steps) <= 1 or layout.backend.reads_local:
        return {s: row(s) for s in steps}
    with Pool(min(len(steps), layout.backend.concurrency), thread_name_prefix="ckptio-info") as ex:
        return dict(zip(steps, ex.map(row, steps), strict=True))


def _row(layout: Layout, step: int, size: int) -> dict[str, Any]:
    marker = layout.user_uri(step, MARKER_NAME)
    row: dict[str, Any] = {"step": step, "uri": layout.uri(step), "size": size}
    try:
        m = read_manifest(layout.backend, _uri.join_path(layout.dir(step), MARKER_NAME), marker)
        _, fmt, _ = _check_manifest(m, marker)
    except FileNotFoundError:
        return {**row, "state": "incomplete", "format": None}
    except FormatError as e:
        return {**row, "state": "damaged", "format": None, "problem": str(e)}
    metrics = m.get("metrics")
    return {
        **row,
        "state": "committed",
        "format": fmt,
        "incremental": m.get("content") is not None,
        "metrics": metrics if isinstance(metrics, dict) else {},
        "time": m.get("time") if isinstance(m.get("time"), (int, float)) else None,
    }


def catalog(root_uri: str, local_tier: str | None = None) -> dict[str, Any]:
    """``{"uri", "kind": "checkpointer", "latest", "local_tier", "steps": [row...]}`` of the Checkpointer
    root ``root_uri`` (rows ascending by step; see the module docstring). ``local_tier``: a node's local
    tier directory, whose steps are listed too; default: the one the settings' ``[checkpointer]`` table
    gives this root, when it exists. Raises ``FileNotFoundError`` when the root has no step and no pointer."""
    layout = Layout(root_uri.rstrip("/") or root_uri)
    if not is_root(layout):
        raise FileNotFoundError(
            f"{root_uri}: no Checkpointer steps here (no step directory, no {POINTER_NAME}); "
            f"`ckptio ls {root_uri}` shows what is there"
        )
    if local_tier is None:
        local_tier = _settings_tier(root_uri)
    rows = _rows(layout)
    for r in rows.values():
        r["where"] = "root"
        r["durable"] = r["state"] == "committed"
        r["kept"] = []
    extra: dict[str, Any] = {}
    try:
        for name, step in sorted(kept(layout).items()):
            if step in rows:
                rows[step]["kept"].append(name)
    except FormatError as e:  # shown with the steps: the listing is still worth having
        extra["kept_problem"] = str(e)
    if local_tier is not None:
        local = Layout(local_tier.rstrip("/") or local_tier)
        check(local, layout)  # TierInUseError: that tier's steps are another root's
        for s, lr in _rows(local).items():
            if lr["state"] != "committed":
                continue
            if s in rows and rows[s]["state"] == "committed":
                rows[s]["where"] = "local+remote"
            else:
                rows[s] = {**lr, "where": "local", "durable": False, "kept": []}
        for row in rows.values():
            if row["where"] == "root":
                row["where"] = "remote"
    try:
        latest = layout.pointer()
    except CkptioError:
        latest = None
    return {
        "uri": root_uri,
        "kind": "checkpointer",
        "latest": latest,
        "local_tier": local_tier,
        "steps": [rows[s] for s in sorted(rows)],
        **extra,
    }


def _settings_tier(root_uri: str) -> str | None:
    """The local tier the settings give ``root_uri`` (``[checkpointer] local_tier``), if it exists here."""
    from .tiered import tier_options

    tier, _ = tier_options(root_uri, None, None, None, None, False)
    return tier if tier is not None and os.path.isdir(tier) else None

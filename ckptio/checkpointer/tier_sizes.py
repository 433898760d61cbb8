"""What a tiered step's marker lists besides a plain one (``"sizes"``: every file of the step directory
and its size, :mod:`.tiered`), and the check of a copy of the step against it."""

from __future__ import annotations

from typing import Any

from .. import uri as _uri
from ..errors import CkptioError
from .manifest import MARKER_NAME, Layout, read_manifest

SIZES_KEY = "sizes"


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
        m = read_manifest(layout.backend, _uri.join_path(layout.dir(step), MARKER_NAME), marker)
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

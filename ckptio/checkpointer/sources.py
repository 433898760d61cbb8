"""What a URI given to a load names, and whether it is a complete checkpoint.

A URI may name: a Checkpointer step directory (its ``checkpoint.json``), a bare DCP directory (its
``.metadata``, written last; not in a directory named as a Checkpointer's step, which needs its
marker), a ``.pt``/``.pth``/``.fpk`` file, a Checkpointer root (its latest
complete step), or the root of a seed's own layout (DINOv3, Cosmos: :mod:`.seeds`, its latest complete
step). :func:`resolve` turns it into a :class:`Target`; :func:`is_complete` says whether it names a
committed, complete checkpoint, reading only markers, listings and a file's last bytes.

A seed's checkpoint reads as ``dcp`` (DINOv3: its ``iteration`` entry is the seed's bookkeeping, never
reported as unexpected) or ``pt-parts`` (Cosmos: one ``.pt`` file per part, ``files``). Cosmos's DCP
variant (one DCP directory per part) is recognised but not read by the Checkpointer: restore each part
with ``ckptio.dcp.load(state_dict, target.files[part])``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .. import uri as _uri
from ..context import resolve as _resolve
from ..errors import CkptioError, FormatError, IncompleteCheckpointError
from . import seeds
from .manifest import (
    _DATA_FILE,
    MARKER_NAME,
    STEP_DIGITS,
    Layout,
    _check_manifest,
    _is_step_name,
    read_manifest,
    target_of_uri,
)

DCP_METADATA = ".metadata"


@dataclass(frozen=True)
class Target:
    """One checkpoint to read. ``fmt``: ``"dcp"``, ``"pt"``, ``"fpk"`` (``uri`` is the directory, ``name``
    the data file of ``pt``/``fpk``) or ``"pt-parts"`` (``files``: part -> ``.pt`` file URI);
    ``content``: read through the content store (:mod:`.content`); ``ignore``: parts of a seed's
    checkpoint that are its bookkeeping (never unexpected); ``seed``: ``"dinov3"``/``"cosmos"`` or None."""

    step: int
    uri: str
    fmt: str
    name: str | None = None
    content: bool = False
    files: Mapping[str, str] = field(default_factory=dict)
    ignore: tuple[str, ...] = ()
    seed: str | None = None


def of_seed(found: seeds.SeedSteps, step: int) -> Target:
    """The :class:`Target` of complete ``step`` of a seed's layout."""
    t = found.target(step)
    if t.fmt == "dcp":
        return Target(t.step, t.uri, "dcp", ignore=("iteration",), seed=found.kind)
    if t.fmt == "pt-parts":
        return Target(t.step, t.uri, "pt-parts", files=dict(t.files), seed=found.kind)
    raise CkptioError(
        f"{t.uri}: a {found.kind} checkpoint of one DCP directory per part ({sorted(t.files)}) is not read by the "
        f"Checkpointer; restore each part with ckptio.dcp.load(state_dict, '{t.uri}/<part>')"
    )


def seed_latest(root_uri: str) -> Target | None:
    """The latest complete checkpoint of a seed's layout under ``root_uri`` (:func:`seeds.find`), or None."""
    found = seeds.find(root_uri)
    if found is None:
        return None
    step = found.latest()
    return None if step is None else of_seed(found, step)


def resolve(uri: str | os.PathLike) -> Target:
    """The checkpoint ``uri`` names (see the module docstring); ``IncompleteCheckpointError`` if none."""
    u = os.fspath(uri).rstrip("/") or os.fspath(uri)
    try:
        return Target(*target_of_uri(u))
    except IncompleteCheckpointError:
        root = Layout(u)
        step = root.latest()
        if step is not None:
            s, d, fmt, name, content = root.resolve_target(step)
            assert s is not None and d is not None and fmt is not None
            return Target(s, d, fmt, name, content)
        found = seed_latest(u)
        if found is not None:
            return found
        raise


def is_complete(uri: str | os.PathLike) -> bool:
    """Whether ``uri`` names a committed, complete checkpoint: a Checkpointer step directory whose commit
    marker is valid and whose data is there (a ``pt`` file ending in its zip end record, a DCP
    ``.metadata``); a bare DCP directory with its ``.metadata``; a whole ``.pt``/``.pth`` (zip end
    record) or ``.fpk`` file (footer and metadata readable); a Checkpointer or seed root with a latest
    complete checkpoint. False for anything else, a missing URI included."""
    u = os.fspath(uri).rstrip("/") or os.fspath(uri)
    backend, d = _resolve(u)
    if backend.isfile(d):
        return _file_whole(backend, d, u)
    marker = _uri.join_path(d, MARKER_NAME)
    if backend.isfile(marker):
        try:
            m = read_manifest(backend, marker, _uri.join_path(u, MARKER_NAME))
            _, fmt, name = _check_manifest(m, _uri.join_path(u, MARKER_NAME))
        except (FormatError, FileNotFoundError):
            return False
        if fmt == "dcp":
            return backend.isfile(_uri.join_path(d, DCP_METADATA))
        assert name is not None
        data = _uri.join_path(d, name)
        if m.get("content") is not None:  # a recipe: its blocks are checked when read
            return backend.isfile(data)
        return backend.isfile(data) and _file_whole(backend, data, _uri.join_path(u, name))
    if backend.isfile(_uri.join_path(d, DCP_METADATA)):
        return not _ckptio_step_name(_uri.basename(u))  # a Checkpointer's own step is complete once committed
    if Layout(u).latest() is not None:
        return True
    found = seeds.find(u)
    return found is not None and found.latest() is not None


def _ckptio_step_name(name: str) -> bool:
    return len(name) == STEP_DIGITS and _is_step_name(name)


def _file_whole(backend: Any, d: str, u: str) -> bool:
    if d.endswith((".pt", ".pth")):
        return backend.stat(d).size > 0 and seeds.zip_whole(backend, d)
    if d.endswith(_DATA_FILE["fpk"][5:]):
        from ..formats.fastpickle import inspect

        try:
            inspect(u)
        except (CkptioError, OSError, ValueError):
            return False
        return True
    return False

"""Which remote root a local tier serves: ``<local_tier>/tier.json``.

A tier holds one run's steps: a second Checkpointer with another root would resume from the first
run's step, replicate its steps into its own root and apply its retention to them. So the first
tiered Checkpointer to open a directory writes ``tier.json`` there (create-only: of processes racing
to bind an empty tier exactly one wins), naming its root: ``{"root": <root URI>, "identity":
<canonical root>}``; the identity is the resolved URI (local paths absolute, symlinks resolved), so
two spellings of one root match. A Checkpointer whose root has another identity gets
:class:`~ckptio.errors.TierInUseError` when it opens the tier, before it reads or writes a step there;
so does ``ckptio ls --steps ROOT --local-tier DIR`` (:func:`.tiered.status`), which binds nothing.

A tier without ``tier.json`` (a plain Checkpointer root, or a tier written before ckptio bound
tiers) is bound to the first root that opens it as a tier, and its steps are that root's (logged).
"""

from __future__ import annotations

import logging
import os
import time

from .. import markers
from .. import uri as _uri
from ..errors import FormatError, TierInUseError
from .manifest import Layout

log = logging.getLogger("ckptio.checkpointer")

BINDING_NAME = "tier.json"


def identity(layout: Layout) -> str:
    """The canonical form of ``layout``'s root: its resolved URI, a local path made absolute and real."""
    scheme, rest = _uri.split(layout.root)
    if scheme in ("", "file"):
        return "file://" + os.path.realpath(os.path.expanduser(rest))
    return layout.root.rstrip("/")


def bind(local: Layout, remote: Layout) -> None:
    """Bind the tier ``local`` to ``remote`` (first use), or check that it is bound to it."""
    record = {"root": remote.root_uri, "identity": identity(remote), "time": time.time()}
    try:
        local.backend.write(_path(local), markers.dumps(record, _shown(local), indent=1, sort_keys=True), mode="create")
    except FileExistsError:  # bound before, or by a process racing this one: which root?
        check(local, remote)
        return
    steps = local.list()
    if steps:
        log.info(
            "%s: bound to %s; the steps it held are taken as that root's: %s", _shown(local), remote.root_uri, steps
        )


def check(local: Layout, remote: Layout) -> None:
    """Raise :class:`TierInUseError` if the tier ``local`` is bound to another root than ``remote``
    (an unbound tier passes)."""
    fix = (
        f"it names the root this local tier serves: if you know that root is {remote.root_uri!r}, delete the "
        f"file to bind the tier again"
    )
    try:
        theirs = markers.read_json(local.backend, _path(local), _shown(local))
    except FileNotFoundError:
        return
    except FormatError as e:  # its reason, after the name
        raise FormatError(f"{_shown(local)}: damaged ({str(e).removeprefix(_shown(local) + ': ')}); {fix}") from None
    bound, root = (theirs.get("identity"), theirs.get("root")) if isinstance(theirs, dict) else (None, None)
    if not isinstance(bound, str) or not isinstance(root, str):
        raise FormatError(f"{_shown(local)}: damaged (not the JSON ckptio writes: root and identity); {fix}")
    if bound != identity(remote):
        raise TierInUseError(
            _shown(local),
            f"local tier {local.root_uri!r} serves the checkpoints of {root!r}, not of {remote.root_uri!r}; "
            f"sharing a tier would mix the two runs (resume from the other's step, replicate its steps, "
            f"delete them by retention). Give this run its own local_tier= (a directory per run), or reuse "
            f"this one only once {root!r} no longer runs and its steps are at its root, after emptying it",
        )


def _path(local: Layout) -> str:
    return _uri.join_path(local.root, BINDING_NAME)


def _shown(local: Layout) -> str:
    return _uri.join_path(local.root_uri, BINDING_NAME)

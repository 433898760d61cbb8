"""``Checkpointer``: crash-safe, resumable training checkpoints on any ckptio URI.

The package's modules, each stating its part of the contract:

- :mod:`.core`: the :class:`Checkpointer` class, its save and load sequences and the commit protocol;
- :mod:`.manifest`: the layout under root: step directories, the ``checkpoint.json`` commit marker
  (parsed and validated before anything it names is read), the ``latest.txt`` pointer;
- :mod:`.formats`: writing, reading and discarding the data of a ``dcp``, ``pt`` or ``fpk`` checkpoint;
- :mod:`.state`: ``Stateful`` parts, restoring in place, :class:`RNGState`, :class:`LoadResult`;
  :mod:`.statedict`: modules and optimizers as state dicts, the check before a load touches anything;
  :mod:`.matching`: what that check finds, an optimizer matched by parameter name;
- :mod:`.staging`: async save's snapshot copies and background thread;
- :mod:`.retention`: ``keep_last``/``keep_every``/``keep_best``, policies (``retention=``), kept steps and the
  debris of killed saves;
- :mod:`.content`: incremental saves (``incremental=True``): the content store, its sweep, :func:`usage`;
- :mod:`.sources`: what a URI given to a load names (a step, a DCP directory, a file, a root, a seed's
  layout: :mod:`.seeds`), :func:`is_complete`; :mod:`.pretrained`: :func:`load_model` (init from a checkpoint);
- :mod:`.tiered`: tiered saves (``local_tier=``): the two roots, step states, which copy a restore reads,
  local eviction; :mod:`.replication`: their background replicator, its bounded queue and failures;
  :mod:`.binding`: the root a local tier serves (``tier.json``, :class:`~ckptio.errors.TierInUseError`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..errors import TierInUseError
from .content import usage
from .manifest import FORMATS as FORMATS
from .manifest import MARKER_NAME, POINTER_NAME, CheckpointInfo, CheckpointWarning
from .manifest import STEP_DIGITS as STEP_DIGITS
from .replication import BacklogError, ReplicationError
from .retention import STALE_AFTER as STALE_AFTER
from .retention import RetentionPolicy

if TYPE_CHECKING:
    from .core import Checkpointer
    from .pretrained import load_model
    from .sources import is_complete
    from .state import LoadResult, RNGState, SaveResult
    from .state import tree_has as tree_has

# these import torch: loaded on first use, so the torch-free commands (``ckptio du``, ``info ROOT``) stay so
_LAZY = {
    "Checkpointer": "core",
    "LoadResult": "state",
    "RNGState": "state",
    "SaveResult": "state",
    "tree_has": "state",
    "load_model": "pretrained",
    "is_complete": "sources",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "Checkpointer",
    "usage",
    "load_model",
    "is_complete",
    "CheckpointWarning",
    "CheckpointInfo",
    "LoadResult",
    "RNGState",
    "SaveResult",
    "BacklogError",
    "ReplicationError",
    "TierInUseError",
    "RetentionPolicy",
    "MARKER_NAME",
    "POINTER_NAME",
]

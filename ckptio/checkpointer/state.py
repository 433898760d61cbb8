"""The state a Checkpointer saves and restores: ``Stateful`` parts, restoring in place, RNG states.

A state is a mapping of part name -> tensor, container or ``Stateful`` object (anything with
``state_dict``/``load_state_dict``: modules, optimizers, :class:`RNGState`). ``save`` stores each
``Stateful``'s ``state_dict()``; ``load`` restores into the objects given by the rules of
:func:`ckptio.restore.apply` (``Stateful`` objects through ``load_state_dict``, tensors in place, dicts
entry by entry); what did not match is recorded in a :class:`LoadResult`.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..restore import LoadResult, apply, is_stateful

__all__ = ["LoadResult", "RNGState", "SaveResult", "restore", "state_dicts", "tree_has"]


@dataclass
class SaveResult:
    """What the last finished :meth:`Checkpointer.save` did (``Checkpointer.last_save``; rank 0 has the
    byte counts of ``incremental`` saves: ``logical_bytes`` given, ``bytes_written`` stored)."""

    step: int
    uri: str
    seconds: float
    logical_bytes: int | None = None
    bytes_written: int | None = None


def tree_has(tree: Any, path: Sequence[Any]) -> bool:
    for p in path:
        try:
            tree = tree[p]
        except (KeyError, IndexError, TypeError):
            return False
    return True


def _fill_empty(template: Any, tree: Any) -> None:
    if isinstance(template, dict) and isinstance(tree, dict):
        for k, v in template.items():
            if isinstance(v, (dict, list)) and not v and k not in tree:
                tree[k] = type(v)()
            elif k in tree:
                _fill_empty(v, tree[k])


def state_dicts(state: Mapping[str, Any]) -> dict[str, Any]:
    """The parts of ``state``, each ``Stateful`` replaced by its ``state_dict()``."""
    return {k: (v.state_dict() if is_stateful(v) else v) for k, v in state.items()}


class RNGState:
    """A ``Stateful`` holding the process's RNG states (torch CPU and CUDA, Python ``random``, NumPy).

    Put ``RNGState()`` in the state given to ``save``/``load`` to checkpoint and restore them. Under
    ``torch.distributed`` a Checkpointer saves every rank's states and restores each rank's own
    (``ckptio_per_rank``: :mod:`.statedict`).
    """

    ckptio_per_rank = True

    def state_dict(self) -> dict[str, Any]:
        sd: dict[str, Any] = {"torch": torch.get_rng_state(), "python": list(_py_rng_flat())}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            sd["cuda"] = torch.cuda.get_rng_state_all()
        try:
            import numpy as np
        except ImportError:
            return sd
        name, keys, pos, has_gauss, cached = np.random.get_state()
        sd["numpy"] = {
            "name": str(name),
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        }
        return sd

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        torch.set_rng_state(sd["torch"])
        version, *internal, gauss = sd["python"]
        random.setstate((int(version), tuple(int(x) for x in internal), None if gauss is None else float(gauss)))
        if "cuda" in sd and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(sd["cuda"])
        if "numpy" in sd:
            import numpy as np

            n = sd["numpy"]
            np.random.set_state(
                (
                    n["name"],
                    n["keys"].numpy().astype(np.uint32),
                    int(n["pos"]),
                    int(n["has_gauss"]),
                    float(n["cached_gaussian"]),
                )
            )


def _py_rng_flat() -> tuple:
    version, internal, gauss = random.getstate()
    return (version, *internal, gauss)


def restore(
    state: dict[str, Any],
    parts: list[str],
    source: Mapping[str, Any],
    res: LoadResult,
    ckpt_parts: list[str] | None,
) -> None:
    """Restore ``parts`` of ``state`` from ``source``, recording mismatches in ``res``; the checkpoint's
    parts ``ckpt_parts`` that ``state`` lacks are unexpected (None: not reported, only some parts asked for)."""
    for k in parts:
        if k not in source:
            res.missing_keys.append(k)
        else:
            state[k] = apply(state[k], source[k], f"{k}.", res)
    if ckpt_parts is not None:
        res.unexpected_keys += [k for k in ckpt_parts if k not in state]


def metric_values(metrics: Mapping[str, Any] | None) -> dict[str, float]:
    """A save's ``metrics`` as floats: tensors (a loss) read with ``.item()``, without autograd's warning."""
    out = {}
    for k, v in (metrics or {}).items():
        if isinstance(v, torch.Tensor):
            if v.numel() != 1:
                raise ValueError(f"metrics[{k!r}]: a tensor of {v.numel()} elements, not a number")
            v = v.detach().item()
        try:
            out[str(k)] = float(v)
        except (TypeError, ValueError):
            raise TypeError(f"metrics[{k!r}]: {type(v).__name__} is not a number") from None
    return out

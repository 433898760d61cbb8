"""The state a Checkpointer saves and restores: ``Stateful`` parts, restoring in place, RNG states.

A state is a mapping of part name -> tensor, container or ``Stateful`` object (anything with
``state_dict``/``load_state_dict``: modules, optimizers, :class:`RNGState`). ``save`` stores each
``Stateful``'s ``state_dict()``; ``load`` restores into the objects given (:func:`_apply`): ``Stateful``
objects through ``load_state_dict`` (modules with ``strict=False``, their missing/unexpected keys
reported), tensors of the same shape and dtype copied into in place, dicts entry by entry; anything
else is replaced. What did not match is recorded in a :class:`LoadResult`.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class LoadResult:
    """What the last :meth:`Checkpointer.load` restored (``Checkpointer.last_load``)."""

    step: int | None
    uri: str | None
    missing_keys: list[str] = field(default_factory=list)
    unexpected_keys: list[str] = field(default_factory=list)


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


def _is_stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def state_dicts(state: Mapping[str, Any]) -> dict[str, Any]:
    """The parts of ``state``, each ``Stateful`` replaced by its ``state_dict()``."""
    return {k: (v.state_dict() if _is_stateful(v) else v) for k, v in state.items()}


class RNGState:
    """A ``Stateful`` holding the process's RNG states (torch CPU and CUDA, Python ``random``, NumPy).

    Put ``RNGState()`` in the state given to ``save``/``load`` to checkpoint and restore them.
    """

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


def _apply(target: Any, source: Any, prefix: str, res: LoadResult) -> Any:
    """Restore ``source`` into ``target`` in place where possible; returns the value to store."""
    if _is_stateful(target):
        if isinstance(target, torch.nn.Module):
            out = target.load_state_dict(source, strict=False)
            res.missing_keys += [prefix + k for k in out.missing_keys]
            res.unexpected_keys += [prefix + k for k in out.unexpected_keys]
        else:
            target.load_state_dict(source)
        return target
    if isinstance(target, torch.Tensor) and isinstance(source, torch.Tensor):
        if target is source:
            return target
        if target.shape == source.shape and target.dtype == source.dtype:
            with torch.no_grad():
                target.copy_(source)
            return target
        return source
    if isinstance(target, dict) and isinstance(source, Mapping):
        for k in list(target):
            if k not in source:
                res.missing_keys.append(f"{prefix}{k}")
            else:
                target[k] = _apply(target[k], source[k], f"{prefix}{k}.", res)
        for k in source:
            if k not in target:
                res.unexpected_keys.append(f"{prefix}{k}")
                target[k] = source[k]
        return target
    return source


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
            state[k] = _apply(state[k], source[k], f"{k}.", res)
    if ckpt_parts is not None:
        res.unexpected_keys += [k for k in ckpt_parts if k not in state]

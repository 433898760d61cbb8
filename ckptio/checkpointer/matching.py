"""How a checkpoint's parts are matched with the state given to ``load``, before anything is touched.

:class:`Diff` collects what :meth:`.statedict.Parts.verify` finds: keys missing and unexpected, and the
problems that no load can restore (a module's tensor of another shape, an optimizer that cannot be matched),
which fail the load whatever ``strict``, as torch's ``load_state_dict`` fails for a size mismatch.

An optimizer saved by name (``get_optimizer_state_dict``) is matched with the optimizer by name
(:func:`match`), where torch's ``set_optimizer_state_dict`` needs both to hold the same parameters:

* a parameter of the optimizer that the checkpoint does not hold (in a group or in its state) is missing,
  ``<part>.state.<name>``; one the checkpoint holds and the optimizer lacks is unexpected;
* each group of the optimizer takes the hyperparameters of the one checkpoint group that holds any of
  its parameters (empty groups pair in order); a group that no checkpoint group, or more than one, holds
  keeps its own and is missing, ``<part>.param_groups.<i>``; a checkpoint group that no group takes is
  unexpected.

:func:`restore` then restores what matches: the state of the parameters the checkpoint holds, as it holds it
(one it holds without state ends without state), and every group's hyperparameters as above (its parameter
names, ``param_names``, stay its own); the other
parameters' state stays as it was before the load (:func:`held`; none for a fresh optimizer), although torch's
function initializes a fresh optimizer's state first. An optimizer saved by index (before its first step, or
as ``optim.state_dict()``) is restored by position, so its groups must hold as many parameters as the
optimizer's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.parameter import is_lazy

from ..errors import FormatError

__all__ = ["NO_OWNER", "Diff", "Match", "held", "index_keyed", "int_keys", "match", "names", "own_loads", "restore"]

NO_OWNER = (
    "the checkpoint holds optimizer state by parameter name, but no module in the state given to load() holds "
    "all of this optimizer's parameters; pass the model in the same state"
)


_OWN = ("params", "param_names")  # a group's own, whatever the checkpoint's group held (torch puts its names back)


def _params(osd: Mapping[str, Any]) -> list[list[Any] | None]:
    """Each group's parameters in the optimizer state dict ``osd`` (None: not a group with a list of them)."""
    groups = osd.get("param_groups", [])
    if not isinstance(groups, (list, tuple)):
        return [None]
    out = [g.get("params", []) if isinstance(g, Mapping) else None for g in groups]
    return [list(p) if isinstance(p, (list, tuple)) else None for p in out]


def index_keyed(osd: Mapping[str, Any]) -> bool:
    """An optimizer state dict keyed by parameter index (``optim.state_dict()``), not by name."""
    keys = list(osd.get("state") or {}) + [p for ps in _params(osd) for p in ps or []]
    return all(isinstance(k, int) or (isinstance(k, str) and k.isdigit()) for k in keys)


def int_keys(osd: Mapping[str, Any]) -> dict[str, Any]:
    """``osd`` with index keys as ints (DCP stores dict keys as str, and no empty state)."""
    out = dict(osd)
    state = out.get("state") or {}
    if isinstance(state, Mapping):
        out["state"] = {int(k) if isinstance(k, str) and k.isdigit() else k: v for k, v in state.items()}
    return out


def names(module: torch.nn.Module, optim: torch.optim.Optimizer) -> list[list[str]]:
    """The names of ``optim``'s parameters, by group, as ``get_optimizer_state_dict`` keys them."""
    from .. import torch_internals as _ti

    by_id = {id(p): sorted(_ti.get_fqns(module, key))[0] for key, p in module.named_parameters()}
    return [[by_id[id(p)] for p in g["params"]] for g in optim.param_groups]


def held(optim: torch.optim.Optimizer) -> dict[int, Any]:
    """``optim``'s state now, per parameter id: what :func:`restore` puts back for the parameters the
    checkpoint lacks (taken before a load touches anything)."""
    return {id(p): s for p, s in optim.state.items()}


def _groups(source: Mapping[str, Any], where: str) -> list[list[str]]:
    groups = _params(source)
    if any(g is None for g in groups):
        raise FormatError(f"{where}param_groups: not a list of groups each with a list of parameter names")
    return [[str(n) for n in g or []] for g in groups]


@dataclass
class Match:
    """How a named optimizer state dict fits an optimizer: ``mine``, the optimizer's parameter names by group;
    ``groups[i]``, the checkpoint group whose hyperparameters group ``i`` takes (None: it keeps its own);
    ``stored``: the names the checkpoint holds."""

    mine: list[list[str]]
    groups: list[int | None]
    stored: set[str]
    missing: list[str]
    unexpected: list[str]


def match(mine: list[list[str]], source: Mapping[str, Any], prefix: str) -> Match:
    """Match the optimizer's parameter names ``mine`` (by group) with ``source``'s; touches nothing."""
    theirs = _groups(source, prefix)
    state = source.get("state") or {}
    stored = {n for g in theirs for n in g} | {str(n) for n in state}
    every = {n for g in mine for n in g}
    missing = [f"{prefix}state.{n}" for g in mine for n in g if n not in stored]
    unexpected = [f"{prefix}state.{n}" for n in sorted(stored - every)]
    empty = iter(j for j, g in enumerate(theirs) if not g)
    groups: list[int | None] = []
    for i, g in enumerate(mine):
        hits = {j for j, t in enumerate(theirs) if not set(g).isdisjoint(t)} if g else {next(empty, None)} - {None}
        groups.append(hits.pop() if len(hits) == 1 else None)
        if groups[-1] is None:
            missing.append(f"{prefix}param_groups.{i}")
    taken = set(groups)
    unexpected += [f"{prefix}param_groups.{j}" for j in range(len(theirs)) if j not in taken]
    return Match(mine, groups, stored, missing, unexpected)


def restore(
    module: torch.nn.Module,
    optim: torch.optim.Optimizer,
    source: Mapping[str, Any],
    found: Match,
    before: Mapping[int, Any],
    options: Any,
) -> None:
    """Restore ``optim`` from the named ``source`` as ``found`` matched them; ``before``: :func:`held`."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    mine = found.mine
    theirs = list(source.get("param_groups", []))
    state = source.get("state") or {}
    groups = []
    for g, ns, j in zip(optim.param_groups, mine, found.groups, strict=True):
        hyper = g if j is None else theirs[j]
        groups.append({**{k: v for k, v in hyper.items() if k not in _OWN}, "params": ns})
    restored = {n: state[n] for ns in mine for n in ns if n in state}
    set_optimizer_state_dict(module, optim, {"state": restored, "param_groups": groups}, options=options)
    for g, ns in zip(optim.param_groups, mine, strict=True):
        for p, n in zip(g["params"], ns, strict=True):
            if n not in found.stored:  # not in the checkpoint: as it was (torch's function initialized it)
                optim.state.pop(p, None)
                if id(p) in before:
                    optim.state[p] = before[id(p)]


def own_loads(module: torch.nn.Module) -> set[str]:
    """The state dict names (as ``state_dict()`` and torch's state_dict functions give them) of what the modules
    in ``module`` that load their own way hold: a ``_load_from_state_dict`` of their own outside ``torch.nn``
    (torch's quantization observers resize their buffers to the checkpoint's), which decides what fits."""
    from .. import torch_internals as _ti

    out: set[str] = set()
    for prefix, m in module.named_modules():
        load = type(m)._load_from_state_dict
        if load is not torch.nn.Module._load_from_state_dict and not str(getattr(load, "__module__", "")).startswith(
            "torch.nn."
        ):
            for name in m.state_dict(prefix=f"{prefix}." if prefix else ""):
                out |= {name, *_ti.get_fqns(module, name)}
    return out


class Diff:
    """What :meth:`Parts.verify` found: keys missing and unexpected, and ``problems``, what cannot be restored."""

    def __init__(self) -> None:
        self.missing: list[str] = []
        self.unexpected: list[str] = []
        self.problems: list[str] = []

    def shapes(self, prefix: str, module: torch.nn.Module, have: Mapping[str, Any], source: Mapping[str, Any]) -> None:
        """The tensors of ``module`` (``have``, its state dict) of other shapes in ``source`` that torch's
        ``load_state_dict`` refuses (not those a module loading its own way takes, :func:`own_loads`)."""
        theirs = {x: getattr(source.get(x), "shape", None) for x in have}
        skip = own_loads(module) if any(isinstance(s, tuple) for s in theirs.values()) else set()
        for x, t in have.items():
            shape = theirs[x]
            if not isinstance(t, torch.Tensor) or not isinstance(shape, tuple) or x in skip or is_lazy(t):
                continue
            if tuple(shape) != tuple(t.shape) and not (t.dim() == 0 and tuple(shape) == (1,)):  # torch takes [0]
                self.problems.append(f"{prefix}{x} has shape {tuple(shape)} in the checkpoint, {tuple(t.shape)} here")

    def optimizer(self, target: torch.optim.Optimizer, source: Any, prefix: str, owner: Any) -> None:
        if not isinstance(source, Mapping):
            self.problems.append(
                f"{prefix[:-1]}: the checkpoint holds a {type(source).__name__}, not an optimizer's state"
            )
        elif index_keyed(source):  # restored by position: torch's load_state_dict needs the same group sizes
            ours = [len(g["params"]) for g in target.param_groups]
            theirs = [-1 if ps is None else len(ps) for ps in _params(source)]
            if ours != theirs:
                self.problems.append(
                    f"{prefix[:-1]}: the checkpoint holds the optimizer's state by parameter index (saved before its "
                    f"first step, or as optim.state_dict()) in groups of {theirs} parameters, this optimizer's "
                    f"groups hold {ours}: it cannot be matched by name"
                )
        elif owner is None:
            self.problems.append(f"{prefix[:-1]}: {NO_OWNER}")
        else:
            try:
                found = match(names(owner, target), source, prefix)
            except FormatError as e:  # named with the checkpoint in the load's error
                self.problems.append(str(e))
                return
            self.missing += found.missing
            self.unexpected += found.unexpected

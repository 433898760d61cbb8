"""How a Checkpointer's parts become state dicts and are restored, at any depth of the state.

* A module (plain, DDP, FSDP2/DTensor) is saved as torch's ``get_model_state_dict`` (keys without the
  DDP ``module.`` prefix) and restored with ``set_model_state_dict``: the pattern torch's DCP tutorial
  teaches with an ``AppState`` wrapper, done here for every module of the state.
* An optimizer is saved as ``get_optimizer_state_dict`` (its state keyed by parameter name), paired
  with the one module of the state that holds all of its parameters, and restored with
  ``set_optimizer_state_dict``, which initializes a fresh optimizer's state first, so an FSDP2
  optimizer that has not stepped yet gets DTensor shards, never full-size plain tensors. An
  optimizer that has not stepped is saved as its own ``state_dict()`` (it holds no tensors, and
  torch's function would initialize it by a step with zero gradients, changing the live run).
* ``dcp`` stores DTensor shards as they are; ``pt``/``fpk`` (one file, written by rank 0) store full
  tensors, gathered onto rank 0 (``full_state_dict``, ``cpu_offload``) when a module holds DTensors,
  and every rank's ``set_*`` takes its own shard of them.
* Any other ``Stateful`` (``state_dict``/``load_state_dict``: a ``GradScaler``, an LR scheduler,
  :class:`~ckptio.RNGState`) is saved and restored through its own methods, at any depth: a scaler
  inside a dict part is treated like a top-level one.
* A ``Stateful`` with ``ckptio_per_rank = True`` (:class:`~ckptio.RNGState`) holds its process's own
  state: with more than one rank it is saved as ``{"rank<r>": state_dict}`` for every rank (``dcp``: each
  rank writes its entry; ``pt``/``fpk``: gathered onto rank 0) and each rank restores its own entry. A
  checkpoint of fewer ranks lacks some: a strict load names them all on every rank; ``strict=False``
  leaves those ranks' objects as they are. A single process saves the state dict as it is, and a
  checkpoint saved so restores the same state on every rank.
* Checkpoints written before (optimizer state keyed by index, a DDP model's keys with ``module.``)
  restore through ``load_state_dict`` as before.

:meth:`Parts.mismatch` tells what a restore would report as missing/unexpected without touching
anything, so a strict load can refuse before restoring any part.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from ..restore import LoadResult, apply, is_stateful

__all__ = ["Parts"]

_RANK_KEY = re.compile(r"rank\d+")


def _per_rank(obj: Any) -> bool:
    """A ``Stateful`` whose state is its process's own (``ckptio_per_rank = True``)."""
    return bool(getattr(obj, "ckptio_per_rank", False)) and is_stateful(obj)


def _by_rank(source: Any) -> bool:
    """``source`` is a per-rank entry as saved (``{"rank<r>": ...}``), not one rank's state dict."""
    return (
        isinstance(source, Mapping)
        and bool(source)
        and all(isinstance(k, str) and _RANK_KEY.fullmatch(k) for k in source)
    )


def _dtensor_type() -> type | None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch without DTensor
        return None
    return DTensor


def _holds_dtensors(module: torch.nn.Module) -> bool:
    dt = _dtensor_type()
    return dt is not None and any(isinstance(p, dt) for p in module.parameters())


def _is_ddp(module: torch.nn.Module) -> bool:
    return isinstance(module, torch.nn.parallel.DistributedDataParallel)


def _ddp_prefixed(module: torch.nn.Module, source: Mapping[str, Any]) -> bool:
    """A DDP module's state saved by ``ddp.state_dict()`` (keys with ``module.``), before torch's functions."""
    return _is_ddp(module) and any(str(x).startswith("module.") for x in source)


def _index_keyed(osd: Mapping[str, Any]) -> bool:
    """An optimizer state dict keyed by parameter index (``optim.state_dict()``), not by name."""
    state = osd.get("state") or {}
    groups = osd.get("param_groups") or []
    keys = list(state) + [p for g in groups if isinstance(g, Mapping) for p in g.get("params", [])]
    return all(isinstance(k, int) or (isinstance(k, str) and k.isdigit()) for k in keys)


def _int_keys(osd: Mapping[str, Any]) -> dict[str, Any]:
    """``osd`` with index keys as ints (DCP stores dict keys as str)."""
    out = dict(osd)
    if isinstance(out.get("state"), Mapping):
        out["state"] = {int(k) if isinstance(k, str) and k.isdigit() else k: v for k, v in out["state"].items()}
    return out


def _child(node: Any, key: Any) -> Any:
    return node.get(key) if isinstance(node, Mapping) else None


def _walk(obj: Any) -> Iterable[Any]:
    """Every module and optimizer in the state tree (not inside modules)."""
    if isinstance(obj, (torch.nn.Module, torch.optim.Optimizer)):
        yield obj
    elif isinstance(obj, Mapping):
        for v in obj.values():
            yield from _walk(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _walk(v)


class Parts:
    """The parts of one ``save``/``load`` call; ``files``: the checkpoint is one ``pt``/``fpk`` file
    (full tensors), else ``dcp`` (DTensor shards); ``group``: the Checkpointer's ranks (:class:`.group.Group`;
    None: one process)."""

    def __init__(self, state: Mapping[str, Any], files: bool, group: Any = None) -> None:
        self.state = state
        self.files = files
        self._group = group
        self.rank: int = 0 if group is None else group.rank
        self.world: int = 1 if group is None else group.world
        self._modules = [m for m in _walk(state) if isinstance(m, torch.nn.Module)]

    # ---- pairing and options -------------------------------------------------------------------
    def owner(self, optim: torch.optim.Optimizer) -> torch.nn.Module | None:
        """The module of the state that holds all of ``optim``'s parameters (the smallest such)."""
        wanted = {id(p) for g in optim.param_groups for p in g["params"]}
        found = None
        for m in self._modules:
            have = {id(p) for p in m.parameters()}
            if wanted <= have and (found is None or len(have) < found[1]):
                found = (m, len(have))
        return None if found is None else found[0]

    def _options(self, module: torch.nn.Module, **kw: Any) -> Any:
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        loading = kw.pop("loading", False)
        full = self.files and _holds_dtensors(module)
        if full and not loading:
            import torch.distributed as dist

            kw["cpu_offload"] = dist.is_initialized()  # gathered onto rank 0 only, which writes the file
        return StateDictOptions(full_state_dict=full, **kw)

    # ---- save ----------------------------------------------------------------------------------
    def state_dicts(self) -> dict[str, Any]:
        """The state with every module, optimizer and ``Stateful`` replaced by its state dict."""
        return {k: self._saved(v) for k, v in self.state.items()}

    def _saved(self, v: Any) -> Any:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        if isinstance(v, torch.nn.Module):
            return get_model_state_dict(v, options=self._options(v))
        if isinstance(v, torch.optim.Optimizer):
            m = self.owner(v)
            if m is None or not v.state:
                return v.state_dict()
            return get_optimizer_state_dict(m, v, options=self._options(m))
        if _per_rank(v) and self.world > 1:
            return self._every_rank(self._saved(v.state_dict()))
        if is_stateful(v):
            return self._saved(v.state_dict())
        if isinstance(v, Mapping):
            items = {k: self._saved(x) for k, x in v.items()}
            return v if all(items[k] is x for k, x in v.items()) else items
        if isinstance(v, (list, tuple)):
            seq = [self._saved(x) for x in v]
            if all(a is b for a, b in zip(seq, v, strict=True)):
                return v
            return seq if isinstance(v, list) else tuple(seq)
        return v

    def _every_rank(self, sd: Any) -> dict[str, Any]:
        """``{"rank<r>": sd}``: with ``dcp`` each rank writes its own entry; for a file rank 0 gathers all."""
        if not self.files:
            return {f"rank{self.rank}": sd}
        import torch.distributed as dist

        pg = self._group.pg
        gathered: list[Any] | None = [None] * self.world if self.rank == 0 else None
        dist.gather_object(sd, gathered, dst=dist.get_global_rank(pg, 0), group=pg)
        return {f"rank{r}": x for r, x in enumerate(gathered)} if gathered is not None else {f"rank{self.rank}": sd}

    def _own(self, source: Mapping[str, Any], prefix: str, res: LoadResult) -> Any:
        """This rank's entry of a per-rank ``source``; None (recorded as missing) when it has none."""
        key = f"rank{self.rank}"
        if key not in source:
            res.missing_keys.append(prefix + key)
            return None
        return source[key]

    def targets(self, names: Iterable[str]) -> dict[str, Any]:
        """The tensors a ``pt``/``fpk`` load may read straight into (:func:`ckptio.restore.load_into`), by
        part: a module's parameters and an optimizer's state tensors, by the names the file uses; nothing
        for DTensors (the file holds full tensors) or a fresh optimizer (nothing to fill)."""
        return {k: self._target(self.state[k]) for k in names}

    def _target(self, v: Any) -> Any:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        if isinstance(v, torch.nn.Module):
            return None if _holds_dtensors(v) else self._saved(v)
        if isinstance(v, torch.optim.Optimizer):
            m = self.owner(v)
            if m is None or not v.state or _holds_dtensors(m):
                return None
            return get_optimizer_state_dict(m, v)
        if _per_rank(v):
            return None  # the file holds every rank's entry
        if is_stateful(v):
            return self._target(v.state_dict())
        if isinstance(v, Mapping):
            return {k: self._target(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [self._target(x) for x in v]
        return v

    # ---- load templates (dcp) ------------------------------------------------------------------
    def templates(self, names: Iterable[str], stored: Mapping[str, Any]) -> dict[str, Any]:
        """The state dicts a DCP load fills in place: a fresh optimizer's state initialized (torch's
        function) when the checkpoint holds its state by parameter name. ``stored``: the checkpoint's
        entries as nested dicts (keys only)."""
        return {k: self._template(self.state[k], _child(stored, k)) for k in names}

    def _template(self, v: Any, stored: Any) -> Any:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        if isinstance(v, torch.nn.Module):
            if isinstance(stored, Mapping) and _ddp_prefixed(v, stored):
                return v.state_dict()  # written before ckptio used torch's functions: keys with module.
            return self._saved(v)
        if isinstance(v, torch.optim.Optimizer):
            m = self.owner(v)
            named = isinstance(stored, Mapping) and not _index_keyed(stored)
            if m is None or not named or not _child(stored, "state"):
                return v.state_dict()
            return get_optimizer_state_dict(m, v, options=self._options(m))  # initializes a fresh one
        if _per_rank(v) and _by_rank(stored):  # only this rank's entry is read
            key = f"rank{self.rank}"
            return {key: self._template(v.state_dict(), stored[key])} if key in stored else {}
        if is_stateful(v):
            return self._template(v.state_dict(), stored)
        if isinstance(v, Mapping):
            return {k: self._template(x, _child(stored, k)) for k, x in v.items()}
        if isinstance(v, list):
            return [self._template(x, _child(stored, i)) for i, x in enumerate(v)]
        return v

    # ---- restore -------------------------------------------------------------------------------
    def restore(self, k: str, source: Any, res: LoadResult) -> Any:
        """Restore part ``k`` from ``source`` in place; returns the value to keep under ``k``."""
        return apply(self.state[k], source, f"{k}.", res, self._restore_stateful)

    def _restore_stateful(self, target: Any, source: Any, prefix: str, res: LoadResult) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        if isinstance(target, torch.nn.Module):
            if not isinstance(source, Mapping):
                raise TypeError(f"{prefix[:-1]}: the checkpoint holds a {type(source).__name__}, not a module's state")
            if _ddp_prefixed(target, source):
                out = target.load_state_dict(source, strict=False)  # saved with the DDP prefix
            else:
                out = set_model_state_dict(
                    target, dict(source), options=self._options(target, strict=False, loading=True)
                )
            res.missing_keys += [prefix + x for x in out.missing_keys]
            res.unexpected_keys += [prefix + x for x in out.unexpected_keys]
        elif isinstance(target, torch.optim.Optimizer):
            if not isinstance(source, Mapping):
                raise TypeError(
                    f"{prefix[:-1]}: the checkpoint holds a {type(source).__name__}, not an optimizer's state"
                )
            if _index_keyed(source):
                target.load_state_dict(_int_keys(source))
                return
            m = self.owner(target)
            if m is None:
                raise ValueError(
                    f"{prefix[:-1]}: the checkpoint holds optimizer state by parameter name, but no module in the "
                    f"state given to load() holds all of this optimizer's parameters; pass the model in the same state"
                )
            set_optimizer_state_dict(m, target, dict(source), options=self._options(m, loading=True))
        elif _per_rank(target) and (_by_rank(source) or source == {}):  # {}: dcp read no entry for this rank
            own = self._own(source, prefix, res)
            if own is not None:
                target.load_state_dict(own)
        else:
            target.load_state_dict(source)

    # ---- what a restore would report -----------------------------------------------------------
    def mismatch(self, k: str, source: Any) -> tuple[list[str], list[str]]:
        """(missing, unexpected) keys restoring part ``k`` from ``source`` would report; touches nothing.
        ``source`` may be a skeleton (leaves of any type): only its keys are compared."""
        missing: list[str] = []
        unexpected: list[str] = []
        self._diff(self.state[k], source, f"{k}.", missing, unexpected)
        return missing, unexpected

    def _diff(self, target: Any, source: Any, prefix: str, missing: list[str], unexpected: list[str]) -> None:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        if isinstance(target, torch.nn.Module) and isinstance(source, Mapping):
            have = set(target.state_dict() if _ddp_prefixed(target, source) else get_model_state_dict(target))
            missing += [prefix + x for x in have if x not in source]
            unexpected += [prefix + str(x) for x in source if x not in have]
        elif _per_rank(target) and _by_rank(source):  # the same answer on every rank: all raise or none
            missing += [f"{prefix}rank{r}" for r in range(self.world) if f"rank{r}" not in source]
        elif isinstance(target, torch.optim.Optimizer) or is_stateful(target):
            return  # their own load_state_dict decides
        elif isinstance(target, dict) and isinstance(source, Mapping):
            for x in target:
                if x not in source:
                    missing.append(f"{prefix}{x}")
                else:
                    self._diff(target[x], source[x], f"{prefix}{x}.", missing, unexpected)
            unexpected += [f"{prefix}{x}" for x in source if x not in target]

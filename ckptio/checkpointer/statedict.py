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

:meth:`Parts.verify` checks a checkpoint against the state before a load reads into or restores anything:
a strict load that does not match, tensors of other shapes and an optimizer that cannot be matched are
refused with nothing touched. An optimizer is matched by parameter name (:mod:`.matching`), so a
``strict=False`` load restores the state of the parameters both hold.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from ..errors import StateMismatchError
from ..restore import LoadResult, apply, is_stateful
from . import matching
from .matching import NO_OWNER, Diff, index_keyed, int_keys

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


def _live(module: torch.nn.Module, source: Mapping[str, Any]) -> dict[str, Any]:
    """``module``'s state dict by the names ``source`` (a checkpoint's) uses for it."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    if _ddp_prefixed(module, source) or not _has_tensors(module):  # torch's function refuses an empty module
        return module.state_dict()
    return get_model_state_dict(module)


def _has_tensors(module: torch.nn.Module) -> bool:
    return any(True for _ in module.parameters()) or any(True for _ in module.buffers())


def _child(node: Any, key: Any) -> Any:
    if isinstance(node, list) and isinstance(key, int):
        return node[key] if 0 <= key < len(node) else None
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
        self._held: dict[int, Any] = {}  # optimizer id -> its state before the load (:meth:`verify`)

    def optimizers(self, names: Iterable[str]) -> bool:
        """Whether the parts ``names`` hold an optimizer (:meth:`verify` then compares its groups)."""
        return any(isinstance(x, torch.optim.Optimizer) for k in names for x in _walk(self.state[k]))

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
            named = isinstance(stored, Mapping) and not index_keyed(stored)
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
        if isinstance(v, (list, tuple)):
            return [self._template(x, _child(stored, i)) for i, x in enumerate(v)]
        return v

    # ---- restore -------------------------------------------------------------------------------
    def restore(self, k: str, source: Any, res: LoadResult) -> Any:
        """Restore part ``k`` from ``source`` in place; returns the value to keep under ``k``."""
        return apply(self.state[k], source, f"{k}.", res, self._restore_stateful)

    def _restore_stateful(self, target: Any, source: Any, prefix: str, res: LoadResult) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        if isinstance(target, torch.nn.Module):
            if not isinstance(source, Mapping):
                raise TypeError(f"{prefix[:-1]}: the checkpoint holds a {type(source).__name__}, not a module's state")
            have = _live(target, source)  # what torch reports misses a file's keys under FSDP2 (full state dicts)
            if _ddp_prefixed(target, source):
                target.load_state_dict(source, strict=False)  # saved with the DDP prefix
            else:
                set_model_state_dict(target, dict(source), options=self._options(target, strict=False, loading=True))
            res.missing_keys += [prefix + x for x in have if x not in source]
            res.unexpected_keys += [prefix + str(x) for x in source if x not in have]
        elif isinstance(target, torch.optim.Optimizer):
            if not isinstance(source, Mapping):
                raise TypeError(
                    f"{prefix[:-1]}: the checkpoint holds a {type(source).__name__}, not an optimizer's state"
                )
            if index_keyed(source):
                target.load_state_dict(int_keys(source))
                return
            m = self.owner(target)
            if m is None:
                raise ValueError(f"{prefix[:-1]}: {NO_OWNER}")
            found = matching.match(matching.names(m, target), source, prefix)
            before = self._held.get(id(target))
            before = matching.held(target) if before is None else before
            matching.restore(m, target, source, found, before, self._options(m, loading=True, strict=False))
            res.missing_keys += found.missing
            res.unexpected_keys += found.unexpected
        elif _per_rank(target) and (_by_rank(source) or source == {}):  # {}: dcp read no entry for this rank
            own = self._own(source, prefix, res)
            if own is not None:
                target.load_state_dict(own)
        else:
            target.load_state_dict(source)

    # ---- checked before anything is read or restored -----------------------------------------------
    def verify(self, names: Iterable[str], tree: Mapping[str, Any], strict: bool, extra: list[str], what: str) -> None:
        """Check the checkpoint's parts ``tree`` (a tensor may stand as anything with its ``shape``: a meta
        tensor, fastpickle's ``TensorInfo``) against the parts ``names`` of the state, before a load reads
        into or restores anything. Raises
        :class:`StateMismatchError` for what cannot be restored (tensors of other shapes, an optimizer that
        cannot be matched), ``KeyError`` for a strict load that does not match (every missing and unexpected
        key; ``extra``: the checkpoint's parts the state lacks); keeps each optimizer's state for the restore
        (:func:`.matching.held`). ``what`` names the checkpoint and step in the messages."""
        d = Diff()
        for k in names:
            if k in tree:
                self._diff(self.state[k], tree[k], f"{k}.", d)
            else:
                d.missing.append(k)
        d.unexpected += extra
        keys = f"missing keys {d.missing}, unexpected keys {d.unexpected}"
        if d.problems:
            raise StateMismatchError(
                f"{what} cannot be restored into the state: {'; '.join(d.problems)}; nothing was restored "
                f"({keys}; keys= or exclude= choose the parts to restore)"
            )
        if strict and (d.missing or d.unexpected):
            raise KeyError(
                f"{what} does not match the state: {keys}; nothing was restored (pass strict=False to restore "
                f"what matches, keys= or exclude= to choose the parts)"
            )

    def _diff(self, target: Any, source: Any, prefix: str, d: Diff) -> None:
        if isinstance(target, torch.nn.Module) and isinstance(source, Mapping):
            have = _live(target, source)
            d.missing += [prefix + x for x in have if x not in source]
            d.unexpected += [prefix + str(x) for x in source if x not in have]
            d.shapes(prefix, target, have, source)
        elif isinstance(target, torch.optim.Optimizer):
            self._held[id(target)] = matching.held(target)
            d.optimizer(target, source, prefix, self.owner(target))
        elif isinstance(target, torch.nn.Module):
            d.problems.append(f"{prefix[:-1]}: the checkpoint holds a {type(source).__name__}, not a module's state")
        elif _per_rank(target) and _by_rank(source):  # the same answer on every rank: all raise or none
            d.missing += [f"{prefix}rank{r}" for r in range(self.world) if f"rank{r}" not in source]
        elif is_stateful(target):
            return  # its own load_state_dict decides
        elif isinstance(target, dict) and isinstance(source, Mapping):
            for x in target:
                if x not in source:
                    d.missing.append(f"{prefix}{x}")
                else:
                    self._diff(target[x], source[x], f"{prefix}{x}.", d)
            d.unexpected += [f"{prefix}{x}" for x in source if x not in target]
        elif isinstance(target, (list, tuple)) and isinstance(source, (list, tuple)) and len(target) == len(source):
            for i, (x, y) in enumerate(zip(target, source, strict=True)):
                self._diff(x, y, f"{prefix}{i}.", d)

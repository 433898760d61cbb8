"""Restoring a loaded checkpoint into objects that already exist: :func:`load_into` and the rules
(:func:`apply`) the Checkpointer uses too.

The rules: a ``Stateful`` object (``state_dict``/``load_state_dict``: modules, optimizers) gets
``load_state_dict`` (modules with ``strict=False``, their missing/unexpected keys reported); a tensor
of the same shape and dtype is copied into in place; a dict is restored entry by entry; anything
else is replaced by the loaded value. What did not match is recorded in a :class:`LoadResult`.

:func:`load_into` goes further for formats that can (``.fpk``: ``Format.loads_into``): a stored tensor
whose target is a CPU tensor of the same dtype and shape is read straight into the target's memory
(a ``preadv`` locally, ranged reads from object stores), so restoring a 1 GiB model needs no second
1 GiB of fresh buffers and no copy; the rules above then see the target itself and copy nothing.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["LoadResult", "apply", "is_stateful", "load_into"]


@dataclass
class LoadResult:
    """What a restore did (``Checkpointer.last_load``, :func:`load_into`'s result)."""

    step: int | None
    uri: str | None
    missing_keys: list[str] = field(default_factory=list)
    unexpected_keys: list[str] = field(default_factory=list)


def is_stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def apply(
    target: Any,
    source: Any,
    prefix: str,
    res: LoadResult,
    stateful: Callable[[Any, Any, str, LoadResult], None] | None = None,
) -> Any:
    """Restore ``source`` into ``target`` in place where possible; returns the value to store.
    ``stateful(target, source, prefix, res)``: restores a ``Stateful`` target, at any depth, instead of
    the rules above (the Checkpointer's, :mod:`ckptio.checkpointer.statedict`)."""
    if is_stateful(target):
        if stateful is not None:
            stateful(target, source, prefix, res)
        elif isinstance(target, torch.nn.Module):
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
                target.copy_(source)  # a view of the same memory (read in place): no copy
            return target
        return source
    if isinstance(target, (list, tuple)) and isinstance(source, (list, tuple)) and len(target) == len(source):
        pairs = enumerate(zip(target, source, strict=True))  # e.g. a list or tuple of optimizers: each in place
        items = [apply(t, x, f"{prefix}{i}.", res, stateful) for i, (t, x) in pairs]
        if isinstance(target, list):
            target[:] = items
        elif any(a is not b for a, b in zip(items, target, strict=True)):  # a tuple of values: the stored ones
            return tuple(items) if type(target) is tuple else source
        return target
    if isinstance(target, dict) and isinstance(source, Mapping):
        for k in list(target):
            if k not in source:
                res.missing_keys.append(f"{prefix}{k}")
            else:
                target[k] = apply(target[k], source[k], f"{prefix}{k}.", res, stateful)
        for k in source:
            if k not in target:
                res.unexpected_keys.append(f"{prefix}{k}")
                target[k] = source[k]
        return target
    return source


def targets(obj: Any) -> Any:
    """``obj`` as a tree of the tensors a load may fill: ``Stateful`` objects by their ``state_dict()``
    (a module's holds views of its parameters, an optimizer's its state tensors), containers as they are."""
    if is_stateful(obj):
        return targets(obj.state_dict())
    if isinstance(obj, Mapping):
        return {k: targets(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [targets(v) for v in obj]
    return obj


def load_into(
    target: Any, file: Any, file_format: str | None = None, *, strict: bool = True, **kwargs: Any
) -> LoadResult:
    """Load the checkpoint ``file`` (a URI or path; format by extension) into ``target`` in place.

    ``target``: a module, optimizer or other ``Stateful``, or a dict (nested) of them, tensors and values,
    shaped like what was saved. Tensors restore into the target's own tensors; for ``.fpk`` files a stored
    tensor whose target is a contiguous CPU tensor of the same dtype and shape is read straight into its
    memory, checksums verified as usual. Other values replace the target's entries (dicts) or go through
    ``load_state_dict``. ``strict=True`` raises ``KeyError`` naming the keys when the checkpoint and
    ``target`` do not match (after restoring what matches); ``strict=False`` only reports them in the
    result. Other keywords go to :func:`ckptio.load` (``backend_args``, ``cache``, ``map_location``,
    ``verify``, ``allow_pickle`` ...).

    If the load fails (a damaged file: :class:`~ckptio.errors.IntegrityError`), tensors read in place may
    already hold some of the file's bytes: load again or restore from another checkpoint.
    """
    from .formats.base import check_keywords
    from .io import _format_for
    from .io import load as _load

    if "keys" in kwargs or "mmap" in kwargs:
        raise TypeError("load_into() restores the whole checkpoint: keys= and mmap= are for ckptio.load")
    uri = os.fspath(file)
    fmt = _format_for(uri, file_format)
    check_keywords(fmt, "load", kwargs, load_into, uri, via=_load)
    if fmt.loads_into:
        kwargs["into"] = targets(target)
    source = _load(uri, file_format, **kwargs)
    res = LoadResult(None, uri)
    apply(target, source, "", res)
    if strict and (res.missing_keys or res.unexpected_keys):
        raise KeyError(
            f"{uri} does not match the target: missing keys {res.missing_keys}, unexpected keys "
            f"{res.unexpected_keys} (pass strict=False to restore what matches)"
        )
    return res

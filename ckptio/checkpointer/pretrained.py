"""Init from a checkpoint: restore one model (for evaluation, fine-tuning, an FSDP2 model) from any URI.

:func:`load_model` reads only the model's part: no optimizer, no step pointer, nothing written. The URI
may name anything :func:`.sources.resolve` finds: a Checkpointer root (its latest step) or step
directory, a bare DCP directory, a ``.pt``/``.pth``/``.fpk`` file, a DINOv3 or Cosmos root. A module
restores as in :meth:`Checkpointer.load <ckptio.checkpointer.Checkpointer.load>`: plain, DDP or FSDP2
(DCP shards read straight into each rank's DTensor shards; a file's full tensors, each rank taking its
shard), through torch's ``set_model_state_dict``.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from .. import uri as _uri
from ..errors import FormatError
from ..restore import LoadResult
from .group import Group
from .manifest import _FILE_FORMAT
from .sources import resolve
from .statedict import Parts


def load_model(
    model: torch.nn.Module,
    uri: str | os.PathLike,
    *,
    key: str | None = "model",
    strict: bool = True,
    cache: Any = None,
    allow_pickle: bool = False,
    process_group: Any = None,
    timeout: float = 600.0,
) -> int:
    """Restore ``model`` in place from the checkpoint ``uri`` names; returns that checkpoint's step.

    ``key``: the part holding the model (``"model"`` for a Checkpointer's, DINOv3's and Cosmos's
    checkpoints; ``"teacher"`` for DINOv3's ``teacher_checkpoint.pth``); ``None``: the whole file is
    the model's state dict (``torch.save(model.state_dict(), path)``). Only that part's bytes are
    read. ``strict=True`` raises ``KeyError`` naming every missing and unexpected key before anything
    is restored; tensors of other shapes raise :class:`~ckptio.errors.StateMismatchError` (a RuntimeError)
    naming the checkpoint, its step, the keys and both shapes, with nothing restored, whatever ``strict``.
    Every rank of ``process_group`` (default: all, when ``torch.distributed`` is initialized) calls it.
    ``cache``/``allow_pickle``: as for :meth:`Checkpointer.load`.
    """
    if key is None:
        return _load_whole(model, uri, strict, cache, allow_pickle, Group(process_group, timeout))
    from .core import Checkpointer

    # never tiered (a settings default would make a tier for uri) nor sweeping: nothing is written
    ck = Checkpointer(uri, process_group=process_group, timeout=timeout, stale_after=None, local_tier=False)
    try:
        step = ck.load({key: model}, step=uri, keys=[key], strict=strict, cache=cache, allow_pickle=allow_pickle)
    finally:
        ck.close()
    assert step is not None  # a URI always resolves, or raises
    return step


def _load_whole(model: torch.nn.Module, uri: Any, strict: bool, cache: Any, allow_pickle: bool, group: Group) -> int:
    from ..io import load

    t = group.on_rank0(resolve, uri)
    if t.fmt not in _FILE_FORMAT:
        raise FormatError(
            f"{os.fspath(uri)}: key=None reads a file holding a state dict; this is a {t.fmt!r} checkpoint, "
            f"pass key= (the part holding the model)"
        )
    f = _uri.join_path(t.uri, t.name)
    kw: dict[str, Any] = {"cache": cache} if cache is not None else {}
    if t.fmt == "pt":
        kw.update(weights_only=not allow_pickle, map_location="cpu")
    elif allow_pickle:
        kw["allow_pickle"] = True
    sd = load(f, file_format=_FILE_FORMAT[t.fmt], **kw)
    if not isinstance(sd, dict):
        raise FormatError(f"{f}: holds a {type(sd).__name__}, not a state dict")
    parts = Parts({"model": model}, files=True)
    parts.verify(["model"], {"model": sd}, strict, [], f"{f} (step {t.step})")
    parts.restore("model", sd, LoadResult(t.step, f))
    return t.step

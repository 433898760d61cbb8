"""Lightning ``CheckpointIO`` plug-ins that save and load through ckptio, on any URI ckptio reaches.

``Trainer(plugins=[CkptioCheckpointIO()])`` (or :class:`CkptioAsyncCheckpointIO`): the checkpoints
``ModelCheckpoint`` and ``trainer.save_checkpoint`` write go through :func:`ckptio.dump`, and
``trainer.fit(ckpt_path=...)`` reads through :func:`ckptio.load`. The format follows the path's
extension: ``.fpk`` (``ModelCheckpoint.FILE_EXTENSION = ".fpk"``) or ``.pt``; Lightning's ``.ckpt``
is written as ``torch.save`` writes it, so Lightning's own tools still read it.

Works with either package name: ``pytorch-lightning`` (``pytorch_lightning``, ``lightning_fabric``)
and ``lightning`` (``lightning.pytorch``): the classes subclass the ``CheckpointIO`` of each one
installed. Install with ``pip install 'ckptio[lightning]'``.

Contract:

* A save is atomic (the object appears complete or not at all), as every ckptio write.
* Loads run no code by default (``.pt``: ``torch.load(weights_only=True)``; ``.fpk``: no pickles).
  ``trainer.fit(..., weights_only=False)`` allows pickled objects, for checkpoints you trust
  (Lightning itself defaults to ``weights_only=False`` for remote paths; ckptio does not).
* :class:`CkptioAsyncCheckpointIO`: ``save_checkpoint`` copies the tensors into staging buffers reused
  between saves (the Checkpointer's ``async_save`` staging), returns, and a background thread
  writes. One save is in flight at most: the next save, a load, a removal and ``teardown`` first wait
  for it and raise its error, so ``ModelCheckpoint`` never removes an older checkpoint before the newer
  one is stored (Lightning's ``AsyncCheckpointIO`` removes it while the save may still fail).
"""

from __future__ import annotations

import importlib
import os
from typing import Any

from .. import io as _io
from ..checkpointer.staging import Background, _Stager
from ..errors import MissingDependencyError

__all__ = ["CkptioAsyncCheckpointIO", "CkptioCheckpointIO"]

# (module, name) of CheckpointIO in each Lightning distribution: pytorch-lightning, lightning
_BASES = (
    ("lightning_fabric.plugins.io.checkpoint_io", "CheckpointIO"),
    ("lightning.fabric.plugins.io", "CheckpointIO"),
)


def _bases() -> tuple[type, ...]:
    found = []
    for module, name in _BASES:
        try:
            found.append(getattr(importlib.import_module(module), name))
        except ImportError:
            continue
    if not found:
        raise MissingDependencyError(
            "ckptio.integrations.lightning needs Lightning: pip install 'ckptio[lightning]' "
            "(or pytorch-lightning / lightning)"
        )
    return tuple(found)


class CkptioCheckpointIO(*_bases()):  # type: ignore[misc]  # Lightning's CheckpointIO, of each package installed
    """Saves and loads Lightning checkpoints through ckptio. ``backend_args`` go to every call
    (e.g. ``{"endpoint_url": ...}``); ``dump_args`` to every :func:`ckptio.dump`."""

    def __init__(self, backend_args: dict[str, Any] | None = None, **dump_args: Any) -> None:
        super().__init__()
        self.backend_args = backend_args
        self.dump_args = dump_args

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        """``storage_options`` (``trainer.save_checkpoint(..., storage_options=)``): :func:`ckptio.dump` keywords."""
        kw = {**self.dump_args, **(storage_options or {})}
        _io.dump(checkpoint, os.fspath(path), backend_args=self.backend_args, **kw)

    def load_checkpoint(self, path: Any, map_location: Any = "cpu", weights_only: bool | None = None) -> Any:
        """Tensors on the CPU unless ``map_location`` says otherwise, as Lightning's own loader."""
        self._settle()
        return _io.load(
            os.fspath(path),
            backend_args=self.backend_args,
            map_location=map_location,
            allow_pickle=weights_only is False,
        )

    def remove_checkpoint(self, path: Any) -> None:
        self._settle()
        uri = os.fspath(path)
        if _io.exists(uri, backend_args=self.backend_args):
            _io.remove(uri, backend_args=self.backend_args)

    def _settle(self) -> None:
        """Nothing to wait for: every save has completed when it returns."""


class CkptioAsyncCheckpointIO(CkptioCheckpointIO):
    """:class:`CkptioCheckpointIO` whose saves write in a background thread, from staged copies."""

    def __init__(self, backend_args: dict[str, Any] | None = None, **dump_args: Any) -> None:
        super().__init__(backend_args, **dump_args)
        self._stager = _Stager()
        self._background = Background()

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        self._settle()  # the previous save's error, if any, and its staging buffers free again
        staged = self._stager.stage(checkpoint)
        save = super().save_checkpoint
        self._background.submit(os.fspath(path), None, save, staged, path, storage_options)

    def _settle(self) -> None:
        self._background.wait()

    def teardown(self) -> None:
        """Wait for the save in flight (raising its error) and stop the thread."""
        self._background.close()

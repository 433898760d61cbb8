"""``torch.save`` files (``.pt``, ``.pth``, ``.ckpt``, ``.pth.tar``).

Loads default to ``weights_only=True`` (no code execution); pass ``weights_only=False`` only for
files you trust. Local files are loaded from their path, so ``mmap=True`` works.
"""

from __future__ import annotations

from typing import IO, Any

from ..backends.base import Backend
from ..backends.local import LocalBackend, local_path
from .base import StreamFormat


class TorchFormat(StreamFormat):
    def dump_file(self, obj: Any, f: IO, **kw: Any) -> None:
        import torch

        torch.save(obj, f, **kw)

    def load_file(self, f: IO, **kw: Any) -> Any:
        import torch

        kw.setdefault("weights_only", True)
        return torch.load(f, **kw)

    def load(self, backend: Backend, uri: str, **kw: Any) -> Any:
        if isinstance(backend, LocalBackend):
            import torch

            kw.setdefault("weights_only", True)
            backend.stat(uri)  # FileNotFoundError naming the URI
            return torch.load(local_path(uri), **kw)
        return super().load(backend, uri, **kw)

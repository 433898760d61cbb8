"""``torch.save`` files (``.pt``, ``.pth``, ``.ckpt``, ``.pth.tar``).

Loads default to ``weights_only=True`` (no code execution); pass ``weights_only=False`` (or
``allow_pickle=True``, the name the other formats use) only for files you trust. Loads go through
``backend.get_local_path``: a local (or node-cached) file is read in place, a remote object is first
fetched with parallel ranged reads into a temporary file (torch's zip reader over a remote stream
would issue one small sequential request per record). ``mmap=True`` works everywhere; the mapping
outlives the temporary file.
"""

from __future__ import annotations

from typing import IO, Any

from ..backends.base import Backend
from .base import StreamFormat


class TorchFormat(StreamFormat):
    def dump_file(self, obj: Any, f: IO, **kw: Any) -> None:
        import torch

        try:
            torch.save(obj, f, **kw)
        except RuntimeError as e:  # torch's zip writer hides a failed write (disk full...) behind its own error
            err = e.__context__
            if isinstance(err, OSError):
                raise err from e
            raise

    def load_file(self, f: IO, **kw: Any) -> Any:
        import torch

        kw.setdefault("weights_only", not kw.pop("allow_pickle", False))
        return torch.load(f, **kw)

    def load(self, backend: Backend, uri: str, **kw: Any) -> Any:
        import torch

        kw.setdefault("weights_only", not kw.pop("allow_pickle", False))
        with backend.get_local_path(uri) as path:
            return torch.load(path, **kw)

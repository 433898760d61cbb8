"""``torch.save`` / ``torch.load`` through file objects, with the caller's exception kept.

torch's C++ serializer calls a Python file's methods and does not let their exception through as it
came: a read error is swallowed and ``torch.load`` fails later with its own ("read of closed file");
after a write error (Ctrl-C, disk full, a store's error) ``torch.save`` closes the archive in a
``finally``, and that raises ``RuntimeError`` ("enforce fail at inline_container.cc") in its place.
:class:`ErrorKeepingReader` records the first; :func:`save` raises the write's own exception.
"""

from __future__ import annotations

import sys
from typing import Any

from ..backends.readers import RangeReader


class ErrorKeepingReader(RangeReader):
    """A reader whose read errors survive ``torch.load`` (:attr:`error`: the first one)."""

    error: BaseException | None = None

    def readinto(self, b: Any) -> int:
        try:
            return super().readinto(b)
        except BaseException as e:
            self.error = self.error or e
            raise


def save(obj: Any, f: Any, **kw: Any) -> None:
    """``torch.save(obj, f, **kw)``; what a write raised (a ``KeyboardInterrupt`` wherever it landed in
    it, an ``OSError``, a ckptio error) leaves as itself, not as the ``RuntimeError`` torch's closing
    of the archive raises in its context (``[enforce fail at inline_container.cc]``)."""
    import torch

    active = sys.exc_info()[1]  # an exception the caller is handling: the context of any error, not this save's
    try:
        torch.save(obj, f, **kw)
    except RuntimeError as e:
        context = None if e.__suppress_context__ else e.__context__
        # only the archive's closing error stands for the write's; a RuntimeError the pickled objects
        # raised while handling an exception (their own, or the caller's) is theirs to raise
        if context is None or context is active or "inline_container" not in str(e):
            raise
        raise context from None

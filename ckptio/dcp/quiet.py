"""Skip torch's DCP log records while ckptio calls torch's DCP API, when nothing would receive them.

torch wraps each step of ``dcp.save``/``load`` (planning, each storage call, the commit) in a logger
that sends a "start" and an "end" record to its DCP logger: 36 records per save. That logger is at
DEBUG, has only a ``NullHandler`` and does not propagate, so every record is built and dropped.
:func:`quiet_dcp_log` disables it for the length of a call (``Logger.disabled``: checked before a
record is built, and unlike ``setLevel`` it does not clear the level cache of every logger), and
leaves it alone when its records go somewhere (a handler that is not a ``NullHandler``, or
propagation to the root logger), so a user who collects them still gets every one (a handler added
while a call runs receives records from the next call on). Nested and concurrent calls share one
switch: it is turned back when the last of them returns.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from typing import Any

_lock = threading.Lock()
_depth = 0
_switched = False  # whether this module disabled the logger (and must enable it again)


def _dcp_logger() -> logging.Logger | None:
    from .. import torch_internals

    try:
        lg: Any = torch_internals.dcp_logger
    except AttributeError:  # a torch without it: nothing to skip (tests/test_torch_internals.py names it)
        return None
    return lg if isinstance(lg, logging.Logger) else None


def _drops_everything(lg: logging.Logger) -> bool:
    """Every record ``lg`` builds is dropped: no receiver but NullHandlers, no propagation."""
    return not lg.disabled and not lg.propagate and all(type(h) is logging.NullHandler for h in lg.handlers)


@contextlib.contextmanager
def quiet_dcp_log() -> Iterator[None]:
    """For the length of the ``with`` block, torch's DCP log records are not built when they would be dropped."""
    global _depth, _switched
    lg = _dcp_logger()
    if lg is None:
        yield
        return
    with _lock:
        if _depth == 0 and _drops_everything(lg):
            lg.disabled = _switched = True
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _switched:
                lg.disabled = _switched = False

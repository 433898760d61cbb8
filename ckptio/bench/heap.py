"""Hand freed heap memory back to the OS between benchmark cases.

glibc keeps memory that a case freed and gives it to the next allocation, so without this a load
runs into fresh or into recycled memory depending on which case ran before it (torch.load of 1 GiB
measured 75 ms right after a fastpickle load and 490 ms otherwise). A no-op without glibc.
"""

from __future__ import annotations

import ctypes
import gc
from typing import Any

try:
    _libc: Any = ctypes.CDLL("libc.so.6")
    _libc.malloc_trim.argtypes = [ctypes.c_size_t]
except (OSError, AttributeError):  # not glibc
    _libc = None


def trim_heap() -> None:
    """Collect garbage, then return every free heap page to the OS (``malloc_trim(0)``)."""
    gc.collect()
    if _libc is not None:
        _libc.malloc_trim(0)

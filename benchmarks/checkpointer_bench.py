"""Checkpointer async save: blocking time, idle and with the cores busy, and training slowdown.
The code is :mod:`ckptio.bench.checkpointer`
(``python -m benchmarks.checkpointer_bench --help``); see benchmarks/README.md."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from ckptio.bench.checkpointer import main

if __name__ == "__main__":
    main()

"""The node-local cache and ckptio.distributed against the loads they replace. The code is :mod:`ckptio.bench.cache`
(``python -m benchmarks.cache_bench --help``); see benchmarks/README.md."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from ckptio.bench.cache import main

if __name__ == "__main__":
    main()

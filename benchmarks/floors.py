"""The floors under the cells where ckptio stays below the simplest baseline. The code is :mod:`ckptio.bench.floors`
(``python -m benchmarks.floors --help``); see benchmarks/README.md."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from ckptio.bench.floors import main

if __name__ == "__main__":
    main()

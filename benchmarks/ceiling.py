"""The ceiling of the benchmark's S3 server: what a client that does no work can move through it. The code is
:mod:`ckptio.bench.ceiling` (``python -m benchmarks.ceiling --help``); see benchmarks/README.md."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from ckptio.bench.ceiling import main

if __name__ == "__main__":
    sys.exit(main())

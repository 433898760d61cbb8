"""Tiered checkpoints (issue 17): blocking time of a tiered save vs a local-root save and today's async
save; restore on the same node vs a local restore, on a fresh node vs a remote restore (moto S3).
The logic is :mod:`ckptio.bench.tiered`.

    python benchmarks/tiered_bench.py [--size 256] [--repeats 3] [--format fpk]
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from ckptio.bench.tiered import main

if __name__ == "__main__":
    sys.exit(main())

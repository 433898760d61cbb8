"""Incremental checkpoints, workload F (~90% frozen): five saves, incremental vs not, local (fsync)
and S3 (moto); bytes written per save and time ratios. The logic is :mod:`ckptio.bench.incremental`.

    python benchmarks/incremental_bench.py [--size 1024] [--repeats 3] [--format fpk] [--targets local,s3]

Targets (issue 16): saves 2-5 write <= 12% of the logical bytes, >= 5x faster on S3, >= 3x locally.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from ckptio.bench.incremental import main

if __name__ == "__main__":
    sys.exit(main())

"""Incremental checkpoints, workloads F (~90% frozen) and W1 (all new): five saves and a restore,
incremental vs not, local (fsync) and S3 (moto); bytes written per save and time ratios. The logic
is :mod:`ckptio.bench.incremental`.

    python benchmarks/incremental_bench.py [--size 1024] [--s3-size 256] [--repeats 3] [--format fpk|pt|dcp]
        [--targets local,s3] [--workload F|W1] [--restores N] [--cold N]

``--restores N`` (local, fpk) and ``--cold N`` (local): more restores of the last repeat's two step-5
checkpoints, from the page cache or with it dropped first (see :mod:`ckptio.bench.incremental`).

Targets (issue 16): F: saves 2-5 write <= 12% of the logical bytes, >= 5x faster on S3, >= 3x locally;
W1: incremental saves <= 1.1x the time of non-incremental ones; restores of step 5 no slower.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from ckptio.bench.incremental import main

if __name__ == "__main__":
    sys.exit(main())

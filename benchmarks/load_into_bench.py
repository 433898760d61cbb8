"""Loading into existing tensors: ``ckptio.load_into`` vs a raw preadv into the same tensors, and vs
load + copy (issue 14, goal 3). The logic is :mod:`ckptio.bench.load_into`.

    python benchmarks/load_into_bench.py [--mib 1024] [--repeats 5] [--s3] [--s3-mib 256]
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from ckptio.bench.load_into import main

if __name__ == "__main__":
    sys.exit(main())

"""``python -m benchmarks.throughput``: the throughput benchmark from a source checkout, results in
benchmarks/results/. The code is :mod:`ckptio.bench` (also ``ckptio bench``); see benchmarks/README.md."""

from __future__ import annotations

import os
import sys

from ckptio.bench.throughput import main as _main

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def main(argv: list[str] | None = None) -> int:
    return _main(argv, default_out=RESULTS)


if __name__ == "__main__":
    sys.exit(main())

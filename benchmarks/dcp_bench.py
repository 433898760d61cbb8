"""ckptio.dcp against torch's DCP storage layers, local and S3 (moto). The code is :mod:`ckptio.bench.dcp`
(``python -m benchmarks.dcp_bench --help``); see benchmarks/README.md."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from ckptio.bench.dcp import main

if __name__ == "__main__":
    main()

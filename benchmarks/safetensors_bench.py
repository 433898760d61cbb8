"""ckptio's safetensors format against the safetensors package, local and S3.
The code is :mod:`ckptio.bench.safetensors`
(``python -m benchmarks.safetensors_bench --help``); see benchmarks/README.md."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from ckptio.bench.safetensors import main

if __name__ == "__main__":
    main()

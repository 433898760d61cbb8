"""fastpickle against torch.save/load, safetensors and raw I/O (W1/W2/W3 workloads).
The code is :mod:`ckptio.bench.fastpickle`
(``python -m benchmarks.fastpickle_bench --help``); see benchmarks/README.md."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from ckptio.bench.fastpickle import main

if __name__ == "__main__":
    main()

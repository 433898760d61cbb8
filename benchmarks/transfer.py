"""Put/get throughput of ckptio backends against the best raw client on the same server.
The code is :mod:`ckptio.bench.transfer`
(``python -m benchmarks.transfer --help``); see benchmarks/README.md."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from ckptio.bench.transfer import main

if __name__ == "__main__":
    main()

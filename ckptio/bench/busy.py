"""A busy machine on demand: ``n`` processes spinning pure-Python loops, as data-loader workers keep
the cores of a training node busy. ``benchmarks/checkpointer_bench.py --busy`` measures staging under
it; to run any other benchmark on a busy machine, start it in another shell:

    python -m ckptio.bench.busy [--hogs N] [--seconds 600]

Each hog stops on its own when its parent goes away (checked every loop), so none outlives a killed run.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator

SPIN = (
    "import os, time\nparent = os.getppid()\nend = time.time() + {seconds}\n"
    "while time.time() < end and os.getppid() == parent:\n    sum(i * i for i in range(10000))"
)


@contextlib.contextmanager
def cpu_hog(n: int, seconds: float = 3600) -> Iterator[None]:
    """``n`` spinning processes while the block runs (at most ``seconds``)."""
    procs = [subprocess.Popen([sys.executable, "-c", SPIN.format(seconds=seconds)]) for _ in range(n)]
    try:
        time.sleep(1.0)  # let them reach the run queue
        yield
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ckptio.bench.busy", description=__doc__.split("\n\n")[0])
    ap.add_argument("--hogs", type=int, default=os.cpu_count() or 1, help="processes (default: one per core)")
    ap.add_argument("--seconds", type=float, default=600, help="how long (default 600; Ctrl-C stops earlier)")
    args = ap.parse_args(argv)
    print(f"{args.hogs} CPU hogs for {args.seconds:g} s (Ctrl-C stops them)", flush=True)
    with contextlib.suppress(KeyboardInterrupt), cpu_hog(args.hogs, args.seconds):
        time.sleep(args.seconds)
    return 0


if __name__ == "__main__":
    sys.exit(main())

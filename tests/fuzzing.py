"""Running a fuzzer's script in a child process: a hang, crash or memory blow-up there fails the test, not
the test run. The script prints its cases as one JSON list."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any


def fuzz_in_child(
    script: str, seed: int, n: int, *args: str, cwd: Any = None, keep_ckptio_env: bool = False, timeout: float = 120
) -> list[dict[str, Any]]:
    """The cases ``script`` (run by ``python -c``, warnings off, with this process's ``sys.path``) prints
    for ``seed`` (``CKPTIO_FUZZ_SEED`` overrides it), ``n`` and ``args``; ``CKPTIO_*`` variables are
    dropped unless ``keep_ckptio_env``."""
    env = {k: v for k, v in os.environ.items() if keep_ckptio_env or not k.startswith("CKPTIO_")}
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    seed = int(os.environ.get("CKPTIO_FUZZ_SEED", str(seed)))
    argv = [sys.executable, "-W", "ignore", "-c", script, str(seed), str(n), *args]
    proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)

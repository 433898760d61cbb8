"""Saves and loads made while the interpreter exits (an ``atexit`` handler: a job's last checkpoint).

From that moment ``concurrent.futures`` refuses new work on every thread pool; every ckptio call
below used one (sizes above the thresholds where ckptio hashes, writes or reads in parallel) and
failed with "cannot schedule new futures after interpreter shutdown". Each runs in a child process
(under a timeout: a hang fails the test) and is checked there against the saved state.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from conftest import S3_TEST_OPTIONS

CHILD = textwrap.dedent(
    """
    import atexit, json, sys, warnings
    import torch, ckptio
    from ckptio import dcp
    from ckptio.checkpointer import Checkpointer

    warnings.simplefilter("ignore")
    base, backends, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    if backends:
        ckptio.configure(backends=backends)
    g = torch.Generator().manual_seed(0)
    state = {f"w{i}": torch.randn(1 << 20, generator=g) for i in range(12)}  # 48 MiB

    def same(loaded):
        return all(torch.equal(loaded[k], v) for k, v in state.items())

    def blank():
        return {k: torch.empty_like(v) for k, v in state.items()}

    def fpk():
        ckptio.dump(state, f"{base}/a.fpk")
        return same(ckptio.load(f"{base}/a.fpk"))

    def pt():
        ckptio.dump(state, f"{base}/a.pt")
        return same(ckptio.load(f"{base}/a.pt", weights_only=True))

    def dcp_round_trip():
        dcp.save(state, f"{base}/d")
        out = blank()
        dcp.load(out, f"{base}/d")
        return same(out)

    def checkpointer_async():
        c = Checkpointer(f"{base}/run", async_save=True)
        c.save(1, {"m": state})
        c.wait()
        out = {"m": blank()}
        Checkpointer(f"{base}/run").load(out)
        return same(out["m"])

    def copy():
        ckptio.copyfile(f"{base}/a.fpk", f"{base}/b.fpk")
        return same(ckptio.load(f"{base}/b.fpk"))

    def checkpointer_async_no_wait():  # checked by the parent once this process is gone
        Checkpointer(f"{base}/nowait", async_save=True).save(1, {"m": state})
        return True

    def at_exit():
        seen = {}
        for f in (fpk, pt, dcp_round_trip, checkpointer_async, copy, checkpointer_async_no_wait):
            try:
                seen[f.__name__] = "ok" if f() else "wrong bytes"
            except Exception as e:
                seen[f.__name__] = f"{type(e).__name__}: {e}"
        with open(out, "w") as fh:
            json.dump(seen, fh)

    atexit.register(at_exit)
    """
)


def _run(tmp_path, base: str, backends: dict) -> dict:
    script, out = tmp_path / "child.py", tmp_path / "seen.json"
    script.write_text(CHILD)
    env = {**os.environ, "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}
    proc = subprocess.run(
        [sys.executable, str(script), base, json.dumps(backends), str(out)],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


EXPECTED = dict.fromkeys(
    ["fpk", "pt", "dcp_round_trip", "checkpointer_async", "copy", "checkpointer_async_no_wait"], "ok"
)


def _complete(base: str) -> bool:
    """The async save made at exit, whose caller did not wait: committed, with the state's bytes."""
    import torch

    from ckptio.checkpointer import Checkpointer

    g = torch.Generator().manual_seed(0)
    state = {f"w{i}": torch.randn(1 << 20, generator=g) for i in range(12)}
    out = {"m": {k: torch.empty_like(v) for k, v in state.items()}}
    Checkpointer(f"{base}/nowait").load(out)
    return all(torch.equal(out["m"][k], v) for k, v in state.items())


def test_saves_and_loads_in_an_atexit_handler_local(tmp_path):
    assert _run(tmp_path, str(tmp_path / "data"), {}) == EXPECTED
    assert _complete(str(tmp_path / "data"))


def test_saves_and_loads_in_an_atexit_handler_s3(tmp_path, s3_uri, s3_endpoint):
    backends = {"s3": {"endpoint_url": s3_endpoint, "part_size": 5 << 20, **S3_TEST_OPTIONS}}
    assert _run(tmp_path, f"{s3_uri}/exit", backends) == EXPECTED
    assert _complete(f"{s3_uri}/exit")


def test_saves_and_loads_in_an_atexit_handler_gcs(tmp_path, gcs_uri, gcs_endpoint):
    backends = {"gcs": {"endpoint_url": gcs_endpoint, "anon": True, "project": "test", "part_size": 8 << 20}}
    assert _run(tmp_path, f"{gcs_uri}/exit", backends) == EXPECTED
    assert _complete(f"{gcs_uri}/exit")

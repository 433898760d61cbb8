"""The ``ckptio`` commands that need no tensor do not import torch (its import is most of a command's
start-up: seconds on a cold cache). Each command runs in a fresh interpreter, which reports whether
``torch`` was imported by the time the command returned; no timing is asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import ckptio
from ckptio.checkpointer import Checkpointer

RUNNER = """
import json, sys
from ckptio.cli import main
code = main(sys.argv[1:])
sys.stdout.flush()
print(json.dumps({"code": code, "torch": "torch" in sys.modules}), file=sys.stderr)
"""


def ckptio_cmd(*argv: str, env: dict | None = None) -> tuple[int, bool, str]:
    """(exit status, whether torch was imported, stderr) of ``ckptio ARGV`` in a fresh interpreter."""
    r = subprocess.run(
        [sys.executable, "-c", RUNNER, *argv],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false", **(env or {})},
    )
    last = json.loads(r.stderr.strip().splitlines()[-1])
    return last["code"], last["torch"], r.stderr


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("torchfree")
    ckptio.put(b"x" * 1000, str(d / "files" / "a.bin"))
    ckptio.put(b"y" * 10, str(d / "files" / "sub" / "b.bin"))
    ck = Checkpointer(str(d / "root"), format="fpk")
    ck.save(1, {"w": torch.ones(2)}, metrics={"loss": 1.0})
    ck.close()
    inc = Checkpointer(str(d / "inc"), format="fpk", incremental=True)
    inc.save(1, {"w": torch.ones(2)})
    inc.close()
    return str(d)


COMMANDS = [
    ["ls", "{d}/files"],
    ["ls", "-l", "-r", "{d}/files"],
    ["ls", "--steps", "{d}/root"],
    ["cp", "-r", "{d}/files", "{d}/copy"],
    ["rm", "{d}/files/a.bin"],
    ["du", "{d}/root"],
    ["du", "{d}/inc"],
    ["config"],
    ["cache", "stats", "--cache-dir", "{d}/cache"],
    ["info", "{d}/root"],
    ["info", "{d}/inc"],
]


@pytest.mark.parametrize("argv", COMMANDS, ids=[" ".join(a[:2]) for a in COMMANDS])
def test_commands_that_need_no_tensor_do_not_import_torch(tree, argv):
    code, imported, err = ckptio_cmd(*(a.format(d=tree) for a in argv))
    assert code == 0, err
    assert not imported, f"ckptio {' '.join(argv)} imported torch"


def test_import_ckptio_does_not_import_torch():
    r = subprocess.run(
        [sys.executable, "-c", "import sys, ckptio, ckptio.cli, ckptio.checkpointer; print('torch' in sys.modules)"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.stdout.strip() == "False", r.stderr


def test_commands_that_read_tensors_still_do(tree):
    """The check above would pass if the runner could not see torch at all. Today these import it: the
    .fpk reader builds its tables from torch's dtypes; a DCP .metadata is torch's pickled classes."""
    code, imported, err = ckptio_cmd("info", f"{tree}/root", "--step", "1")
    assert code == 0, err
    assert imported

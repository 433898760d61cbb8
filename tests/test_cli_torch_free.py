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
    ckptio.dump({"w": torch.ones(2, 3), "b": torch.zeros(2, dtype=torch.bfloat16), "step": 7}, str(d / "m.fpk"))
    ckptio.dump({"w": torch.ones(2, 3)}, str(d / "m.pt"))
    ckptio.dump({"w": torch.ones(2, 3), "b": torch.zeros(4, dtype=torch.bfloat16)}, str(d / "m.safetensors"))
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
    ["info", "{d}/m.fpk"],
    ["info", "{d}/m.safetensors"],
    ["verify", "{d}/m.safetensors"],
    ["info", "{d}/root", "--step", "1"],
    ["info", "{d}/inc/000000000001"],
]


@pytest.mark.parametrize("argv", COMMANDS, ids=[" ".join(a) for a in COMMANDS])
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
    """The check above would pass if the runner could not see torch at all. These import it today: a
    .pt is torch.load, verify of a .fpk is a full load, a DCP .metadata is torch's pickled classes."""
    for argv in (["info", f"{tree}/m.pt"], ["verify", f"{tree}/m.fpk"]):
        code, imported, err = ckptio_cmd(*argv)
        assert code == 0, err
        assert imported, argv


@pytest.mark.parametrize("name", ["m.fpk", "m.safetensors"])
def test_info_of_a_file_is_the_same_without_torch(tree, name):
    """What the torch-free path prints equals what it printed with torch loaded."""
    r = subprocess.run(
        [sys.executable, "-m", "ckptio.cli", "info", "--json", f"{tree}/{name}"], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == json.loads(json.dumps(ckptio.info(f"{tree}/{name}")))


def test_the_fpk_dtype_table_is_torchs():
    """``layout.ELEMENTS`` (what a file's dtypes are checked against without torch) matches torch's dtypes:
    a torch release with a new dtype fails here until the table has it."""
    from ckptio.formats.fastpickle import layout

    want = {
        str(d).removeprefix("torch."): (
            d.itemsize,
            "q"
            if str(d).startswith(("torch.qint", "torch.quint"))
            else "c"
            if d.is_complex
            else "f"
            if d.is_floating_point
            else "o",
        )
        for d in (getattr(torch, n) for n in dir(torch))
        if isinstance(d, torch.dtype)
    }
    assert {n: layout.ELEMENTS.get(n) for n in want} == want

"""The per-file progress lines (tests/progress.py) of a quiet run, serial and with xdist workers."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))

FILES = {
    "test_a.py": "def test_one():\n    pass\n\ndef test_two():\n    assert False\n",
    "test_b.py": (
        "import pytest\n\n"
        "def test_one():\n    pass\n\n"
        "def test_skip():\n    pytest.skip('no')\n\n"
        "@pytest.mark.xfail(strict=True)\ndef test_known():\n    assert False\n"
    ),
}


@pytest.mark.parametrize("workers", ["0", "2"])
def test_each_file_gets_a_line_with_its_counts(tmp_path, workers):
    for name, text in FILES.items():
        (tmp_path / name).write_text(text)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]))
    args = ["-p", "no:cacheprovider", "-p", "progress", "-q", "-n", workers, "--dist", "loadfile"]
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", *args, "test_a.py", "test_b.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert any(line.startswith("test_a.py: 1 failed, 1 passed in ") for line in lines), proc.stdout
    assert any(line.startswith("test_b.py: 1 passed, 1 skipped, 1 xfailed in ") for line in lines), proc.stdout

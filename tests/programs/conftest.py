"""The session's program launcher (:mod:`.launcher`) as a fixture, and reading what a job's ranks left."""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch

JOB_TIMEOUT = 120
HERE = os.path.dirname(os.path.abspath(__file__))


class Launcher:
    """The session's :mod:`.launcher` process; :meth:`run` runs one job and returns its reply."""

    def __init__(self, log_path: str) -> None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")]))
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "programs.launcher"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            env=env,
            cwd=os.path.dirname(HERE),
        )
        self.sel = selectors.DefaultSelector()
        self.sel.register(self.proc.stdout, selectors.EVENT_READ)
        assert self._reply(300) == {"ready": True}
        self.references: dict[str, list[dict]] = {}

    def _reply(self, timeout: float) -> dict:
        if not self.sel.select(timeout):
            raise TimeoutError(f"the program launcher did not answer within {timeout}s (log: {self.log.name})")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the program launcher exited with {self.proc.wait()} (log: {self.log.name})")
        return json.loads(line)

    def run(self, job: dict[str, Any]) -> dict:
        os.makedirs(job["out"], exist_ok=True)
        job = {"timeout": JOB_TIMEOUT, **job}
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        reply = self._reply(job["timeout"] + 60)
        reply["world"] = job["world"]
        return reply

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(30)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            self.log.close()


@pytest.fixture(scope="session")
def launcher(tmp_path_factory) -> Iterator[Launcher]:
    lau = Launcher(str(tmp_path_factory.mktemp("launcher") / "launcher.log"))
    yield lau
    lau.close()


def logs(out: str) -> str:
    """The tail of every rank's log in ``out``."""
    text = []
    for name in sorted(os.listdir(out)):
        if name.endswith(".log"):
            with open(os.path.join(out, name)) as f:
                text.append(f"--- {name}\n{f.read()[-4000:]}")
    return "\n".join(text)


def outcome(reply: dict, out: str) -> list[dict]:
    """What every rank wrote to ``out/rank<r>.pt``; fails with the ranks' logs unless every rank exited 0."""
    assert reply["codes"] == [0] * reply["world"], f"{reply}\n{logs(out)}"
    return [torch.load(os.path.join(out, f"rank{r}.pt"), weights_only=False) for r in range(reply["world"])]

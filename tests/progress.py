"""One line per test file as it finishes (``tests/test_io.py: 120 passed, 2 skipped in 14.2 s``).

A quiet run (``-q``) and a run with xdist workers (``scripts/test.sh``) otherwise print only dots. Active on
the controller when the run is quiet or parallel; a plain ``pytest`` run already names each file. The counts
come from the collection (the controller's own, or the first xdist worker's ids).
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict

import pytest


class FileProgress:
    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.left: Counter[str] = Counter()
        self.started: dict[str, float] = {}
        self.outcomes: defaultdict[str, dict[str, str]] = defaultdict(dict)  # file -> nodeid -> outcome

    def _count(self, nodeids: list[str]) -> None:
        if not self.left:
            self.left.update(n.split("::", 1)[0] for n in nodeids)

    @pytest.hookimpl(trylast=True)
    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self._count([item.nodeid for item in session.items])

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_node_collection_finished(self, node, ids: list[str]) -> None:
        self._count(list(ids))

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        path = report.nodeid.split("::", 1)[0]
        if path not in self.left:
            return
        self.started.setdefault(path, time.monotonic())
        seen = self.outcomes[path]
        if report.failed:
            seen[report.nodeid] = "failed" if report.when == "call" else "error"
        elif report.skipped or hasattr(report, "wasxfail"):
            seen.setdefault(report.nodeid, "xfailed" if hasattr(report, "wasxfail") else "skipped")
        elif report.when == "call":
            seen.setdefault(report.nodeid, "passed")
        if report.when != "teardown":
            return
        self.left[path] -= 1
        if self.left[path]:
            return
        counts = Counter(seen.values())
        summary = ", ".join(f"{n} {what}" for what, n in sorted(counts.items()))
        took = time.monotonic() - self.started[path]
        reporter = self.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            if reporter._tw.width_of_current_line:  # mid-way through a line of dots
                reporter.write("\n")
            reporter.write_line(f"{path}: {summary} in {took:.1f} s", red=bool(counts["failed"] + counts["error"]))


def pytest_configure(config: pytest.Config) -> None:
    if hasattr(config, "workerinput"):  # an xdist worker: the controller reports
        return
    parallel = bool(getattr(config.option, "numprocesses", None))
    if parallel or config.option.verbose < 0:
        config.pluginmanager.register(FileProgress(config), "ckptio-file-progress")

"""Ranks of one node share its local tier (found by the training programs: a DDP job with ``dcp`` and
``local_tier=`` on S3 failed to resume, rank 0's eviction of a replicated step raising
``FileNotFoundError`` because rank 1 was deleting the same directory). Deleting a directory that another
process deletes at the same time succeeds."""

from __future__ import annotations

import os
import threading

from ckptio.checkpointer.manifest import Layout


def _discard_at_once(root: str, step: int, n: int) -> list[BaseException]:
    """``n`` threads discard ``step`` of ``root`` at the same moment; returns what they raised."""
    start, errors = threading.Barrier(n), []

    def discard() -> None:
        start.wait()
        try:
            Layout(root).discard(step)
        except BaseException as e:  # noqa: BLE001 - returned to the test
            errors.append(e)

    threads = [threading.Thread(target=discard) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


def test_two_processes_discarding_the_same_step_both_succeed(tmp_path):
    for attempt in range(3):  # before the fix, each attempt failed
        root = str(tmp_path / f"tier{attempt}")
        layout = Layout(root)
        for shard in range(10):
            d = os.path.join(layout.dir(3), f"shard{shard}")
            os.makedirs(d)
            for i in range(20):
                open(os.path.join(d, f"__{i}_0.distcp"), "w").close()
        assert _discard_at_once(root, 3, 2) == [], f"attempt {attempt}"
        assert not os.path.exists(layout.dir(3))

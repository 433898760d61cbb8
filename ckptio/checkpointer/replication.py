"""The background replicator of a tiered Checkpointer (:mod:`.tiered`): one thread, a bounded queue of steps.

The thread (a daemon, started with the Checkpointer on rank 0, at the Checkpointer's ``background_nice``;
it exits after ``IDLE_EXIT`` seconds with nothing to do, so an unclosed Checkpointer can be collected,
and starts again with the next step) first schedules every step committed on the local tier (so a step
a killed process never replicated is replicated on the next start; a step already remote is only
checked), then replicates queued steps oldest first, one at a time. A step's files move up to 4 at a
time through :func:`ckptio.transfer.copy_objects`, which streams each in pieces through one buffer of at
most the local backend's ``part_size * concurrency / jobs`` bytes (256 MiB in all by default) into the
remote writer (itself bounded by ``max_buffer_bytes``): memory stays bounded whatever the step's size.

Failures: the backends retry transient errors; when a step still fails, a :class:`CheckpointWarning` is
issued (and logged), the step stays queued and is retried after ``retry_after`` seconds (at once when
:meth:`Replicator.wait` is called); training goes on and later steps queue behind it. The queue is
bounded: once ``max_pending`` steps are queued or replicating, :meth:`Replicator.admit` (called by each
``save`` before it writes) blocks until one is done (``on_backlog="block"``) or raises
:class:`BacklogError` (``"raise"``).
"""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Callable, Iterable

from ..errors import CkptioError, logger
from ..threads import lower_priority
from .manifest import CheckpointWarning

log = logger("ckptio.checkpointer")

BACKLOG_POLICIES = ("block", "raise")
RETRY_AFTER = 30.0
IDLE_EXIT = 10.0


class BacklogError(CkptioError, RuntimeError):
    """A save found ``max_pending`` steps still waiting for replication (``on_backlog="raise"``)."""


class ReplicationError(CkptioError, RuntimeError):
    """Replication of a step failed (raised by ``wait``; the step stays on the local tier and is retried)."""


def _closed(step: int) -> None:
    raise RuntimeError(f"replication of step {step} after the replicator was closed")


def _closed_list() -> Iterable[int]:
    return ()


class Replicator:
    """The queue of steps to replicate and the thread that runs ``replicate(step)`` for each."""

    def __init__(
        self,
        replicate: Callable[[int], None],
        initial: Callable[[], Iterable[int]],
        *,
        max_pending: int,
        on_backlog: str,
        nice: int | None,
        name: str,
    ) -> None:
        if not isinstance(max_pending, int) or isinstance(max_pending, bool) or max_pending < 1:
            raise ValueError(f"max_pending must be a positive int, got {max_pending!r}")
        if on_backlog not in BACKLOG_POLICIES:
            raise ValueError(f"on_backlog must be one of {BACKLOG_POLICIES}, got {on_backlog!r}")
        self._replicate, self._initial = replicate, initial
        self.max_pending, self.on_backlog, self.name = max_pending, on_backlog, name
        self.retry_after = RETRY_AFTER
        self._cond = threading.Condition()
        self._queue: list[int] = []
        self._current: int | None = None
        self._scanning = True
        self._failures = 0
        self._error: BaseException | None = None
        self._retry_at = 0.0
        self._closed = False
        self._nice = nice
        self._thread: threading.Thread | None = None
        with self._cond:
            self._start()

    def _start(self) -> None:
        """Start the thread unless it runs (the caller holds the lock)."""
        if self._thread is None and not self._closed:
            self._thread = threading.Thread(target=self._run, name="ckptio-replicator", daemon=True)
            self._thread.start()

    # ---- the caller's side ----------------------------------------------------------------------
    def submit(self, step: int) -> None:
        with self._cond:
            if step not in self._queue:
                self._queue.append(step)
                self._queue.sort()
            self._start()
            self._cond.notify_all()

    @property
    def scanning(self) -> bool:
        """Whether the thread is still scheduling the steps found on the local tier at start."""
        return self._scanning

    def forget(self, step: int) -> None:
        """Unschedule ``step`` (it is being deleted); waits while it is being replicated."""
        with self._cond:
            if step in self._queue:
                self._queue.remove(step)
            while self._current == step:
                self._cond.wait()
            self._cond.notify_all()

    def pending(self) -> set[int]:
        """Steps queued or being replicated."""
        with self._cond:
            return set(self._queue) | ({self._current} if self._current is not None else set())

    def admit(self) -> None:
        """Before a save: wait (or raise) while ``max_pending`` steps wait for replication."""
        with self._cond:
            while len(self._queue) + (self._current is not None) >= self.max_pending:
                if self.on_backlog == "raise":
                    raise BacklogError(
                        f"{self.name}: {self.max_pending} step(s) still wait for replication "
                        f"({sorted(self.pending_locked())}); last error: {self._error!r}"
                    )
                self._cond.wait()

    def pending_locked(self) -> set[int]:
        return set(self._queue) | ({self._current} if self._current is not None else set())

    def wait(self, timeout: float | None = None, closing: bool = False) -> None:
        """Wait until every queued step is replicated; raise :class:`ReplicationError` if an attempt fails
        meanwhile (a step waiting for its retry is retried at once; ``closing``: not retried after it)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            failures = self._failures
            self._retry_at = 0.0
            self._cond.notify_all()
            while self._scanning or self._queue or self._current is not None:
                if self._closed:  # no thread replicates them any more: never wait for it
                    raise ReplicationError(
                        f"replication to {self.name} was stopped by close(); steps {sorted(self.pending_locked())} "
                        "stay on the local tier, and the next Checkpointer on this root replicates them as it starts"
                    ) from self._error
                if self._failures != failures:
                    then = (
                        "; this Checkpointer is closing: the next one on this root replicates them as it starts"
                        if closing
                        else " and are retried"
                    )
                    raise ReplicationError(
                        f"replication to {self.name} failed: {self._error}; steps {sorted(self.pending_locked())} "
                        f"stay on the local tier{then}"
                    ) from self._error
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"replication to {self.name} not done within {timeout}s")
                self._cond.wait(left)

    def close(self) -> None:
        """Wait for replication (raising its error), then stop the thread."""
        try:
            self.wait(closing=True)
        finally:
            with self._cond:
                self._closed = True
                self._cond.notify_all()
                thread = self._thread
            if thread is not None:
                thread.join()
            # never called again (a closed replicator starts no thread): the owner's methods are let go, so
            # owner and replicator are no reference cycle once closed
            self._replicate, self._initial = _closed, _closed_list

    # ---- the thread ---------------------------------------------------------------------------------
    def _run(self) -> None:
        lower_priority(self._nice)
        steps = []
        try:
            if self._scanning:
                steps = list(self._initial())
        except BaseException as e:  # noqa: BLE001 - reported; the steps saved from now on still replicate
            self._fail(e, "cannot list the local tier")
        with self._cond:
            for s in steps:
                if s not in self._queue:
                    self._queue.append(s)
            self._queue.sort()
            self._scanning = False
            self._cond.notify_all()
        while True:
            with self._cond:
                while not self._closed and (not self._queue or time.monotonic() < self._retry_at):
                    if self._queue:
                        self._cond.wait(self._retry_at - time.monotonic())
                    elif not self._cond.wait(IDLE_EXIT) and not self._queue:
                        self._thread = None  # idle: the next submit starts another
                        return
                if self._closed:
                    self._thread = None
                    return
                step = self._current = self._queue.pop(0)
            try:
                self._replicate(step)
            except BaseException as e:  # noqa: BLE001 - reported (warning, log, wait()); retried later
                with self._cond:
                    if step not in self._queue:
                        self._queue.insert(0, step)
                    self._retry_at = time.monotonic() + self.retry_after
                self._fail(e, f"step {step} stays on the local tier; retried in {self.retry_after:g}s")
            finally:
                with self._cond:
                    self._current = None
                    self._cond.notify_all()

    def _fail(self, e: BaseException, what: str) -> None:
        msg = f"replication to {self.name} failed ({type(e).__name__}: {e}); {what}"
        log.warning("%s", msg)
        warnings.warn(msg, CheckpointWarning, stacklevel=2)
        with self._cond:
            self._failures += 1
            self._error = e
            self._cond.notify_all()

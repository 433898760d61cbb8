"""Deadlines that end blocking socket reads on a caller's thread.

A GET sent from the caller's thread (:mod:`.here`) blocks in ``recv`` calls that a socket timeout
bounds one by one, not together: a server that trickles its reply would hold the attempt past the
retry policy's per-attempt ``timeout`` and its ``deadline``, which bound the same GET on the IO loop.
:data:`WATCHDOG` is one thread for the process that, at an armed deadline, shuts the sockets the
attempt reads (their blocked reads return at once; the reader then finds its time is up). Arming
and disarming take a lock and a heap push: no thread or timer per request. A forked child starts
with no deadlines and starts its own thread when it first arms one.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import os
import socket
import threading
import time
from collections.abc import Callable


class Watchdog:
    """Calls a function at a ``time.monotonic()`` deadline unless it is disarmed first; the function runs
    on the watchdog's thread, under its lock (so that once :meth:`disarm` returns it never runs)."""

    def __init__(self) -> None:
        self._reset()
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=self._reset)

    def _reset(self) -> None:
        self._cv = threading.Condition()
        self._heap: list[list] = []  # [deadline, sequence number, function or None once disarmed]
        self._seq = itertools.count()
        self._disarmed = 0  # entries in the heap that were disarmed
        self._thread: threading.Thread | None = None

    def arm(self, until: float, fire: Callable[[], None]) -> list:
        """Call ``fire()`` at ``until``; the handle for :meth:`disarm`."""
        entry = [until, next(self._seq), fire]
        with self._cv:
            heapq.heappush(self._heap, entry)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="ckptio-deadlines", daemon=True)
                self._thread.start()
            elif self._heap[0] is entry:
                self._cv.notify()
        return entry

    def disarm(self, entry: list) -> None:
        with self._cv:
            if entry[2] is None:
                return
            entry[2] = None  # its function (and the sockets it holds) let go at once
            self._disarmed += 1
            # disarmed deadlines (most are: a GET ends long before its deadline) leave the heap when they
            # come to its top; a heap mostly of them is rebuilt without them (amortized: O(1) a disarm)
            if self._disarmed > 64 and self._disarmed * 2 > len(self._heap):
                self._heap = [e for e in self._heap if e[2] is not None]
                heapq.heapify(self._heap)
                self._disarmed = 0

    def _run(self) -> None:
        cv = self._cv
        with cv:
            while True:
                heap = self._heap
                while heap and heap[0][2] is None:
                    heapq.heappop(heap)
                    self._disarmed -= 1
                if not heap:
                    cv.wait()
                    continue
                wait = heap[0][0] - time.monotonic()
                if wait > 0:
                    cv.wait(min(wait, threading.TIMEOUT_MAX))  # (an infinite deadline never comes due)
                    continue
                entry = heapq.heappop(heap)
                fire, entry[2] = entry[2], None  # a disarm after this finds nothing to do
                with contextlib.suppress(Exception):
                    fire()


def shut_all(socks: list[socket.socket], fired: list[bool]) -> Callable[[], None]:
    """A deadline's function: shut down every socket in ``socks`` (a list the reader fills as it opens
    them), which unblocks a thread reading one, and note it in ``fired`` (what was read from a socket shut
    down mid-reply is cut short, whatever it looks like). The base socket's shutdown: an SSL socket's own
    would drop its SSL object under the reading thread."""

    def fire() -> None:
        fired.append(True)
        for sock in socks:
            with contextlib.suppress(OSError):
                socket.socket.shutdown(sock, socket.SHUT_RDWR)

    return fire


WATCHDOG = Watchdog()

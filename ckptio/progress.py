"""Progress reporting: a callback protocol for library calls and a terminal bar for the command line.

A progress callback is any callable ``callback(bytes_done, bytes_total)``; it is called from
worker threads, with ``bytes_done`` never decreasing. Library functions that take ``progress=``
accept ``None`` (no reporting), a callback, or a :class:`Bar`.

:func:`bar` returns a :class:`Bar` that draws bytes, rate and ETA on stderr when stderr is a
terminal: with tqdm when it is installed, else a single self-overwriting line. It draws nothing
when stderr is not a terminal, when ``enabled=False`` (``--quiet``), or when
``CKPTIO_PROGRESS=0`` is set.
"""

from __future__ import annotations

import io
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol, TextIO


class ProgressCallback(Protocol):
    def __call__(self, bytes_done: int, bytes_total: int) -> None: ...


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


class Tracker:
    """Thread-safe byte counter that forwards ``(done, total)`` to a callback.

    Several workers call :meth:`add`; the callback sees a monotonic total. ``total`` may grow
    (:meth:`add_total`) when the amount of work is discovered while it runs.
    """

    def __init__(self, total: int, callback: Callable[[int, int], None] | None = None) -> None:
        self.total, self.done = int(total), 0
        self._callback = callback
        self._lock = threading.Lock()

    def add(self, n: int) -> None:
        with self._lock:
            self.done += int(n)
            done, total = self.done, self.total
            if self._callback is not None:  # under the lock so calls arrive in order
                self._callback(done, max(total, done))

    def add_total(self, n: int) -> None:
        with self._lock:
            self.total += int(n)


class CountingWriter:
    """Wraps a writable file/``Writer`` and reports each write's length to ``add``."""

    def __init__(self, inner: Any, add: Callable[[int], None]) -> None:
        self._inner, self._add = inner, add

    def write(self, data: Any) -> int:
        n = self._inner.write(data)
        self._add(memoryview(data).nbytes if n is None else n)
        return n

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _enabled_by_env() -> bool:
    return os.environ.get("CKPTIO_PROGRESS", "1").strip().lower() not in ("0", "false", "no", "off")


class Bar:
    """A progress bar usable as a callback. Use as a context manager so the line is finished."""

    def __init__(
        self,
        total: int = 0,
        desc: str = "",
        *,
        enabled: bool | None = None,
        file: TextIO | None = None,
        min_interval: float = 0.1,
    ) -> None:
        self.file = file if file is not None else sys.stderr
        if enabled is None:
            enabled = _enabled_by_env() and bool(getattr(self.file, "isatty", lambda: False)())
        self.enabled = bool(enabled)
        self.desc, self.total, self.done = desc, int(total), 0
        self._t0 = time.monotonic()
        self._last = 0.0
        self._min_interval = min_interval
        self._lock = threading.Lock()
        self._tqdm: Any = None
        self._line_len = 0
        if self.enabled:
            try:
                from tqdm import tqdm
            except ImportError:
                pass  # plain text lines
            else:
                try:
                    cols = os.get_terminal_size(self.file.fileno()).columns
                except (OSError, AttributeError, ValueError, io.UnsupportedOperation):
                    cols = 0
                size = {"dynamic_ncols": True} if cols else {"ncols": 100}  # a pty without a size reports 0
                self._tqdm = tqdm(
                    total=self.total or None,
                    desc=desc or None,
                    unit="B",
                    unit_scale=True,
                    unit_divisor=1024,
                    file=self.file,
                    leave=False,
                    **size,
                )

    def __call__(self, bytes_done: int, bytes_total: int) -> None:
        if not self.enabled:
            return
        with self._lock:
            delta = bytes_done - self.done
            self.done = bytes_done
            if bytes_total != self.total:
                self.total = bytes_total
                if self._tqdm is not None:
                    self._tqdm.total = bytes_total
            if self._tqdm is not None:
                if delta > 0:
                    self._tqdm.update(delta)
                return
            now = time.monotonic()
            if now - self._last < self._min_interval and bytes_done < bytes_total:
                return
            self._last = now
            self._draw(now)

    def _draw(self, now: float) -> None:
        elapsed = max(now - self._t0, 1e-9)
        rate = self.done / elapsed
        parts = [self.desc] if self.desc else []
        if self.total:
            parts.append(f"{100 * self.done / self.total:5.1f}%")
            parts.append(f"{human_bytes(self.done)}/{human_bytes(self.total)}")
        else:
            parts.append(human_bytes(self.done))
        parts.append(f"{human_bytes(rate)}/s")
        if self.total and rate > 0 and self.done < self.total:
            eta = int((self.total - self.done) / rate)
            parts.append(f"ETA {eta // 60}:{eta % 60:02d}")
        line = "  ".join(parts)
        pad = " " * max(0, self._line_len - len(line))
        self._line_len = len(line)
        self.file.write("\r" + line + pad)
        self.file.flush()

    def write(self, msg: str) -> None:
        """Print a line to the bar's stream without garbling the bar."""
        with self._lock:
            if self._tqdm is not None:
                self._tqdm.write(msg, file=self.file)
                return
            if self.enabled and self._line_len:
                self.file.write("\r" + " " * self._line_len + "\r")
                self._line_len = 0
            self.file.write(msg + "\n")
            self.file.flush()

    def set_description(self, desc: str) -> None:
        self.desc = desc
        if self._tqdm is not None:
            self._tqdm.set_description(desc or None, refresh=False)

    def close(self) -> None:
        if not self.enabled:
            return
        with self._lock:
            if self._tqdm is not None:
                self._tqdm.close()
                self._tqdm = None
            elif self._line_len:
                self.file.write("\r" + " " * self._line_len + "\r")
                self.file.flush()
                self._line_len = 0
            self.enabled = False

    def __enter__(self) -> Bar:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def bar(total: int = 0, desc: str = "", *, enabled: bool | None = None, file: TextIO | None = None) -> Bar:
    """A :class:`Bar` (drawn only on a terminal unless ``enabled`` says otherwise)."""
    return Bar(total, desc, enabled=enabled, file=file)

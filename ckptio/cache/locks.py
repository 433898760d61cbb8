"""The cache's file locks: ``fcntl.flock`` on ``<cache_dir>/locks/<key>.lock``, exclusive to fill or
evict an entry, shared to use it (the protocol is in :mod:`ckptio.cache.store`)."""

from __future__ import annotations

import errno
import fcntl
import os
import time
from typing import Any


class FileLock:
    """An flock on ``path`` that is safe against the file being unlinked by an evictor.

    After locking, the descriptor's inode must still be the one at ``path``; if an evictor removed
    (and maybe someone recreated) the file in between, lock again.
    """

    def __init__(self, path: str, exclusive: bool, timeout: float | None, what: str) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        op = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
        delay = 0.002
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                while True:
                    try:
                        fcntl.flock(fd, op | fcntl.LOCK_NB)
                        break
                    except BlockingIOError:
                        if deadline is not None and time.monotonic() > deadline:
                            raise TimeoutError(
                                errno.ETIMEDOUT,
                                f"timed out after {timeout:.0f}s waiting for the "
                                f"cache lock of {what} (another process is filling it: {path})",
                            ) from None
                        time.sleep(delay)
                        delay = min(delay * 2, 0.05)
            except BaseException:
                os.close(fd)
                raise
            self.fd: int | None = fd
            if self.still_at(path):
                return
            self.release()

    @classmethod
    def try_exclusive(cls, path: str) -> FileLock | None:
        """The exclusive lock if it is free right now, else None (for eviction)."""
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        lock = cls.__new__(cls)
        lock.fd = fd
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.release()
            return None
        if not lock.still_at(path):
            lock.release()
            return None
        return lock

    def still_at(self, path: str) -> bool:
        """Whether ``path`` is still the file this lock is on (an evictor unlinks lock files)."""
        try:
            return self.fd is not None and os.stat(path).st_ino == os.fstat(self.fd).st_ino
        except FileNotFoundError:
            return False

    def share(self) -> None:
        """Downgrade exclusive to shared (not atomic in flock: callers re-validate after)."""
        assert self.fd is not None
        fcntl.flock(self.fd, fcntl.LOCK_SH)

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the only descriptor releases the flock
            self.fd = None

    def __enter__(self) -> FileLock:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

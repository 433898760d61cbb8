"""The interface every ``.fpk`` reader reads through (:class:`Source`): a file's bytes by offset, and what
a source may hold already (ranges read ahead, the whole file). The sources themselves, and how a URI or an
open file becomes one: :mod:`.read`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ...errors import IntegrityError
from .layout import CHUNK


class Source:
    name: str
    size: int
    concurrency = 1
    part_size = CHUNK  # the largest single read of a payload
    prefetch = 0  # bytes read speculatively from the end with the footer (saves a request when remote)
    fd: int | None = None
    local = False  # no request latency: no read-ahead, runs read straight into their buffers
    mappable = False  # a file ckptio opened by path: mapped by default (never rewritten in place by ckptio)

    def readinto(self, mv: memoryview, offset: int) -> int:
        raise NotImplementedError

    def read_each(self, mv: memoryview, offset: int, each: Callable[[memoryview], Any]) -> int:
        """:meth:`readinto`, handing consecutive parts of what it read to ``each`` in order as they come in
        (a local source in ``osio.HOT_PIECE`` pieces, hashed while in the CPU cache). Default: the read,
        then ``each`` once."""
        n = self.readinto(mv, offset)
        if n:
            each(mv[:n])
        return n

    def readv(self, mvs: list[memoryview], offset: int) -> int:
        """Fill consecutive buffers from consecutive bytes at ``offset``; returns the bytes read."""
        total = sum(len(m) for m in mvs)
        buf = bytearray(total)
        n = self.readinto(memoryview(buf), offset)
        pos = 0
        for m in mvs:
            m[:] = buf[pos : pos + len(m)]
            pos += len(m)
        return n

    def read(self, offset: int, n: int) -> bytes:
        buf = bytearray(n)
        got = self.readinto(memoryview(buf), offset)
        if got != n:
            raise IntegrityError(f"{self.name}: truncated: wanted bytes [{offset}, {offset + n}), got {got}")
        return bytes(buf)

    def view(self, offset: int, n: int) -> bytes | memoryview:
        """:meth:`read`, or a read-only view where the source holds those bytes already (no copy)."""
        return self.read(offset, n)

    def ahead_view(self, offset: int, nbytes: int, wait: bool = True) -> memoryview | None:
        """The bytes ``[offset, offset + nbytes)`` as a view of a range read ahead that holds them all, else
        None (a source that reads nothing ahead)."""
        return None

    def outside_ahead(self, offset: int, nbytes: int) -> tuple[int, int, list[tuple[int, int]]]:
        """The part of ``[offset, offset + nbytes)`` to fetch, ``(lo, hi)``, and the ``(offset, length)``
        pieces of it inside ranges read ahead (copied from them by :meth:`readinto` once they are in)."""
        return offset, offset + nbytes, []

    def wait_ahead(self) -> None:
        """Wait for every range read ahead (IntegrityError if one came short)."""

    def checks_payloads(self) -> None:
        """The caller verifies every payload it reads from now on (an assembled source may skip its own
        per-block hashes: ``Backend.for_checked_reads``)."""

    def blame(self, offset: int, n: int) -> None:
        """After a payload mismatch: read bytes ``[offset, offset + n)`` again with the storage's own
        checks, which raise the error naming a damaged part (nothing when there are none)."""

    def held_whole(self) -> Source:
        """For a full load that may return views: this file held whole in one buffer where reading it so
        pays (:class:`BufferSource`), else this source."""
        return self

    def close(self) -> None:
        pass


def fill(readinto: Callable[[memoryview, int], int], mv: memoryview, offset: int) -> int:
    """``readinto`` from ``offset`` until ``mv`` is full or a read returns nothing; the bytes read."""
    total = 0
    while total < len(mv):
        n = readinto(mv[total:], offset + total)
        if not n:
            break
        total += n
    return total

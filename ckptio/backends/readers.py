"""Seekable, read-only raw files: over any backend's ranged reads (:class:`RangeReader`), over memory
the caller keeps (:class:`BytesReader`), or over several buffers read as one (:class:`PiecesReader`)."""

from __future__ import annotations

import bisect
import io
import itertools
from collections.abc import Sequence
from typing import Any, Protocol

Buffer = bytes | bytearray | memoryview  # as backends.base's (not imported: base imports this module)


class RangedReads(Protocol):
    """What a :class:`RangeReader` reads through: a backend's ``readinto``."""

    def readinto(self, uri: str, buf: Any, offset: int = 0) -> int: ...


class _SeekableReader(io.RawIOBase):
    """A seekable, read-only raw file of ``size`` bytes; subclasses provide ``readinto``."""

    uri: str
    size: int
    _pos: int

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self.size}[whence]
        pos = base + offset
        if pos < 0:
            raise ValueError(f"negative seek position {pos} in {self.uri}")
        self._pos = pos
        return pos

    def readall(self) -> bytes:
        out = bytearray(max(0, self.size - self._pos))
        n = self.readinto(out)
        return bytes(out[:n])


class RangeReader(_SeekableReader):
    """A seekable, read-only file over any backend, built on ``Backend.readinto``.

    Wrap in ``io.BufferedReader`` for many small reads; large ``readinto`` calls go straight to
    the backend (which may split them into parallel ranged requests).
    """

    def __init__(self, backend: RangedReads, uri: str, size: int) -> None:
        super().__init__()
        self._backend, self.uri, self.size, self._pos = backend, uri, size, 0

    def readinto(self, b) -> int:
        mv = memoryview(b).cast("B")
        n = min(len(mv), max(0, self.size - self._pos))
        if n == 0:
            return 0
        got = self._backend.readinto(self.uri, mv[:n], self._pos)
        self._pos += got
        return got


class BytesReader(_SeekableReader):
    """A seekable, read-only file over memory the caller keeps (``io.BytesIO`` would copy it).

    ``uri`` only names the bytes in errors.
    """

    def __init__(self, data: Buffer, uri: str = "<memory>") -> None:
        super().__init__()
        self._mv = memoryview(data).cast("B")
        self.uri, self.size, self._pos = uri, len(self._mv), 0

    def readinto(self, b) -> int:
        out = memoryview(b).cast("B")
        n = max(0, min(len(out), self.size - self._pos))
        out[:n] = self._mv[self._pos : self._pos + n]
        self._pos += n
        return n


class PiecesReader(_SeekableReader):
    """:class:`BytesReader` over several buffers read as one, in order (an object fetched in pieces
    into separate buffers, not copied together)."""

    def __init__(self, pieces: Sequence[Buffer], uri: str = "<memory>") -> None:
        super().__init__()
        self._pieces = [memoryview(p).cast("B") for p in pieces]
        self._starts = list(itertools.accumulate((len(p) for p in self._pieces), initial=0))
        self.uri, self.size, self._pos = uri, self._starts[-1], 0

    def readinto(self, b) -> int:
        out = memoryview(b).cast("B")
        end, done = min(self._pos + len(out), self.size), 0
        i = bisect.bisect_right(self._starts, self._pos) - 1
        while self._pos < end:
            piece, at = self._pieces[i], self._pos - self._starts[i]
            k = min(len(piece) - at, end - self._pos)
            out[done : done + k] = piece[at : at + k]
            done, self._pos, i = done + k, self._pos + k, i + 1
        return done

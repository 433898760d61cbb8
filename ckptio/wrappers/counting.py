"""A backend wrapper that reports the bytes it moves, for ``progress=`` on any call.

``CountingBackend(inner, add)`` forwards to ``inner`` and calls ``add(n)`` for every ``n`` bytes
read (``read_range``/``readinto``, and what is derived from them) or written (its writers). The io
layer wraps the resolved backend in it when a caller passes ``progress=``; the wrapped backend stays
cached as is.

Every capability is forwarded or declined here, explicitly (no attribute forwarding, so a fast path
never disappears or appears by accident):

- ``local_file``: forwarded, so a format reads a local file (or a cache entry) in place, through
  its descriptor; the object's size is counted as read when the block ends without an error (the
  caller read the file itself). ``get_local_path`` is forwarded and not counted (the io layer
  reports what is left as done when the call returns).
- ``Writer.local_fileno``: declined (None): the counting writer must see every byte written;
  ``Writer.mark_boundary``: forwarded.
- ``with_options``, ``pin_version``, ``for_checked_reads``: the wrapped backend's derived backend, counted
  into the same ``add``.
- ``writes_in_place``, ``max_buffer_bytes``, ``node_cache``: the wrapped backend's (counting
  buffers nothing; what a node cache fetches ahead of use is not the caller's reads).
- ``list_pending_writes``/``abort_pending_write``: forwarded. ``close``: nothing (the wrapped
  backend belongs to its context).
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from ..backends.base import Backend, Buffer, Held, NodeCache, WriteMode, Writer
from .forwarding import ForwardingBackend


class _CountingWriter(Writer):
    def __init__(self, inner: Writer, add: Callable[[int], None]) -> None:
        self.uri, self._inner, self._add = inner.uri, inner, add

    def write(self, data: Buffer) -> int:
        n = self._inner.write(data)
        self._add(n)
        return n

    def write_borrowed(self, data: Buffer) -> int:
        n = self._inner.write_borrowed(data)
        self._add(n)
        return n

    def mark_boundary(self) -> None:
        self._inner.mark_boundary()

    def local_fileno(self) -> int | None:
        return None  # declined: a caller writing to the descriptor would bypass the count

    def flush(self) -> None:
        self._inner.flush()

    def close(self) -> None:
        self._inner.close()

    def abort(self) -> None:
        self._inner.abort()


class CountingBackend(ForwardingBackend):
    """``inner`` with every byte read or written reported to ``add`` (see the module docstring)."""

    def __init__(self, inner: Backend, add: Callable[[int], None]) -> None:
        super().__init__(inner)
        self._add = add
        self.name = inner.name

    def __repr__(self) -> str:
        return f"<CountingBackend over {self.inner!r}>"

    # ---- counted -----------------------------------------------------------------------------
    def read_range(self, uri: str, start: int = 0, end: int | None = None) -> bytes:
        data = self.inner.read_range(uri, start, end)
        self._add(len(data))
        return data

    def readinto(self, uri: str, buf: Buffer, offset: int = 0) -> int:
        n = self.inner.readinto(uri, buf, offset)
        self._add(n)
        return n

    def readv(self, uri: str, views: Sequence[memoryview], offset: int = 0) -> int:
        n = self.inner.readv(uri, views, offset)
        self._add(n)
        return n

    def read_head(self, uri: str, buf: Buffer, on_size: Callable[[int], None]) -> int:
        n = self.inner.read_head(uri, buf, on_size)
        self._add(n)
        return n

    def start_read_tail(self, uri: str, buf: Buffer, align: int = 1) -> cf.Future[int] | None:
        return None  # declined: its bytes may overlap another read's (or go unused), and counted reads must not

    def held(self, uri: str) -> Held | None:
        return None  # declined: every byte read must come through this wrapper to be counted

    def open_writer(self, uri: str, *, mode: WriteMode = "overwrite", durable: bool = True) -> Writer:
        return _CountingWriter(self.inner.open_writer(uri, mode=mode, durable=durable), self._add)

    # ---- forwarded (the rest: ForwardingBackend) ---------------------------------------------
    @contextlib.contextmanager
    def get_local_path(self, uri: str) -> Iterator[str]:
        with self.inner.get_local_path(uri) as p:
            yield p

    # ---- capabilities ------------------------------------------------------------------------
    @contextlib.contextmanager
    def local_file(self, uri: str) -> Iterator[str | None]:
        with self.inner.local_file(uri) as path:
            yield path
            if path is not None:  # the caller read the file itself: count the object as read
                self._add(os.path.getsize(path))  # the file holds exactly the object's bytes

    def assembled(self, uri: str) -> bool:
        return self.inner.assembled(uri)

    def for_checked_reads(self, uri: str) -> Backend:
        inner = self.inner.for_checked_reads(uri)
        return self if inner is self.inner else CountingBackend(inner, self._add)

    def with_options(self, **options: Any) -> Backend:
        inner = self.inner.with_options(**options)
        return self if inner is self.inner else CountingBackend(inner, self._add)

    def pin_version(self, uri: str, version: str | None = None) -> Backend:
        pinned = self.inner.pin_version(uri, version)
        return self if pinned is self.inner else CountingBackend(pinned, self._add)

    @property
    def node_cache(self) -> NodeCache | None:
        return self.inner.node_cache

    def close(self) -> None:  # the wrapped backend belongs to its context, which closes it
        pass

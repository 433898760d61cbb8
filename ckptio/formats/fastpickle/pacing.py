"""What a remote store's replies showed, kept per store for its next loads, and the read sizes drawn
from it (:meth:`.read.BackendSource.read_ahead`).

Per store (the backend under its wrappers), the last few: how long its first reply took to tell an
object's size (headers, not bodies), and how fast one connection streamed a first range that the
object overran (its body, from the size on). The medians decide whether the store is slow to answer
(its object's end is then requested with the first range) and how long a range read ahead should be:
long enough that a request's round trip is a small part of it, so a store with fast connections and
costly requests (a server on a LAN) gets fewer, longer requests, a remote one (20 ms, 90 MB/s a
connection) as many as it needs to be read in parallel.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import statistics
import time
import weakref

from ...backends.base import Backend

KEEP = 5  # replies kept per store
# a range read ahead is at least this, and streams for at least two of the store's first replies
MIDDLE_PIECE = 4 << 20

first_replies: weakref.WeakKeyDictionary[Backend, collections.deque[float]] = weakref.WeakKeyDictionary()
conn_rates: weakref.WeakKeyDictionary[Backend, collections.deque[float]] = weakref.WeakKeyDictionary()


def first_reply(store: Backend) -> float | None:
    """The median time the store's last first replies took to tell the size (None: none yet)."""
    past = first_replies.get(store)
    return statistics.median_high(past) if past else None


def note_first_reply(store: Backend, seconds: float) -> None:
    first_replies.setdefault(store, collections.deque(maxlen=KEEP)).append(seconds)


def note_body(store: Backend, n: int, sized: float, fut: cf.Future[int]) -> None:
    """A done callback for a first range of ``n`` bytes that the object overran (its size came at
    ``sized``, ``time.monotonic()``): one connection's speed, kept for ``store``."""
    took = time.monotonic() - sized
    if not fut.cancelled() and fut.exception() is None and fut.result() == n and took > 0:
        conn_rates.setdefault(store, collections.deque(maxlen=KEEP)).append(n / took)


def middle_piece(store: Backend, n: int, concurrency: int, part_size: int) -> int:
    """The range of a read of ``n`` bytes from ``store`` read ahead: ``n`` cut into equal ranges (so
    they end together), as many as ``concurrency`` connections take, fewer where a range would be
    shorter than MIDDLE_PIECE or than what one connection streams in two of the store's first replies
    (the medians of the last few), none longer than ``part_size`` (which wins over the floor)."""
    least = MIDDLE_PIECE
    rates, reply = conn_rates.get(store), first_reply(store)
    if rates and reply is not None:
        least = max(least, int(2 * statistics.median_high(rates) * reply))
    n, part_size = max(1, n), max(1, part_size)
    piece = min(part_size, max(least, -(-n // max(1, concurrency))))
    k = max(1, n // piece)  # ranges of at least ``piece``...
    if -(-n // k) > part_size:
        k = -(-n // part_size)  # ... unless that makes one longer than part_size
    return -(-n // k)

"""The data objects a DCP load reads: each one's size, looked up once, and a small remote one's bytes
fetched with it.

Before anything is allocated, the reader checks every item's byte range against the size of its
data object (:func:`check_spans`). On an object store a size lookup is a request of its own (a HEAD
took 1-10 ms on the test servers, as long as the GET of a whole 1 MiB object), so for a small
object :class:`DataObjects` takes the size from the reply to one ranged GET of its first bytes, up to
the end of the last item the load needs (``Backend.read_head``), and the reads of those items copy
out of these bytes: a small checkpoint loads with one request per data object, not two.

A head is fetched only where it costs no more than the reads it replaces: for the items a read is
about to fetch (not for a check made earlier, such as the Checkpointer's ``check_tensors``, whose
reader does not read), of an object whose items end within HEAD_MAX bytes and lie mostly in that
range (at most half of it, or HEAD_SLACK, read for nothing), HEADS_MAX bytes in all, held until the
load ends. Heads are fetched one after another, as sizes were looked up, so a few small ones at
most: past HEADS_MAX, sizes are looked up and the items read in parallel. The head's length comes from
``.metadata`` and is capped by HEAD_MAX, so crafted metadata cannot make it allocate more; every
span is checked against the size the reply gave before any item is read. Where reads are local
(local disks, memory) a size lookup is cheap, and sizes are looked up (``stat``).
"""

from __future__ import annotations

from collections.abc import Callable

from torch.distributed.checkpoint.metadata import MetadataIndex

from ..backends.base import Backend
from ..errors import FormatError, IntegrityError
from .layout import METADATA_NAME

__all__ = ["DataObjects", "check_spans"]

HEAD_MAX = 4 << 20  # an object's items end within this many bytes: fetched with its size
HEAD_SLACK = 256 << 10  # bytes a head may fetch outside the items (or half the head, if more)
HEADS_MAX = 4 << 20  # bytes of heads held by one reader until its load ends (fetched one after another)

Span = tuple[int, int, MetadataIndex]  # [start, stop) of an item in its data object


class DataObjects:
    """Sizes of the data objects a reader reads, and the heads of the small remote ones."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.sizes: dict[str, int] = {}
        self._heads: dict[str, memoryview] = {}
        self._held = 0

    def size(self, obj: str, spans: list[Span], reading: bool) -> int:
        """``obj``'s size; fetched with its first bytes when the items at ``spans`` are about to be read
        (``reading``) and that is worth it."""
        if obj not in self.sizes:
            n = self._head_length(spans) if reading else 0
            self.sizes[obj] = self._fetch_head(obj, n) if n else self.backend.stat(obj).size
        return self.sizes[obj]

    def _head_length(self, spans: list[Span]) -> int:
        if self.backend.reads_local or not spans:
            return 0
        stop = max(s[1] for s in spans)
        needed = sum(s[1] - s[0] for s in spans)  # overlapping spans count twice: they are refused anyway
        if stop > HEAD_MAX or self._held + stop > HEADS_MAX or stop - needed > max(stop // 2, HEAD_SLACK):
            return 0
        return stop

    def _fetch_head(self, obj: str, n: int) -> int:
        buf = bytearray(n)
        told: list[int] = []
        got = self.backend.read_head(obj, buf, told.append)
        if not told:  # a backend that did not tell: look it up
            return self.backend.stat(obj).size
        self._heads[obj] = memoryview(buf)[:got]
        self._held += n
        return told[0]

    def copy_out(self, obj: str, start: int, targets: list[tuple[int, int, memoryview]]) -> bool:
        """Fill each ``(a, b, target)`` with bytes ``[a, b)`` of ``obj`` from its head, when the head has
        all of them (``start``: the lowest ``a``); False, with nothing copied, otherwise."""
        head = self._heads.get(obj)
        if head is None or start < 0 or max(b for _, b, _ in targets) > len(head):
            return False
        for a, b, t in targets:
            t[:] = head[a:b]
        return True

    def release(self) -> None:
        """Drop the heads (sizes stay known)."""
        self._heads.clear()
        self._held = 0


def check_spans(
    objects: DataObjects,
    by_object: dict[str, list[Span]],
    malformed: Callable[..., FormatError],
    reading: bool,
) -> None:
    """Each span ``(start, stop, index)`` of each data object lies inside it and overlaps no other.

    ``objects`` gives each object's size (``reading``: the spans are read next, see
    :meth:`DataObjects.size`); ``malformed(index, why, obj)`` builds the error.
    """
    for obj, spans in by_object.items():
        size, end, last = objects.size(obj, spans, reading), 0, None
        for start, stop, index in sorted(spans, key=lambda s: s[:2]):
            if stop > size:
                raise IntegrityError(
                    f"{obj} is truncated, or the checkpoint's {METADATA_NAME} is corrupt or "
                    f"crafted: item {index.fqn!r} has bytes [{start}, {stop}), past its end "
                    f"({size} bytes); nothing was loaded"
                )
            if start < end and last is not None:
                raise malformed(index, f"has bytes [{start}, {stop}), which overlap those of item {last.fqn!r}", obj)
            if stop > end:
                end, last = stop, index

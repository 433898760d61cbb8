"""Incremental checkpoints (``incremental=True``): which content each step references, the saves
that write through the content store, the sweep after retention, and the disk usage report.

A step saved incrementally has ``"content": "xxh3_128"`` in its commit marker and a recipe
(:mod:`ckptio.incremental`) as its data file; its bytes live in ``root/.content``. A save reuses only
content that committed steps reference (read once, at the first save, then kept up to date) or that
it wrote itself. After retention, content no committed step references is deleted once it is older
than ``content_grace`` seconds (so it never races a save in progress, and a killed save's blocks go
at a later save). A step whose recipe cannot be read stops the sweep (a warning): what it references
is unknown.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Mapping
from typing import Any

from .. import uri as _uri
from ..backends.base import Backend
from ..context import resolve
from ..errors import CkptioError, FormatError
from ..incremental import CONTENT_DIR, BlockStore, IncrementalBackend
from .manifest import _DATA_FILE, _FILE_FORMAT, CheckpointWarning, Layout

log = logging.getLogger("ckptio.checkpointer")

CONTENT_KEY = "content"
CONTENT_HASH = "xxh3_128"


def store_for(backend: Backend, root: str) -> BlockStore:
    """The content store of the root (resolved) ``root``."""
    return BlockStore(backend, _uri.join_path(root, CONTENT_DIR))


class Content:
    """The content store of one Checkpointer root and what its committed steps reference."""

    def __init__(self, layout: Layout, grace: float) -> None:
        self.layout, self.grace = layout, float(grace)
        self.store = store_for(layout.backend, layout.root)
        self._refs: dict[int, set[str]] = {}  # step -> hashes its files' recipes name
        self._settled = False
        self.last: tuple[int, int] = (0, 0)  # (logical bytes, bytes written) of the last save

    def write(self, fmt: str, step: int, sd: dict[str, Any], options: Mapping[str, Any]) -> list[str]:
        """Rank 0: write ``sd`` as the ``pt``/``fpk`` data file of ``step`` through the content store."""
        from ..registry import formats

        if not self._settled:
            self.store.settle(self.referenced()[0])
            self._settled = True
        self.store.begin()
        self._refs.pop(step, None)
        name = _DATA_FILE[fmt]
        backend = IncrementalBackend(self.layout.backend, self.store)
        try:
            fmt_obj = formats.by_name(_FILE_FORMAT[fmt])
            assert fmt_obj is not None
            fmt_obj.instance().dump(sd, backend, _uri.join_path(self.layout.dir(step), name), **options)
        finally:
            backend.close()
        self.last = (backend.logical_bytes, backend.bytes_written)
        return [name]

    def referenced(self) -> tuple[set[str], bool]:
        """(every hash a committed step references, whether every recipe could be read)."""
        complete = True
        steps = self.layout.list()
        for s in list(self._refs):
            if s not in steps:
                del self._refs[s]
        reader = IncrementalBackend(self.layout.backend, self.store)
        try:
            for s in steps:
                if s in self._refs:
                    continue
                try:
                    self._refs[s] = step_hashes(self.layout, s, reader)
                except (FormatError, FileNotFoundError) as e:
                    warnings.warn(
                        f"{self.layout.uri(s)}: cannot read its recipe ({e})", CheckpointWarning, stacklevel=2
                    )
                    complete = False
        finally:
            reader.close()
        return set().union(*self._refs.values()), complete

    def sweep(self) -> None:
        """After retention: known := what kept steps reference; delete the rest once past the grace period."""
        refs, complete = self.referenced()
        self.store.settle(refs)
        self._settled = True
        if not complete:
            warnings.warn(
                f"{self.layout.root_uri}: content not swept, a step's recipe cannot be read",
                CheckpointWarning,
                stacklevel=2,
            )
            return
        count, size = self.store.sweep(refs, self.grace)
        if count:
            log.info("swept %d content object(s), %d bytes, under %s", count, size, self.layout.root_uri)


def step_hashes(layout: Layout, step: int, reader: IncrementalBackend) -> set[str]:
    """The hashes the data files of committed ``step`` reference (none when it is not incremental)."""
    m = layout.manifest(step)
    if m.get(CONTENT_KEY) is None or m.get("format") not in _DATA_FILE:
        return set()
    out: set[str] = set()
    for name in m.get("files") or [_DATA_FILE[m["format"]]]:
        if name in ("", ".", "..") or any(c in name for c in "/\\:\0"):
            raise FormatError(f"{layout.user_uri(step, 'checkpoint.json')}: file name {name!r}")
        r = reader.recipe(_uri.join_path(layout.dir(step), name))
        if r is not None:
            out.update(r.hashes)
    return out


def read_backend(d: str, cache: Any) -> tuple[IncrementalBackend, str]:
    """The backend to read the incremental checkpoint directory ``d`` (a URI) through, and ``d`` resolved."""
    backend, resolved = resolve(d, cache=cache)
    return IncrementalBackend(backend, store_for(backend, _uri.parent(resolved.rstrip("/")))), resolved


def usage(root_uri: str) -> dict[str, Any]:
    """Disk usage of a Checkpointer root: per committed step its logical bytes (what a load reads)
    and the bytes only it holds (deleting it alone frees them), and the root's physical bytes."""
    layout = Layout(root_uri.rstrip("/") or root_uri)
    store = store_for(layout.backend, layout.root)
    reader = IncrementalBackend(layout.backend, store)
    sizes = store.sizes()
    users: dict[str, int] = {}
    rows: list[tuple[int, int, int, set[str]]] = []
    try:
        for s in layout.list():
            own = sum(i.size for i in layout.backend.list(layout.dir(s), recursive=True) if not i.is_dir)
            logical, hashes = own, set[str]()
            m = layout.manifest(s)
            if m.get(CONTENT_KEY) is not None and m.get("format") in _DATA_FILE:
                hashes = step_hashes(layout, s, reader)
                logical = sum(reader.stat(_uri.join_path(layout.dir(s), n)).size for n in m.get("files") or [])
            for h in hashes:
                users[h] = users.get(h, 0) + 1
            rows.append((s, logical, own, hashes))
    finally:
        reader.close()
    out = []
    for s, logical, files_bytes, hashes in rows:
        own = files_bytes + sum(sizes.get(h, 0) for h in hashes if users[h] == 1)
        out.append({"step": s, "logical_bytes": logical, "own_bytes": own, "incremental": bool(hashes)})
    try:
        physical = sum(i.size for i in layout.backend.list(layout.root, recursive=True) if not i.is_dir)
    except (FileNotFoundError, NotADirectoryError) as e:
        raise CkptioError(f"{root_uri}: cannot list the root ({e})") from e
    return {
        "root": root_uri,
        "steps": out,
        "content_bytes": sum(sizes.values()),
        "unreferenced_content_bytes": sum(n for h, n in sizes.items() if h not in users),
        "physical_bytes": physical,
    }

"""Incremental checkpoints (``incremental=True``): which content each step references, the saves
that write through the content store, the sweep after retention, and the disk usage report.

A step saved incrementally has ``"content": "xxh3_128"`` in its commit marker and a recipe
(:mod:`ckptio.incremental`) as each data file (``pt``/``fpk``: the one file; ``dcp``: every data object
its ``.metadata`` names; ``.metadata`` stays plain); its bytes live in ``root/.content``. A save
reuses only content that committed steps reference or that it wrote itself: ``pt``/``fpk`` (rank 0)
read every kept step's recipes once, at the first save, then keep them up to date; with ``dcp`` each
rank, at each save, reads the recipes of its own data objects (``__<rank>_*``; all of them when the
world size changed) in the latest committed step, which retention never deletes (when that step
is its own last save, it knows them already). After retention,
content no committed step references is deleted once it is older than ``content_grace`` seconds (so
it never races a save in progress, and a killed save's blocks go at a later save). A step whose
recipe cannot be read stops the sweep (a warning): what it references is unknown.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Mapping
from typing import Any

from .. import uri as _uri
from ..backends.base import Backend
from ..errors import CkptioError, FormatError, logger
from ..incremental import CONTENT_DIR, BlockStore, IncrementalBackend
from .manifest import _DATA_FILE, _FILE_FORMAT, MARKER_NAME, CheckpointWarning, Layout, _check_manifest

log = logger("ckptio.checkpointer")

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
        self._mine: tuple[int, set[str]] | None = None  # (step, blocks its recipes name) of this rank's last save
        # that save is the whole step (pt/fpk, or DCP without a process group): its commit reads no recipe back
        self._mine_whole = False
        self._due = 0.0  # when a sweep may next delete something (0: unknown, sweep at the next commit)

    def _failed(self) -> None:
        """A save failed: what it wrote is unreferenced, and old enough to sweep after the grace period."""
        self._due = min(self._due, time.time() + self.grace)

    def write(self, fmt: str, step: int, sd: dict[str, Any], options: Mapping[str, Any]) -> list[str]:
        """Rank 0: write ``sd`` as the ``pt``/``fpk`` data file of ``step`` through the content store."""
        from ..registry import formats

        if not self._settled:
            self.store.settle(self.referenced()[0])
            self._settled = True
        self.store.begin()
        self._replacing(step)
        name = _DATA_FILE[fmt]
        backend = IncrementalBackend(self.layout.backend, self.store)
        try:
            fmt_obj = formats.by_name(_FILE_FORMAT[fmt])
            assert fmt_obj is not None
            fmt_obj.instance().dump(sd, backend, _uri.join_path(self.layout.dir(step), name), **options)
        except BaseException:
            self._failed()
            raise
        finally:
            backend.close()
        self.last = (backend.logical_bytes, backend.bytes_written)
        self._mine, self._mine_whole = (step, backend.referenced), True
        return [name]

    def write_dcp(self, step: int, sd: dict[str, Any], pg: Any, options: Mapping[str, Any], rank: int) -> list[str]:
        """Every rank: write ``sd`` as the DCP checkpoint of ``step``, its data objects through the content
        store; ``last`` is the sum over ranks."""
        from .formats import write_dcp  # imports torch: only when a DCP step is saved

        self.store.settle(self._latest_hashes(rank))
        self._replacing(step)
        backend = IncrementalBackend(self.layout.backend, self.store)
        try:
            files = write_dcp(sd, self.layout.uri(step), pg, {**options, "backend": backend})
        except BaseException:
            self._failed()
            raise
        finally:
            backend.close()
        counts = [backend.logical_bytes, backend.bytes_written]
        if pg is not None:
            import torch
            import torch.distributed as dist

            t = torch.tensor(counts, dtype=torch.int64, device="cpu")
            dist.all_reduce(t, group=pg)
            counts = t.tolist()
        self.last = (counts[0], counts[1])
        self._mine, self._mine_whole = (step, backend.referenced), pg is None
        self._settled = False  # rank 0's sweep settles the store again after the commit
        return files

    def _replacing(self, step: int) -> None:
        if self._refs.pop(step, None) is not None:  # a committed step saved again: its content may go
            self._due = 0.0

    def _latest_hashes(self, rank: int) -> set[str]:
        """What this rank's data objects of the latest committed step reference (DCP saves)."""
        step = self.layout.latest()
        if step is None:
            return set()
        if self._mine is not None and self._mine[0] == step:  # this rank's own last save: known already
            return set(self._mine[1])
        reader = IncrementalBackend(self.layout.backend, self.store, confirm_sizes=False)
        try:
            uris = data_files(self.layout, step)
            mine = [u for u in uris if _uri.basename(u).startswith(f"__{rank}_")]
            out: set[str] = set()
            for u in mine or uris:
                r = reader.recipe(u)
                if r is not None:
                    out.update(r.hashes)
            return out
        except (FormatError, FileNotFoundError) as e:  # write everything this time
            log.warning("%s: cannot read its recipes (%s); this save writes all its content", self.layout.uri(step), e)
            return set()
        finally:
            reader.close()

    def referenced(self, steps: list[int] | None = None) -> tuple[set[str], bool]:
        """(every hash a committed step references, whether every recipe could be read); ``steps``: the
        committed steps when the caller just listed them (default: list them)."""
        complete = True
        steps = self.layout.list() if steps is None else steps
        for s in list(self._refs):
            if s not in steps:  # deleted (retention, delete()): its content may go
                del self._refs[s]
                self._due = 0.0
        reader = IncrementalBackend(self.layout.backend, self.store, confirm_sizes=False)
        try:
            for s in steps:
                if s in self._refs:
                    continue
                if self._mine_whole and self._mine is not None and self._mine[0] == s:  # written here just now
                    self._refs[s] = set(self._mine[1])
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

    def sweep(self, steps: list[int] | None = None) -> None:
        """After retention (which found the committed ``steps``, default: list them): known := what kept
        steps reference; delete the rest once past the grace period.

        The content listing is skipped while nothing can be due: no step was deleted or replaced and
        no failed save's or earlier sweep's leftovers are past the grace period yet (a new Checkpointer
        sweeps at its first commit, for what killed processes left)."""
        refs, complete = self.referenced(steps)
        self.store.settle(refs)
        self._settled = True
        if time.time() < self._due:
            return
        if not complete:
            warnings.warn(
                f"{self.layout.root_uri}: content not swept, a step's recipe cannot be read",
                CheckpointWarning,
                stacklevel=2,
            )
            return
        count, size, self._due = self.store.sweep(refs, self.grace)
        if count:
            log.info("swept %d content object(s), %d bytes, under %s", count, size, self.layout.root_uri)


def data_files(layout: Layout, step: int) -> list[str]:
    """The (resolved) URIs of the data files of committed incremental ``step`` (none when it is not
    incremental): ``pt``/``fpk`` the marker's file, ``dcp`` the data objects its ``.metadata`` names."""
    m = layout.manifest(step)
    _, fmt, _ = _check_manifest(m, layout.user_uri(step, MARKER_NAME))  # its file names too
    if m.get(CONTENT_KEY) is None:
        return []
    d = layout.dir(step)
    if fmt == "dcp":
        from ..dcp import METADATA_NAME, loads_metadata
        from ..dcp.metadata import data_objects

        meta = _uri.join_path(d, METADATA_NAME)
        return sorted(
            set(data_objects(loads_metadata(layout.backend.read(meta), meta), layout.backend, d, meta).values())
        )
    return [_uri.join_path(d, name) for name in m.get("files") or [_DATA_FILE[fmt]]]


def step_hashes(layout: Layout, step: int, reader: IncrementalBackend) -> set[str]:
    """The hashes the data files of committed ``step`` reference (none when it is not incremental)."""
    out: set[str] = set()
    for u in data_files(layout, step):
        r = reader.recipe(u)
        if r is not None:
            out.update(r.hashes)
    return out


def usage(root_uri: str) -> dict[str, Any]:
    """Disk usage of a Checkpointer root: per committed step its logical bytes (what a load reads)
    and the bytes only it holds (deleting it alone frees them), and the root's physical bytes."""
    layout = Layout(root_uri.rstrip("/") or root_uri)
    store = store_for(layout.backend, layout.root)
    reader = IncrementalBackend(layout.backend, store, confirm_sizes=False)
    sizes = store.sizes()
    users: dict[str, int] = {}
    rows: list[tuple[int, int, int, set[str]]] = []
    try:
        for s in layout.list():
            own = sum(i.size for i in layout.backend.list(layout.dir(s), recursive=True) if not i.is_dir)
            logical, hashes = own, set[str]()
            files = data_files(layout, s)
            if files:
                hashes = step_hashes(layout, s, reader)
                logical = own + sum(reader.stat(u).size - layout.backend.stat(u).size for u in files)
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

"""The one copy engine: objects from any backend to any backend.

``ckptio.copyfile`` / ``ckptio.copytree`` (:mod:`ckptio.io`, mmengine semantics) and ``ckptio cp``
(:func:`copy`) all move bytes through :func:`copy_object` and :func:`copy_objects`:

* one backend on both sides uses the backend's own ``copy`` (server-side on object stores);
  across backends an object streams through a bounded buffer of ranged reads into an atomic writer,
  so an interrupted copy never leaves a partial destination object;
* the ranged reads of one object all come from one version of it (the one listed, when listed): a
  source replaced while it is copied is an IntegrityError naming it, and nothing is written;
* a tree copy refuses keys that would leave the destination (``../``, absolute keys) and, on the
  local filesystem, symlinks already in the destination that point outside it;
* ``jobs`` objects move in parallel; ``progress(bytes_done, bytes_total)`` sees a monotonic count.

:func:`copy` adds what ``ckptio cp`` offers on top: a file or (``recursive=True``) a directory,
a destination directory receiving the source's basename, and resumption (``skip_existing``).
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import math
import os
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from . import uri as _uri
from .backends.base import Backend, ObjectInfo, WriteMode
from .backends.local import ensure_inside
from .context import resolve
from .errors import IsDirectoryError, NotFoundError, UnsafeKeyError, replaced
from .progress import CountingWriter, Tracker
from .threads import Pool


@dataclasses.dataclass
class CopyResult:
    copied: list[str]
    skipped: list[str]
    bytes_copied: int
    seconds: float


def path_kind(backend: Backend, uri: str) -> str:
    """``"file"`` or ``"dir"``; NotFoundError when neither exists."""
    try:
        return "dir" if backend.stat(uri).is_dir else "file"
    except FileNotFoundError:
        if backend.isdir(uri):
            return "dir"
        raise NotFoundError(uri, "no such object or directory") from None


def relative_key(root: str, child: str, named: Any = None) -> str:
    """``child``'s key below ``root``; UnsafeKeyError when it would escape (``../``, absolute)."""
    rel = child[len(root.rstrip("/")) :].lstrip("/")
    if not rel or rel.startswith("../") or "/../" in f"/{rel}/" or os.path.isabs(rel):
        raise UnsafeKeyError(f"refusing to copy {child!r}: its key escapes {root if named is None else named!r}")
    return rel


def tree_targets(
    infos: Iterable[ObjectInfo], src: str, dst_backend: Backend, dst: str, *, named: Any = None
) -> list[tuple[ObjectInfo, str]]:
    """(source object, destination URI) for every object (not directory) in ``infos`` listed under
    ``src``, each at its relative key under ``dst``. Every key is checked before anything is copied."""
    pairs = []
    for info in infos:
        if not info.is_dir:
            target = _uri.join_path(dst, *relative_key(src, info.uri, named).split("/"))
            ensure_inside(dst_backend, dst, target)
            pairs.append((info, target))
    return pairs


def _discard_pending(backend: Backend, under: str, pairs: Sequence[tuple[ObjectInfo, str]]) -> None:
    """Abort the pending writes (a killed copy's debris) to the destinations of ``pairs`` under ``under``."""
    targets = {t for _, t in pairs}
    try:
        pending = [w for w in backend.list_pending_writes(under) if w.uri in targets]
    except (FileNotFoundError, NotADirectoryError):
        return
    for w in pending:
        backend.abort_pending_write(w)


def up_to_date(src: ObjectInfo, dst_backend: Backend, dst: str) -> bool:
    """Whether ``dst`` has ``src``'s size and an equal version or an mtime at least as new."""
    try:
        d = dst_backend.stat(dst)
    except FileNotFoundError:
        return False
    if d.is_dir or d.size != src.size:
        return False
    if src.version is not None and src.version == d.version:
        return True
    # object stores report whole seconds: a copy made in the same second as the source's change counts as newer
    return src.mtime is None or d.mtime is None or d.mtime >= math.floor(src.mtime)


def copy_object(
    src_backend: Backend,
    src: str,
    dst_backend: Backend,
    dst: str,
    *,
    size: int | None = None,
    version: str | None = None,
    mode: WriteMode = "overwrite",
    add: Callable[[int], None] | None = None,
    chunk_max: int | None = None,
) -> None:
    """Copy one object. ``size`` and ``version`` (when the caller listed it) save a ``stat``; ``add``
    hears bytes as they are written; ``chunk_max`` bounds the buffer (default: ``part_size * concurrency``).

    Every read of ``src`` comes from one version of it (``Backend.pin_version``: ``version``, else the
    first one seen); where the backend cannot pin, its version is looked up again after the last read.
    A source replaced meanwhile is an IntegrityError and the destination is not written."""
    if src_backend is dst_backend:
        src_backend.copy(src, dst, mode=mode)
        if add is not None:
            add(src_backend.stat(src).size if size is None else size)
        return
    reads = src_backend.pin_version(src, version)
    if size is None or (version is None and reads is src_backend):
        info = reads.stat(src)
        size, version = info.size, info.version
    if chunk_max is None:
        chunk_max = src_backend.part_size * src_backend.concurrency
    buf = bytearray(min(max(size, 1), chunk_max))
    mv, pos = memoryview(buf), 0
    with dst_backend.open_writer(dst, mode=mode) as w:
        out = w if add is None else CountingWriter(w, add)
        while pos < size:
            n = reads.readinto(src, mv[: min(len(mv), size - pos)], pos)
            if n <= 0:
                raise NotFoundError(src, f"object shrank while copying at byte {pos} of {size}")
            out.write(mv[:n])
            pos += n
        if reads is src_backend and version is not None:  # unpinned: the same version still, or no commit
            now = src_backend.stat(src).version
            if now != version:
                raise replaced(src, version, now)


def copy_objects(
    src_backend: Backend,
    pairs: Sequence[tuple[ObjectInfo, str]],
    dst_backend: Backend,
    *,
    jobs: int = 1,
    mode: WriteMode = "overwrite",
    progress: Callable[[int, int], None] | None = None,
) -> int:
    """Copy every (source object, destination URI) pair, ``jobs`` at a time; returns bytes copied.
    On the first failure the objects not yet started are cancelled and the error is raised."""
    tracker = Tracker(sum(i.size for i, _ in pairs), progress)
    jobs = max(1, int(jobs))
    chunk_max = max(src_backend.part_size, src_backend.part_size * src_backend.concurrency // jobs)

    def one(info: ObjectInfo, target: str) -> None:
        copy_object(
            src_backend,
            info.uri,
            dst_backend,
            target,
            size=info.size,
            version=info.version,
            mode=mode,
            add=tracker.add,
            chunk_max=chunk_max,
        )

    if jobs == 1 or len(pairs) <= 1:
        for info, target in pairs:
            one(info, target)
    else:
        with Pool(min(jobs, len(pairs)), thread_name_prefix="ckptio-cp") as pool:
            futs = [pool.submit(one, i, t) for i, t in pairs]
            try:
                for f in cf.as_completed(futs):
                    f.result()
            except BaseException:
                for f in futs:
                    f.cancel()
                raise
    return tracker.done


def copy(
    src: str,
    dst: str,
    *,
    recursive: bool = False,
    jobs: int = 4,
    skip_existing: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> CopyResult:
    """Copy an object, or (``recursive=True``) every object under a prefix, from any backend to any backend.

    A ``dst`` ending in ``/`` or naming an existing directory receives the source's basename.
    ``skip_existing`` (``cp --resume``) continues an interrupted copy: destination objects with the
    source's size and an equal version, or an mtime at least as new, are left alone. It is opt-in
    because a same-size, newer but different destination would be skipped too (checkpoints of one
    model all have the same size). It also discards what a killed copy left of writes to the
    targets (local temporary files, S3 multipart uploads). ``jobs`` files move in parallel. A
    directory without ``recursive`` raises IsADirectoryError.
    """
    t0 = time.perf_counter()
    sb, s = resolve(src)
    db, d = resolve(dst)
    single = path_kind(sb, s) == "file"
    if single:
        if dst.endswith("/") or db.isdir(d):
            d = _uri.join_path(d, _uri.basename(s))
        ensure_inside(db, d, d)
        pairs = [(sb.stat(s), d)]
    elif not recursive:
        raise IsDirectoryError(f"{src} is a directory; pass -r (recursive=True) to copy it recursively")
    else:
        pairs = tree_targets(sb.list(s, recursive=True), s, db, d)
    if skip_existing:
        _discard_pending(db, _uri.parent(d) if single else d, pairs)
    todo, skipped = [], []
    for info, target in pairs:
        if skip_existing and up_to_date(info, db, target):
            skipped.append(target)
        else:
            todo.append((info, target))
    done = copy_objects(sb, todo, db, jobs=jobs, progress=progress)
    return CopyResult([t for _, t in todo], skipped, done, time.perf_counter() - t0)

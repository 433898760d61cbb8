"""The content objects under ``<root>/.content``: which are known, writing, reading and sweeping them.

A block is *known* when a committed step references it (:meth:`BlockStore.settle`, called by the
owner with what its committed steps reference) or the save in progress wrote it (since the last
:meth:`BlockStore.begin`); a writer skips known blocks. Writes use ``mode="create"``: an object that
already exists holds the same bytes (its name is their hash), so ``AlreadyExistsError`` is success.
Reads check each block's xxh3-128 (unless the caller checks every byte itself:
``Backend.for_checked_reads``); a mismatch, a short or missing object is an
:class:`IntegrityError` naming the content object and the file that uses it. A content object the
backend has as a local file (``Backend.file_path``, ``Backend.local_file``) is read in
``osio.HOT_PIECE`` pieces into the caller's buffer (which the caller faults in first) and hashed piece
by piece while each is still in the CPU cache, so the check costs a fraction of a second pass over
memory (a caller checking the bytes itself gets each piece too: ``each``); other storages read the
block whole.
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
import re
import stat
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import xxhash

from .. import uri as _uri
from ..backends.base import Backend, Buffer, ObjectInfo
from ..errors import IntegrityError, TransferError, note
from ..osio import open_for_reading, preadinto, preadinto_each, translated
from ..threads import Pool

CONTENT_DIR = ".content"
_NAME = re.compile(r"([0-9a-f]{2})/([0-9a-f]{32})")


def block_hash(data: Buffer) -> str:
    return xxhash.xxh3_128_hexdigest(data)


# The largest block a writer cuts: on storage keeping content objects as plain local files, 64 MiB (a
# 58 MiB payload is one file, not four): the kernel reads a file it no longer caches back into small
# page-cache folios until its readahead has run long enough, which a 16 MiB file never does, and copies
# out of small folios cost more (1 GiB, 16 MiB blocks: cold restores 1.06-1.12x a full one, the next
# restore from what they left 1.25-1.36x; 64 MiB blocks: 0.96x and 1.01x). Elsewhere 16 MiB: more
# requests in flight for a remote read, smaller uploads. Blocks a writer copies (bytes not lent to it,
# ``Writer.write_borrowed``) stay at most COPIED_MAX_BLOCK: up to ``concurrency`` of them are in memory.
LOCAL_MAX_BLOCK = 64 << 20
REMOTE_MAX_BLOCK = COPIED_MAX_BLOCK = 16 << 20


class BlockStore:
    """The content objects of one root, on ``backend`` under ``content_dir`` (a resolved URI).
    ``max_block``: the largest block a writer cuts (default :data:`LOCAL_MAX_BLOCK` where the content
    objects are plain local files, else :data:`REMOTE_MAX_BLOCK`)."""

    def __init__(
        self, backend: Backend, content_dir: str, *, min_block: int = 1 << 20, max_block: int | None = None
    ) -> None:
        self.backend, self.dir = backend, content_dir.rstrip("/")
        # where the storage keeps content objects as plain files (Backend.file_path): each block is
        # opened at its path, without a lookup per block (a restore opens one per 1-64 MiB)
        files = backend.file_path(self.dir)
        self._files = None if files is None else files.rstrip("/")
        if max_block is None:
            max_block = LOCAL_MAX_BLOCK if self._files is not None else REMOTE_MAX_BLOCK
        if not 0 < min_block <= max_block:
            raise ValueError(f"need 0 < min_block <= max_block, got {min_block}, {max_block}")
        self.min_block, self.max_block = int(min_block), int(max_block)
        self._lock = threading.Lock()
        self._known: set[str] = set()
        self._fresh: set[str] = set()
        self._sizes: dict[str, int] = {}  # hash -> the size its content object was found to have
        # the storage is local (a read costs CPU time, not waiting): its files have paths, or a block
        # was read from a local file (Backend.local_file)
        self.local_reads = files is not None

    def uri(self, h: str) -> str:
        """The content object of hash ``h`` (32 lowercase hex digits, checked by the recipe parser)."""
        return _uri.join_path(self.dir, h[:2], h)

    # ---- known blocks ---------------------------------------------------------------------------
    def settle(self, referenced: Iterable[str]) -> None:
        """Known := what committed steps reference (a save just committed, or steps were deleted)."""
        with self._lock:
            self._known = set(referenced)
            self._fresh.clear()

    def begin(self) -> None:
        """A save starts: forget what an earlier, failed save wrote (a sweep may remove it)."""
        with self._lock:
            self._fresh.clear()

    def claim(self, h: str) -> bool:
        """True when ``h`` must be written (unknown); it is known from now on."""
        with self._lock:
            if h in self._known or h in self._fresh:
                return False
            self._fresh.add(h)
            return True

    def unclaim(self, h: str) -> None:
        with self._lock:
            self._fresh.discard(h)

    # ---- one block ------------------------------------------------------------------------------
    def put(self, h: str, data: Buffer, durable: bool = True) -> int:
        """Write block ``h``; returns the bytes written (0 when it already existed)."""
        try:
            self.backend.write(self.uri(h), data, mode="create", durable=durable)
        except FileExistsError:
            return 0
        return memoryview(data).nbytes

    def read_into(
        self,
        h: str,
        out: memoryview,
        file_uri: str,
        check: bool = True,
        each: Callable[[memoryview], Any] | None = None,
    ) -> None:
        """Fill ``out`` (the block's length) with block ``h``, its hash checked (``check``; its length always).
        ``each``: called with consecutive parts of ``out`` in order as they are read (a local block's
        pieces while still in the CPU cache; else the block once read)."""
        # the hot path (plain files, a restore opens one per 1-64 MiB, beside another thread's copies, where
        # every line of Python costs several times its quiet cost): the URI is only made for an error
        with self._naming(h, file_uri):
            if self._files is not None:  # plain files: opened as they are, a missing one raises
                n, digest = _read_hashed(f"{self._files}/{h[:2]}/{h}", out, check, each)
                ok = n == len(out) and (not check or digest == h)
            else:
                u = self.uri(h)
                with self.backend.local_file(u) as path:
                    if path is None:
                        n = self.backend.readinto(u, out, 0)
                        ok = n == len(out) and (not check or block_hash(out) == h)
                        if ok and each is not None:
                            each(out)
                    else:
                        self.local_reads = True
                        n, digest = _read_hashed(path, out, check, each)
                        ok = n == len(out) and (not check or digest == h)
        if not ok:
            raise self._damaged(h, file_uri, f"{n} of {len(out)} bytes read, hash mismatch or short")

    def check_sizes(self, blocks: Iterable[tuple[str, int]], file_uri: str, threads: int = 1) -> None:
        """Each block's content object is a file holding the length its recipe says (IntegrityError naming
        the first that does not, or is missing): a reader allocates from a recipe's size, which is then
        what the storage holds. ``threads``: lookups at once (object stores: one request a block), a few
        rounds of them at a time. Confirmed sizes are remembered; a read checks the length again."""
        lengths: dict[str, set[int]] = {}
        for h, n in blocks:
            lengths.setdefault(h, set()).add(n)
        todo = [h for h, ns in lengths.items() if ns != {self._sizes.get(h)}]

        def size(h: str) -> int:
            return self._stored_size(h, file_uri)

        with contextlib.ExitStack() as stack:
            run: Callable[..., Iterator[int]] = map
            if threads > 1 and len(todo) > 1:
                run = stack.enter_context(Pool(min(threads, len(todo)), thread_name_prefix="ckptio-sizes")).map
            step = 4 * max(1, threads)
            for i in range(0, len(todo), step):
                part = todo[i : i + step]
                found = list(run(size, part))
                for h, got in zip(part, found, strict=True):
                    bad = next((n for n in lengths[h] if n != got), None)
                    if bad is not None:
                        raise self._damaged(h, file_uri, f"{got} bytes where its recipe says {bad}")
                with self._lock:
                    self._sizes.update(zip(part, found, strict=True))

    def _stored_size(self, h: str, file_uri: str) -> int:
        with self._naming(h, file_uri):
            if self._files is None:
                info = self.backend.stat(self.uri(h))
                if info.is_dir:
                    raise IsADirectoryError(errno.EISDIR, "Is a directory")
                return info.size
            st = os.stat(f"{self._files}/{h[:2]}/{h}")
            if stat.S_ISDIR(st.st_mode):
                raise IsADirectoryError(errno.EISDIR, "Is a directory")
            if not stat.S_ISREG(st.st_mode):
                raise OSError(errno.ESPIPE, "Not a regular file")
            return st.st_size

    def _damaged(self, h: str, file_uri: str, why: str) -> IntegrityError:
        return IntegrityError(
            f"{file_uri}: its content object {self.uri(h)} is damaged ({why}); every checkpoint using it fails to load"
        )

    @contextlib.contextmanager
    def _naming(self, h: str, file_uri: str) -> Iterator[None]:
        """OS errors reading block ``h`` for ``file_uri`` as errors naming both."""
        try:
            yield
        except (FileNotFoundError, NotADirectoryError):  # no such file, or a file where its folder should be
            raise IntegrityError(f"{file_uri}: its content object {self.uri(h)} is missing") from None
        except IsADirectoryError:
            raise IntegrityError(f"{file_uri}: its content object {self.uri(h)} is a directory, not a file") from None
        except OSError as e:
            if e.errno == errno.ESPIPE:
                raise IntegrityError(
                    f"{file_uri}: its content object {self.uri(h)} is not a regular file (a pipe?)"
                ) from None
            u = self.uri(h)
            err = translated(e, u)
            if err is e:  # no better name for it: one naming the object and the file using it
                err = TransferError(e.errno or errno.EIO, f"{file_uri}: its content object {u}: {e.strerror or e}", u)
            else:
                note(err, f"reading {file_uri}, which uses it")
            try:
                raise err from e
            finally:  # the error's traceback holds this frame: no reference cycle
                del err

    # ---- sweep ------------------------------------------------------------------------------------
    def sweep(self, referenced: set[str], grace: float) -> tuple[int, int, float]:
        """Delete content objects not in ``referenced`` and older than ``grace`` seconds (objects whose
        age the storage does not report only when ``grace`` is 0); returns (objects, bytes) deleted and
        when the next of those left becomes old enough (``inf``: none)."""
        now = time.time()
        count = size = 0
        due = math.inf
        for info, h in self._entries():
            if h in referenced or (info.mtime is None and grace > 0):
                continue
            if info.mtime is not None and info.mtime > now - grace:
                due = min(due, info.mtime + grace)
                continue
            with contextlib.suppress(FileNotFoundError):
                self.backend.delete(info.uri)
                count, size = count + 1, size + info.size
        return count, size, due

    def sizes(self) -> dict[str, int]:
        """Hash -> stored size of every content object."""
        return {h: info.size for info, h in self._entries()}

    def _entries(self) -> Iterator[tuple[ObjectInfo, str]]:
        """(info, hash) of every content object (temporary files and other names are skipped)."""
        prefix = self.dir + "/"
        try:
            entries = list(self.backend.list(self.dir, recursive=True))
        except (FileNotFoundError, NotADirectoryError):
            return
        for info in entries:
            m = _NAME.fullmatch(info.uri[len(prefix) :]) if info.uri.startswith(prefix) else None
            if not info.is_dir and m is not None and m.group(1) == m.group(2)[:2]:
                yield info, m.group(2)


def _read_hashed(
    path: str, out: memoryview, check: bool = True, each: Callable[[memoryview], Any] | None = None
) -> tuple[int, str]:
    """Read the local file ``path`` into ``out`` (faulted in by the caller) in ``HOT_PIECE`` pieces, each
    hashed (``check``) and handed to ``each`` right after its read; returns (bytes read, hex xxh3-128 of
    them; "" unless ``check``). Neither: one read. OS errors are the caller's to name."""
    hasher = xxhash.xxh3_128() if check else None
    if hasher is None:
        take = each
    elif each is None:
        take = hasher.update
    else:

        def take(piece: memoryview) -> None:
            hasher.update(piece)
            each(piece)

    fd = open_for_reading(path)  # a pipe put in its place: no wait for a writer
    try:
        total = preadinto(fd, out, 0) if take is None else preadinto_each(fd, out, 0, take)
    finally:
        os.close(fd)
    return total, "" if hasher is None else hasher.hexdigest()

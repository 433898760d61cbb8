"""Writing an encoded tree as a ``.fpk`` file: the sinks and the byte stream.

Payloads go out straight from tensor memory, small ones gathered into vectored writes, checksums on
another thread; no staging copy of CPU tensors (device tensors go through one reused, pinned buffer).
A writer that fills a local file (``Writer.local_fileno``) gets ``os.writev`` on its descriptor and,
for durable saves, write-behind with ``sync_file_range``; any other writer gets the pieces one by one,
lent (``Writer.write_borrowed``): it may keep views of them until it is closed.
"""

from __future__ import annotations

import errno
import os
import struct
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import xxhash

from ...backends.base import Writer
from ...osio import WriteBehind, translate_os_errors
from ...threads import executor
from .encode import Encoder, Storage
from .layout import ALIGN, CHUNK, FLAG_PICKLE, FOOTER, FOOTER_MAGIC, HEADER, MAGIC, MAX_IOV, VERSION, align, pack

# Payloads below GATHER are gathered into vectored writes of about this size (and hashed in batches); larger
# ones are written in WRITE_CHUNK pieces. The kernel sizes page-cache folios by the write's length, and large
# folios need high-order free memory, which a VM that hands free memory back to its host (free page
# reporting) has to fault in again: 10,000 100 KiB tensors gathered into 2 MiB writes took 0.28-1.2 s
# (median 0.6 s in the benchmark), into 256 KiB writes a steady 0.32-0.33 s.
GATHER = 256 << 10
WRITE_CHUNK = 16 << 20
HASH_BATCH = 8 << 20

_ZEROS = bytes(ALIGN)
_EMPTY_HASH = xxhash.xxh3_64_intdigest(b"")

_staging_lock = threading.Lock()
_staging: torch.Tensor | None = None


def _get_staging() -> torch.Tensor:
    """One reused host buffer (pinned when CUDA is present) for copying device tensors out."""
    global _staging
    if _staging is None:
        _staging = torch.empty(CHUNK // 2, dtype=torch.uint8, device="cpu", pin_memory=torch.cuda.is_available())
    return _staging


def _cpu_view(data: Any) -> memoryview:
    """The bytes of a CPU storage or numpy array, without a copy (the caller keeps ``data`` alive)."""
    if isinstance(data, np.ndarray):
        return memoryview(data).cast("B")  # type: ignore[arg-type]  # numpy's stubs: ndarray.__buffer__ on 3.12+ only
    # a uint8 tensor over the storage: cheaper than a ctypes array at its address, and it keeps the storage alive
    return memoryview(torch.empty(0, dtype=torch.uint8, device="cpu").set_(data).numpy())  # type: ignore[arg-type]


class Sink:
    """Where a file's bytes go: ``write`` for large buffers, ``writev`` for a batch of small ones.

    A local file is written with ``os.writev`` on its descriptor (thousands of small payloads cost a
    few dozen system calls instead of one each); any other writer gets the pieces one by one, lent
    (``Writer.write_borrowed``: the payloads are tensor memory that stays unchanged until the writer is
    closed, so a writer may keep views instead of copies), and ``mark``
    (``Writer.mark_boundary``) where each payload and the metadata start. ``write_behind`` (a local
    file that will be fsynced): writeback starts as the file is written (:class:`~ckptio.osio.WriteBehind`),
    so the disk works while later payloads are copied and hashed and the final fsync has little left
    to do.
    """

    def __init__(
        self,
        write: Callable[[Any], Any],
        fd: int | None = None,
        name: str = "",
        write_behind: bool = False,
        mark: Callable[[], None] | None = None,
        lend: Callable[[Any], Any] | None = None,
    ) -> None:
        self._write, self.fd, self.name, self.mark = write, fd, name, mark
        self._lend = lend or write
        self._behind = WriteBehind(fd) if write_behind and fd is not None else None

    def expect(self, size: int) -> None:
        """The file will be about ``size`` bytes: writeback starts early in it only (see WriteBehind)."""
        if self._behind is not None:
            self._behind = WriteBehind(self._behind.fd, size)

    def write(self, data: Any) -> None:
        """Write bytes the caller may change as soon as this returns (a reused staging buffer)."""
        if self.fd is not None:  # every byte goes out on the descriptor, so one WriteBehind counts them all
            self._to_fd(data)
        else:
            self._write(data)

    def lend(self, data: Any) -> None:
        """Write bytes that stay unchanged until the writer is closed (tensor memory for the length of a
        save, immutable bytes): a writer may keep a view instead of a copy (``Writer.write_borrowed``)."""
        if self.fd is not None:
            self._to_fd(data)
        else:
            self._lend(data)

    def _to_fd(self, data: Any) -> None:
        mv = memoryview(data).cast("B")
        self.writev([mv], len(mv))

    def writev(self, mvs: list[memoryview], total: int) -> None:
        """Lend ``mvs`` (``total`` bytes in all). Called once per GATHER bytes, so errors are translated
        only when there is one (a context manager per call costs more than the call)."""
        if self.fd is None:
            for m in mvs:
                self._lend(m)
            return
        try:
            n = os.writev(self.fd, mvs)
            left = total
            while n < left:  # short write (a signal, a full disk): finish or raise
                if n <= 0:
                    raise OSError(errno.EIO, f"{self.name}: a write took no bytes")
                left -= n
                while n >= len(mvs[0]):
                    n -= len(mvs[0])
                    mvs = mvs[1:]
                mvs = [mvs[0][n:], *mvs[1:]]
                n = os.writev(self.fd, mvs)
        except OSError as e:
            with translate_os_errors(self.name):
                raise e
        if self._behind is not None:
            self._behind.wrote(total)


def sink_for(w: Writer, durable: bool) -> Sink:
    """The sink for a backend's writer: the descriptor fast path when it fills a local file."""
    fd = w.local_fileno()
    if fd is not None:
        return Sink(w.write, fd, w.uri, write_behind=durable)
    return Sink(w.write, None, w.uri, mark=w.mark_boundary, lend=w.write_borrowed)


def _hash_into(items: list[tuple[Storage, memoryview]]) -> None:
    for s, mv in items:
        s.checksum = xxhash.xxh3_64_intdigest(mv)


def write_stream(enc: Encoder, tree: bytes, out: Sink) -> int:
    """Write the whole file to ``out``; returns its size.

    Payloads go out straight from tensor memory; small ones are gathered into vectored writes of up
    to GATHER bytes. Checksums are computed on another core, off the write path (large payloads one
    by one, small ones in batches), and only the metadata written at the end waits for them.
    """
    flags = FLAG_PICKLE if enc.used_pickle else 0
    header = HEADER.pack(MAGIC, VERSION, flags, ALIGN)
    pos = HEADER.size
    for s in enc.storages:
        s.offset = align(pos)
        pos = s.offset + s.nbytes
    out.expect(pos)
    pos = HEADER.size
    zeros = memoryview(_ZEROS)
    gather: list[memoryview] = [memoryview(header)]
    gathered = len(header)
    to_hash: list[tuple[Storage, memoryview]] = []
    hashing = 0
    futures: list[Any] = []
    cpu_bytes = sum(s.nbytes for s in enc.storages if s.location == "cpu")
    with executor(1, "fpk-hash", cpu_bytes) as hasher:

        def flush() -> None:
            nonlocal gathered
            if gather:
                out.writev(gather, gathered)
                gather.clear()
                gathered = 0

        for s in enc.storages:
            if s.offset > pos:
                gather.append(zeros[: s.offset - pos])
                gathered += s.offset - pos
            pos = s.offset + s.nbytes
            if s.nbytes == 0:
                s.checksum = _EMPTY_HASH
                continue
            if out.mark is not None:  # a writer that cuts blocks where payloads start (incremental saves)
                flush()
                out.mark()
            if s.location != "cpu":
                flush()
                s.checksum = write_device(
                    torch.empty(0, dtype=torch.uint8, device=s.data.device).set_(s.data), out.write
                )
            elif s.nbytes >= GATHER:
                flush()
                mv = _cpu_view(s.data)
                futures.append(hasher.submit(_hash_into, [(s, mv)]))
                step = WRITE_CHUNK if out.fd is not None else s.nbytes  # a remote writer gets it whole (may send it
                for i in range(0, s.nbytes, step):  # straight from tensor memory)
                    out.lend(mv[i : i + step])
            else:
                mv = _cpu_view(s.data)
                to_hash.append((s, mv))
                hashing += s.nbytes
                if hashing >= HASH_BATCH:
                    futures.append(hasher.submit(_hash_into, to_hash))
                    to_hash, hashing = [], 0
                gather.append(mv)
                gathered += s.nbytes
                if gathered >= GATHER or len(gather) >= MAX_IOV:
                    flush()
        flush()
        if out.mark is not None:
            out.mark()
        _hash_into(to_hash)
        for fut in futures:
            fut.result()
    meta = pack(
        {
            "checksum": "xxh3_64",
            "storages": [[s.offset, s.nbytes, s.checksum, s.location] for s in enc.storages],
            "tensors": enc.tensors,
            "tree": tree,
        }
    )
    meta_offset = pos
    size = meta_offset + len(meta) + FOOTER.size
    h = xxhash.xxh3_64()
    h.update(header)
    h.update(meta)
    body = struct.pack("<QQQQHH12x", meta_offset, len(meta), h.intdigest(), size, VERSION, flags)
    footer = FOOTER.pack(
        meta_offset, len(meta), h.intdigest(), size, VERSION, flags, xxhash.xxh3_64_intdigest(body), FOOTER_MAGIC
    )
    out.writev([memoryview(meta), memoryview(footer)], len(meta) + len(footer))
    return size


def write_device(u8: torch.Tensor, write: Callable[[Any], Any]) -> int:
    """Copy a device storage out through the reused (pinned) staging buffer, hashing as it goes."""
    h = xxhash.xxh3_64()
    with _staging_lock:
        staging = _get_staging()
        smv = memoryview(staging.numpy())  # type: ignore[arg-type]  # numpy's stubs: ndarray.__buffer__ on 3.12+ only
        n = u8.numel()
        for i in range(0, n, len(smv)):
            m = min(len(smv), n - i)
            staging[:m].copy_(u8[i : i + m])  # synchronous: the buffer is reused at once
            h.update(smv[:m])
            write(smv[:m])
    return h.intdigest()


def writer_for(write: Callable[[Any], Any]) -> Callable[[Any], None]:
    def write_all(data: Any) -> None:
        mv = memoryview(data).cast("B")
        while len(mv):
            n = write(mv)
            if n is None:  # file objects that do not report a count wrote everything
                return
            mv = mv[n:]

    return write_all

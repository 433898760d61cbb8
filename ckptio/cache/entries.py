"""The node-local cache's files: names, block checksums, verified reads, and the directory scan.

The layout and the locking protocol are described in :mod:`ckptio.cache.store`; this module
holds the parts that only touch files (no locks, no remote backend). Hashing is xxh3-64 over
blocks read 1 MiB at a time (small enough to stay in the CPU cache between the copy and the hash).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

import xxhash

from .. import markers
from ..backends.local import _preadinto

MIN_BLOCK = 1 << 20
MAX_BLOCKS = 1 << 14  # so an entry's metadata stays under ~300 kB whatever its size
MAX_META_BYTES = 1 << 20  # a larger one is damaged: a miss, fetched again
_CHUNK = 1 << 20
_KEY = r"[0-9a-f]{40}"
_DATA = re.compile(rf"({_KEY})-.+")
_META = re.compile(rf"({_KEY})\.json")
_TMP = re.compile(rf"({_KEY})\.\d+\.[0-9a-f]{{8}}(?:\.json)?")
_LOCK = re.compile(rf"({_KEY})\.lock")
_SUB = re.compile(r"[0-9a-f]{2}")


def block_size(size: int) -> int:
    """1 MiB, doubled until an entry of ``size`` bytes has at most ``MAX_BLOCKS`` blocks."""
    block = MIN_BLOCK
    while size > block * MAX_BLOCKS:
        block *= 2
    return block


class Damaged(Exception):
    """An entry's bytes differ from what its fill recorded (the cache discards it and fetches again)."""


class BlockHasher:
    """The xxh3-64 of each ``block``-sized piece of a stream that arrives in pieces of any size."""

    def __init__(self, block: int) -> None:
        self.block, self._left = block, block
        self._h = xxhash.xxh3_64()
        self._out = bytearray()

    def update(self, data: memoryview) -> None:
        while len(data):
            take = min(len(data), self._left)
            self._h.update(data[:take])
            data, self._left = data[take:], self._left - take
            if not self._left:
                self._out += self._h.digest()
                self._h.reset()
                self._left = self.block

    def hexdigests(self) -> str:
        """The concatenated digests (8 bytes each, as hex), the last block's included."""
        tail = self._h.digest() if self._left != self.block else b""
        return (bytes(self._out) + tail).hex()


@dataclass(frozen=True)
class Entry:
    """A cache entry whose size and metadata look right; its reads verify the bytes they return."""

    path: str
    size: int
    block: int
    digests: bytes  # 8 per block
    fill_id: str

    @classmethod
    def load(cls, data: str, meta: str, uri: str, size: int, memo: dict | None = None) -> Entry | bool | None:
        """The entry; None if there is none; False if it is unusable (discard it). ``memo`` keeps
        parsed metadata while its file is unchanged (a big entry's is ~300 kB; ranged reads are many)."""
        try:
            st = os.stat(data)
        except FileNotFoundError:
            return None
        try:
            mst = os.stat(meta)
            sig = (mst.st_ino, mst.st_size, mst.st_mtime_ns, mst.st_ctime_ns, st.st_ino, st.st_size)
            hit = memo.get(meta) if memo is not None else None
            if hit is not None and hit[0] == sig:
                return hit[1]
            if mst.st_size > MAX_META_BYTES:
                return False
            with open(meta, "rb") as f:
                m: Any = markers.loads(f.read(MAX_META_BYTES + 1), meta)
            block, digests = m["block_size"], bytes.fromhex(m["blocks"])
        except (OSError, ValueError, KeyError, TypeError):  # damaged, or the old layout: unverifiable
            return False
        if (
            st.st_size != size
            or m.get("size") != size
            or m.get("uri") != uri
            or not isinstance(block, int)
            or block <= 0
            or len(digests) != 8 * -(-size // block)
        ):
            return False
        entry = cls(data, size, block, digests, str(m.get("fill_id")))
        if memo is not None:
            if len(memo) >= 1024:
                memo.clear()
            memo[meta] = (sig, entry)
        return entry

    def _check(self, i: int, digest: bytes) -> None:
        if digest != self.digests[8 * i : 8 * i + 8]:
            raise Damaged(
                f"{self.path}: bytes {i * self.block}-{min(self.size, (i + 1) * self.block)} do not match "
                f"the checksum recorded when the entry was filled"
            )

    def _hash(self, fd: int, h: Any, start: int, end: int, buf: memoryview) -> None:
        while start < end:
            n = os.preadv(fd, [buf[: min(len(buf), end - start)]], start)
            if not n:
                raise Damaged(f"{self.path}: truncated at byte {start} of {self.size}")
            h.update(buf[:n])
            start += n

    def verify(self, fd: int) -> None:
        """Hash the whole entry (``fd`` open on it) against its block checksums."""
        buf = memoryview(bytearray(max(1, min(_CHUNK, self.size))))
        h = xxhash.xxh3_64()
        for i in range(-(-self.size // self.block)):
            h.reset()
            self._hash(fd, h, i * self.block, min(self.size, (i + 1) * self.block), buf)
            self._check(i, h.digest())

    def readinto(self, fd: int, mv: memoryview, offset: int) -> int:
        """Read into ``mv`` from ``offset`` (up to the end) and verify the blocks touched; the bytes count."""
        if offset < 0:
            raise ValueError(f"negative offset {offset}")
        n = max(0, min(len(mv), self.size - offset))
        if not n:
            return 0
        end, b = offset + n, self.block
        scratch = None
        h = xxhash.xxh3_64()
        for i in range(offset // b, -(-end // b)):
            lo, hi = i * b, min(self.size, (i + 1) * b)
            a, z = max(lo, offset), min(hi, end)
            if scratch is None and (lo < a or z < hi):
                scratch = memoryview(bytearray(min(b, _CHUNK)))
            h.reset()
            if lo < a:  # the block's bytes before the range, hashed but not returned
                self._hash(fd, h, lo, a, scratch)  # type: ignore[arg-type]
            part = mv[a - offset : z - offset]
            if _preadinto(fd, part, a) != len(part):
                raise Damaged(f"{self.path}: truncated before byte {z} of {self.size}")
            h.update(part)
            if z < hi:
                self._hash(fd, h, z, hi, scratch)  # type: ignore[arg-type]
            self._check(i, h.digest())
        return n

    def read(self, fd: int, start: int, end: int | None) -> bytes:
        """Bytes ``[start, end)`` (``end`` None: to the end), verified: the blocks touched are read whole."""
        if start < 0:
            raise ValueError(f"negative offset {start}")
        end = self.size if end is None else min(end, self.size)
        if start >= end:
            return b""
        b = self.block
        lo, hi = start // b * b, min(self.size, -(-end // b) * b)
        data = _pread(fd, lo, hi)
        if len(data) != hi - lo:
            raise Damaged(f"{self.path}: truncated at byte {lo + len(data)} of {self.size}")
        with memoryview(data) as mv:
            for i in range(lo // b, -(-hi // b)):
                self._check(i, xxhash.xxh3_64_digest(mv[i * b - lo : min(hi, (i + 1) * b) - lo]))
        return data if (lo, hi) == (start, end) else data[start - lo : end - lo]


def _pread(fd: int, start: int, end: int) -> bytes:
    """Bytes ``[start, end)`` of ``fd`` (fewer at EOF), in one allocation when the range is the file's tail."""
    if end == os.fstat(fd).st_size:
        with open(fd, "rb", buffering=0, closefd=False) as f:
            f.seek(start)
            return f.readall()  # sized from fstat: no join, no copy
    parts = []
    while start < end:
        part = os.pread(fd, min(end - start, 1 << 30), start)  # Linux caps one read at ~2 GiB
        if not part:
            break
        parts.append(part)
        start += len(part)
    return parts[0] if len(parts) == 1 else b"".join(parts)


# ---- the directory scan: what the cache holds on disk ----------------------------------------


@dataclass(frozen=True)
class Item:
    """Files of one key that go together. ``kind``: "entry" (data + metadata), "meta" (metadata
    without data), "tmp" (a fill's temporary file) or "lock" (a lock file with nothing else)."""

    key: str
    kind: str
    paths: tuple[str, ...]
    size: int
    mtime: float


def _listdir(d: str) -> list[str]:
    try:
        return os.listdir(d)
    except (FileNotFoundError, NotADirectoryError):
        return []


def _stat(path: str) -> os.stat_result | None:
    try:
        return os.stat(path)
    except FileNotFoundError:
        return None


def scan(cache_dir: str) -> list[Item]:
    """Everything of the cache's under ``cache_dir``: entries, orphaned metadata, temporary files of
    fills (live or dead) and lock files without either (size 0). Files not named as the layout says
    are not the cache's and are ignored."""
    items: list[Item] = []
    keys: set[str] = set()
    data_dir = os.path.join(cache_dir, "data")
    for sub in _listdir(data_dir):
        if not _SUB.fullmatch(sub):
            continue
        d = os.path.join(data_dir, sub)
        names = _listdir(d)
        metas = {m.group(1) for m in map(_META.fullmatch, names) if m and m.group(1).startswith(sub)}
        for name in names:
            m = _DATA.fullmatch(name)
            st = _stat(os.path.join(d, name)) if m and m.group(1).startswith(sub) else None
            if m is None or st is None:
                continue
            key = m.group(1)
            meta = os.path.join(d, f"{key}.json")
            mst = _stat(meta) if key in metas and key not in keys else None  # a meta counts once
            items.append(
                Item(key, "entry", (os.path.join(d, name), meta), st.st_size + (mst.st_size if mst else 0), st.st_mtime)
            )
            keys.add(key)
        for key in metas - keys:
            st = _stat(os.path.join(d, f"{key}.json"))
            if st is not None:
                items.append(Item(key, "meta", (os.path.join(d, f"{key}.json"),), st.st_size, st.st_mtime))
                keys.add(key)
    tmp = os.path.join(cache_dir, "tmp")
    for name in _listdir(tmp):
        m = _TMP.fullmatch(name)
        st = _stat(os.path.join(tmp, name)) if m else None
        if m and st is not None:
            items.append(Item(m.group(1), "tmp", (os.path.join(tmp, name),), st.st_size, st.st_mtime))
            keys.add(m.group(1))
    for name in _listdir(os.path.join(cache_dir, "locks")):
        m = _LOCK.fullmatch(name)
        if m and m.group(1) not in keys:
            items.append(Item(m.group(1), "lock", (), 0, 0.0))
    return items


def usage(cache_dir: str) -> dict[str, int]:
    """``entries``, ``bytes`` (everything the cache holds on disk) and ``partial_bytes`` (of that,
    fills in progress or killed, and metadata left without data). Reads only: works on a read-only
    or missing directory."""
    items = scan(cache_dir)
    return {
        "entries": sum(1 for i in items if i.kind == "entry"),
        "bytes": sum(i.size for i in items),
        "partial_bytes": sum(i.size for i in items if i.kind != "entry"),
    }

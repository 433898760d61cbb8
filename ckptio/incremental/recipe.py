"""The recipe: the object an incremental save writes where a data file would be.

Bytes: the magic line ``b"CKPTIO-RECIPE 1\\n"``, then a JSON object
``{"hash": "xxh3_128", "size": N, "blocks": [[hex, length], ...]}``: the file's logical bytes are
the blocks' bytes concatenated, each block stored at ``.content/<hex[:2]>/<hex>``.

Parsing is strict (a recipe comes from storage, so it may have been edited): every hash is exactly 32
lowercase hex digits (so a content path can only ever be ``.content/xx/<hex>``), lengths are positive
ints up to :data:`MAX_BLOCK_BYTES` summing to ``size``, at most :data:`MAX_BLOCKS` blocks, and the
recipe itself at most :data:`MAX_RECIPE_BYTES`. Anything else is a :class:`FormatError`.
"""

from __future__ import annotations

import bisect
import json
import re
from dataclasses import dataclass, field
from typing import Any

from .. import markers
from ..errors import FormatError

MAGIC = b"CKPTIO-RECIPE 1\n"
HASH_NAME = "xxh3_128"
MAX_BLOCKS = 1 << 21
MAX_BLOCK_BYTES = 1 << 30
MAX_RECIPE_BYTES = 128 << 20
_HEX = re.compile(r"[0-9a-f]{32}")


@dataclass(frozen=True)
class Recipe:
    """A file's logical ``size`` and its blocks: ``hashes[i]`` holds ``lengths[i]`` bytes at ``offsets[i]``."""

    size: int
    hashes: tuple[str, ...]
    lengths: tuple[int, ...]
    offsets: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        offsets, pos = [], 0
        for n in self.lengths:
            offsets.append(pos)
            pos += n
        object.__setattr__(self, "offsets", tuple(offsets))

    def span(self, start: int, end: int) -> range:
        """Indices of the blocks overlapping bytes ``[start, end)``."""
        if start >= end:
            return range(0)
        return range(bisect.bisect_right(self.offsets, start) - 1, bisect.bisect_left(self.offsets, end))


def pack_recipe(size: int, blocks: list[tuple[str, int]]) -> bytes:
    body = {"hash": HASH_NAME, "size": size, "blocks": [[h, n] for h, n in blocks]}
    return MAGIC + json.dumps(body, separators=(",", ":")).encode()


def parse_recipe(data: bytes, uri: str) -> Recipe:
    """The recipe in ``data`` (which starts with :data:`MAGIC`), checked; FormatError naming ``uri``."""

    def bad(why: str) -> FormatError:
        return FormatError(f"{uri}: not a valid ckptio recipe ({why}); nothing was read through it")

    if len(data) > MAX_RECIPE_BYTES:
        raise bad(f"{len(data)} bytes, more than {MAX_RECIPE_BYTES}")
    if not data.startswith(MAGIC):
        raise bad("no recipe magic")
    try:  # a block is 3 values: its pair, its length, the comma before the next
        body: Any = markers.parse(data[len(MAGIC) :], max_values=3 * MAX_BLOCKS + 8)
    except ValueError as e:
        raise bad(f"not JSON: {e}") from None
    if not isinstance(body, dict) or set(body) != {"hash", "size", "blocks"}:
        raise bad("not an object with exactly the keys hash, size, blocks")
    if body["hash"] != HASH_NAME:
        raise bad(f"hash {body['hash']!r}, not {HASH_NAME!r}")
    size, blocks = body["size"], body["blocks"]
    if type(size) is not int or size < 0:
        raise bad(f"size {size!r} is not a non-negative int")
    if not isinstance(blocks, list) or len(blocks) > MAX_BLOCKS:
        raise bad(f"blocks is not a list of at most {MAX_BLOCKS} entries")
    hashes, lengths = [], []
    for b in blocks:
        if not (isinstance(b, list) and len(b) == 2):
            raise bad(f"block {b!r} is not a [hash, length] pair")
        h, n = b
        if not isinstance(h, str) or not _HEX.fullmatch(h):
            raise bad(f"block hash {h!r} is not 32 lowercase hex digits")
        if type(n) is not int or not 0 < n <= MAX_BLOCK_BYTES:
            raise bad(f"block length {n!r} is not an int in 1..{MAX_BLOCK_BYTES}")
        hashes.append(h)
        lengths.append(n)
    if sum(lengths) != size:
        raise bad(f"block lengths sum to {sum(lengths)}, not the size {size}")
    return Recipe(size, tuple(hashes), tuple(lengths))

"""What a file holds, told by its first bytes: the one content check behind every "this is really a ..." error.

A file's extension picks its format (:mod:`ckptio.registry`); :func:`sniff` reads its first
:data:`HEAD` bytes and names the format they belong to. A reader whose parse fails on the first
bytes (fastpickle's magic, the zip directory ``ckptio info`` reads in a ``.pt``) asks
:func:`mismatch` / :func:`expect` for an error that names the real format and the fix;
safetensors' reader calls :func:`expect` before it parses. ``torch.load`` unpickles whatever is not
a zip archive, so :func:`expect` (``strict``) runs before it and refuses anything but a torch.save
file, whatever ``weights_only`` says: the bytes of another format never reach an unpickler.
Nothing here imports torch.
"""

from __future__ import annotations

import os
import pickle
from typing import IO

from ..errors import FormatError
from .fastpickle.layout import MAGIC as FPK_MAGIC
from .safetensors.layout import MAX_HEADER

HEAD = 264  # the most any signature below needs (an old torch tar archive's "ustar" at 257)
_TORCH_MAGIC = 0x1950A86A20F9469CFC6C  # torch.serialization.MAGIC_NUMBER: a legacy file's first pickle
_LEGACY = tuple({pickle.dumps(_TORCH_MAGIC, protocol=p) for p in range(pickle.HIGHEST_PROTOCOL + 1)})
# format name -> (what it is, its extension: also the file_format= that loads it)
_NAMES = {
    "torch": ("a torch.save file", ".pt"),
    "fastpickle": ("a ckptio fastpickle file", ".fpk"),
    "safetensors": ("a safetensors file", ".safetensors"),
    "pickle": ("a plain pickle", ".pkl"),
    "npy": ("a NumPy .npy file", ".npy"),
}


def sniff(head: bytes | memoryview) -> str | None:
    """The registered name of the format whose files start with ``head`` (a file's first bytes, up to
    :data:`HEAD`); None for none of :data:`_NAMES`. A safetensors header is checked first: its length
    field can take any first bytes, the other signatures cannot take its ``{`` at byte 8."""
    head = bytes(head[:HEAD])
    if len(head) > 9 and head[8:9] == b"{" and 2 <= int.from_bytes(head[:8], "little") <= MAX_HEADER:
        return "safetensors"
    if head.startswith(FPK_MAGIC):
        return "fastpickle"
    if head.startswith((b"PK\x03\x04", *_LEGACY)) or head[257:262] == b"ustar":  # zip, legacy pickle, tar
        return "torch"
    if head.startswith(b"\x93NUMPY"):
        return "npy"
    if len(head) > 1 and head[0] == pickle.PROTO[0] and 2 <= head[1] <= pickle.HIGHEST_PROTOCOL:
        return "pickle"
    return None


def mismatch(name: str, expected: str, head: bytes | memoryview) -> FormatError | None:
    """The error for the file ``name``, read as format ``expected``, whose first bytes ``head`` are
    another known format's (it names that format and the fix); None when they are ``expected``'s or
    unknown."""
    found = sniff(head)
    if found is None or found == expected:
        return None
    what, ext = _NAMES[found]
    named = _NAMES[expected][0] if expected in _NAMES else f"a {expected} file"
    return FormatError(
        f"{name} is {what}, not {named}: rename it to end in {ext} or load it with file_format={ext[1:]!r}"
    )


def expect(name: str, expected: str, head: bytes | memoryview, *, strict: bool = False) -> None:
    """Raise :func:`mismatch`'s error; ``strict``: also when ``head`` is no known format's."""
    err = mismatch(name, expected, head)
    if err is None and strict and sniff(head) != expected:
        what = _NAMES[expected][0] if expected in _NAMES else f"a {expected} file"
        known = ", ".join(ext for _, ext in _NAMES.values())
        why = f"its first bytes are those of none of {known} (damaged, or not a checkpoint)" if head else "it is empty"
        err = FormatError(f"{name} is not {what}: {why}")
    if err is not None:
        raise err


def head_of(f: str | os.PathLike | IO[bytes]) -> bytes:
    """The first :data:`HEAD` bytes of a file: a path, or a seekable binary file from where it is (left there)."""
    if isinstance(f, (str, os.PathLike)):
        with open(f, "rb") as g:
            return g.read(HEAD)
    start = f.tell()
    try:
        return f.read(HEAD)
    finally:
        f.seek(start)

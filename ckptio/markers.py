"""Small files read before anything they name: commit markers, pointers, ``kept.json``, ``tier.json``,
recipes, a cache entry's metadata. One reader for all of them, bounded.

A marker comes from storage, so it may be damaged or crafted. :func:`read` allocates no more than the
marker's cap, nor more than the store says the object holds (the size comes with the first bytes,
``Backend.read_head``: one request for a marker of up to :data:`HEAD` bytes). :func:`loads` parses JSON
only once it is UTF-8 text of at most ``max_values`` values nested at most :data:`MAX_DEPTH` deep, so
neither the C parser's recursion nor a file of ``[[],[],...]`` can blow up (memory in proportion to
the values); an integer of over :data:`MAX_INT_DIGITS` digits is refused too (Python's own limit says
"raise it"). Each failure is a :class:`~ckptio.errors.FormatError` naming the file; what a caller does
with it (refuse, fall back, treat a cache entry as a miss) is the caller's contract. :func:`dumps`
refuses to write what the readers would refuse.
"""

from __future__ import annotations

import itertools
import json
import re
from typing import Any

from .backends.base import Backend
from .errors import FormatError

HEAD = 64 << 10  # the first read of a marker: most are whole in it
MAX_JSON_BYTES = 8 << 20  # checkpoint.json, kept.json, tier.json (a marker can list 100,000 files' sizes)
MAX_POINTER_BYTES = 4 << 10  # latest.txt, a Cosmos latest_checkpoint.txt
MAX_DEPTH = 32  # ckptio writes 3 levels at most
MAX_INT_DIGITS = 640  # under any limit Python may set on int() (sys.int_info.str_digits_check_threshold)
MAX_VALUES = 300_000  # values in a marker (the sizes of 100,000 files; a recipe: its own bound)

_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_STEP = {ord("["): 1, ord("{"): 1, ord("]"): -1, ord("}"): -1}


def read(backend: Backend, path: str, shown: str, cap: int) -> bytes:
    """The bytes of the object at ``path`` (resolved; ``shown``: its name in errors), at most ``cap``:
    a larger one is a FormatError before its bytes are read; a missing one, the backend's error."""
    head = bytearray(min(cap + 1, HEAD))
    sizes: list[int] = []
    n = backend.read_head(path, head, sizes.append)
    size = sizes[0] if sizes else n
    if max(size, n) > cap:
        raise too_large(shown, max(size, n), cap)
    if n >= size:
        return bytes(head[:n])
    return backend.read_range(path, 0, size)  # replaced meanwhile by a larger one: its first `size` bytes


def too_large(shown: str, size: int, cap: int) -> FormatError:
    return FormatError(
        f"{shown}: {size} bytes, more than the {cap} ckptio reads for this file (it never writes one "
        f"that large: the file was edited or damaged); nothing was read from it"
    )


def text(data: bytes, shown: str) -> str:
    """``data`` as UTF-8 text; FormatError naming ``shown`` if it is not."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise FormatError(f"{shown}: not UTF-8 text ({e.reason} at byte {e.start})") from None


def loads(data: bytes, shown: str, *, max_values: int = MAX_VALUES) -> Any:
    """:func:`parse`, its ValueError a FormatError naming ``shown``."""
    try:
        return parse(data, max_values)
    except ValueError as e:
        raise FormatError(f"{shown}: not valid JSON ({e}); the file is damaged or was edited") from None


def parse(data: bytes, max_values: int = MAX_VALUES) -> Any:
    """The JSON value in ``data``, within the bounds the module docstring states; ValueError saying why not."""
    try:
        s = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"not UTF-8 text: {e.reason} at byte {e.start}") from None
    why = _unbounded(data, max_values)
    if why:
        raise ValueError(why)
    try:
        return json.loads(s, parse_int=_int)
    except RecursionError:  # a caller already deep in its stack
        raise ValueError("nested too deep to parse here") from None
    except ValueError as e:  # JSONDecodeError, _int's
        raise ValueError(str(e)[:200]) from None


def _unbounded(data: bytes, max_values: int) -> str | None:
    """Why the JSON text ``data`` is out of bounds (more values or deeper nesting than allowed), or None.
    Commas and brackets inside strings count too (an upper bound); C-speed counts unless deep enough."""
    if data.count(b",") + data.count(b"[") + data.count(b"{") > max_values:
        return f"more than {max_values} values"
    if data.count(b"[") + data.count(b"{") > MAX_DEPTH:
        skeleton = _STRING.sub(b"", data).translate(None, _NOT_BRACKETS)
        if max(itertools.accumulate(_STEP[b] for b in skeleton), default=0) > MAX_DEPTH:
            return f"nested more than {MAX_DEPTH} deep"
    return None


def _int(digits: str) -> int:
    if len(digits) > MAX_INT_DIGITS:
        raise ValueError(f"an integer of {len(digits)} digits")
    return int(digits)


def read_json(backend: Backend, path: str, shown: str, cap: int = MAX_JSON_BYTES) -> Any:
    """:func:`loads` of :func:`read`."""
    return loads(read(backend, path, shown, cap), shown)


def dumps(value: Any, shown: str, cap: int = MAX_JSON_BYTES, **kw: Any) -> bytes:
    """``json.dumps(value, **kw)`` encoded, refused (ValueError naming ``shown``, nothing written) past
    ``cap``: ckptio never writes a marker its readers refuse."""
    data = json.dumps(value, **kw).encode()
    why = f"{len(data)} bytes, more than {cap}" if len(data) > cap else _unbounded(data, MAX_VALUES)
    if why:
        raise ValueError(
            f"{shown}: would hold {why}, past what ckptio reads back; nothing was written (fewer or "
            f"shorter metrics, kept names or files per step)"
        )
    return data

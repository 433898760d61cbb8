"""Typed setting values: the converters every settings table and option uses (sizes such as ``64MiB``,
booleans, numbers, strings, URLs, credential providers).

Each takes a value from a settings file, the environment or a call and returns it typed, or raises
``ValueError`` with a message that never includes the value (the caller shows it, redacted when secret);
:func:`parse_size`, for callers with no secret to hide, names it.
"""

from __future__ import annotations

import re
from typing import Any

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.I)
_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "kib": 2**10,
    "ki": 2**10,
    "m": 10**6,
    "mb": 10**6,
    "mib": 2**20,
    "mi": 2**20,
    "g": 10**9,
    "gb": 10**9,
    "gib": 2**30,
    "gi": 2**30,
    "t": 10**12,
    "tb": 10**12,
    "tib": 2**40,
}


def size(value: Any) -> int:
    if isinstance(value, bool):
        raise ValueError("expected a size, not a boolean")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    m = _SIZE_RE.match(str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError("expected a size such as 64MiB or 1048576")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def parse_size(value: Any) -> int:
    """``64MiB``/``1GB``/``1048576`` -> bytes."""
    try:
        return size(value)
    except ValueError as e:
        raise ValueError(f"{e}, got {value!r}") from None


def pos_size(value: Any) -> int:
    n = size(value)
    if n <= 0:
        raise ValueError("expected a size > 0 such as 64MiB")
    return n


def boolean(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        return value.lower() in ("1", "true", "yes", "on")
    raise ValueError("expected true/false")


def integer(value: Any, least: int) -> int:
    """Messages never include the value: the caller shows it, redacted."""
    if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
        raise ValueError("expected a whole number")
    try:
        v = int(value)
    except (TypeError, ValueError):
        raise ValueError("expected a whole number") from None
    if v < least:
        raise ValueError("expected a positive integer" if least == 1 else f"expected an integer >= {least}")
    return v


def pos_int(value: Any) -> int:
    return integer(value, 1)


def nonneg_int(value: Any) -> int:
    return integer(value, 0)


def pos_float(value: Any) -> float:
    try:
        v = float(value) if not isinstance(value, bool) else float("nan")
    except (TypeError, ValueError):
        raise ValueError("expected a number") from None
    if not v > 0:
        raise ValueError("expected a number > 0")
    return v


def string(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(f"expected a string, got {type(value).__name__}")
    return value


def url(value: Any) -> str:
    v = string(value)
    if not re.match(r"^https?://[^/\s]+", v):
        raise ValueError("expected an http(s):// URL")
    return v.rstrip("/")


def provider(value: Any) -> Any:
    if callable(value):
        return value
    if not isinstance(value, str) or not re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*", value):
        raise ValueError("expected a callable or 'package.module:function'")
    return value

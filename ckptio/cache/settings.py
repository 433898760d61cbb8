"""The cache's options: where they come from and how they become :class:`~ckptio.cache.CachedBackend`
keyword arguments.

Three sources, highest first: the ``cache=`` argument of a call (True, False, a directory or a
mapping), the settings file's ``[cache]`` table (``dir``, ``max_bytes``, ``verify``, ``fsync``,
``lock_timeout``; see :mod:`ckptio.config`), and, for compatibility, the cache options a
``[backends.NAME]`` table or an alias may carry (``cache_dir``, ``max_bytes``, ``cache_verify``,
``cache_fsync``), which win over the table for that backend. The table configures the cache; it
does not turn it on: a call turns it on with ``cache=True`` (or a directory or a mapping), and a
backend's settings with ``cache_dir`` (then every read of that backend goes through it).

The size limit: unless one is given, ``max_bytes`` defaults to min(50 GiB, 25% of the size of the
filesystem holding the cache directory) (:func:`default_max_bytes`); ``"unlimited"`` (any source)
or ``None`` (a ``cache=`` mapping) lifts it.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from typing import Any

from .. import values as _v
from ..errors import SettingsError

ENV_CACHE_DIR = "CKPTIO_CACHE_DIR"
DEFAULT_LOCK_TIMEOUT = 1800.0
DEFAULT_MAX_BYTES_CAP = 50 * 2**30  # the default limit: at most 50 GiB...
DEFAULT_MAX_BYTES_SHARE = 4  # ...and at most a quarter of the cache's filesystem
UNLIMITED = "unlimited"


def default_max_bytes(cache_dir: str) -> int:
    """min(50 GiB, 25% of the size of the filesystem holding ``cache_dir``, or of its nearest existing parent)."""
    path = os.path.abspath(cache_dir)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return min(DEFAULT_MAX_BYTES_CAP, shutil.disk_usage(path).total // DEFAULT_MAX_BYTES_SHARE)


def cache_limit(value: Any) -> int | None:
    """A ``max_bytes`` setting: a positive size (``"500GiB"``), or ``"unlimited"`` (None: no eviction)."""
    if isinstance(value, str) and value.strip().lower() == UNLIMITED:
        return None
    return _v.pos_size(value)


def default_cache_dir() -> str:
    """``$CKPTIO_CACHE_DIR``, else ``$XDG_CACHE_HOME/ckptio``, else ``~/.cache/ckptio``."""
    env = os.environ.get(ENV_CACHE_DIR)
    if env:
        return os.path.expanduser(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "ckptio")


_DEFAULT: Any = object()  # max_bytes given by no source

# the old spelling: cache options inside a backend's (or an alias's) options
CACHE_OPTIONS = ("cache_dir", "max_bytes", "cache_verify", "cache_fsync")
# the ``[cache]`` table's keys, and what they are called among CachedBackend's keyword arguments
TABLE_KEYS = {
    "dir": "cache_dir",
    "max_bytes": "max_bytes",
    "verify": "verify",
    "fsync": "fsync",
    "lock_timeout": "lock_timeout",
}
_ARGUMENT_KEYS = ("cache_dir", "max_bytes", "verify", "fsync", "lock_timeout")
# the ``[cache]`` table: key -> coercion (a ``cache=`` mapping's values are coerced the same way)
CACHE_TABLE: dict[str, Any] = {
    "dir": _v.string,
    "max_bytes": cache_limit,
    "verify": _v.boolean,
    "fsync": _v.boolean,
    "lock_timeout": _v.pos_float,
}


def cache_options(
    cache: Any, backend_options: dict[str, Any], table: Mapping[str, Any] | None = None
) -> dict[str, Any] | None:
    """Pop cache settings out of ``backend_options`` and combine them with the ``[cache]`` ``table``
    (already validated) and a ``cache=`` argument; CachedBackend keyword arguments, or None for no cache.

    ``cache``: None (use the cache when the backend's settings give ``cache_dir``), False (never),
    True (the settings' directory, else the default one), a path (the directory), or a mapping with ``cache_dir``,
    ``max_bytes``, ``verify``, ``fsync``, ``lock_timeout``. ``max_bytes`` no source gives is
    :func:`default_max_bytes`; None in the mapping, or ``"unlimited"``, means no limit.
    """
    found = {k: backend_options.pop(k) for k in CACHE_OPTIONS if k in backend_options} if backend_options else {}
    if cache is False or (cache is None and "cache_dir" not in found):
        return None
    table = table or {}
    opts: dict[str, Any] = {"cache_dir": None, "max_bytes": _DEFAULT, "verify": False, "fsync": False}
    opts.update({TABLE_KEYS[k]: v for k, v in table.items()})
    renamed = {"cache_verify": "verify", "cache_fsync": "fsync"}
    opts.update({renamed.get(k, k): v for k, v in found.items()})
    if isinstance(cache, (str, os.PathLike)):
        opts["cache_dir"] = os.fspath(cache)
    elif isinstance(cache, Mapping):
        given_cache: Mapping[str, Any] = cache
        bad = set(given_cache) - set(_ARGUMENT_KEYS)
        if bad:
            raise SettingsError(f"cache=: unknown key(s) {sorted(bad)}; expected {', '.join(_ARGUMENT_KEYS)}")
        table_key = {v: k for k, v in TABLE_KEYS.items()}
        for k, v in given_cache.items():
            try:
                opts[k] = None if v is None else CACHE_TABLE[table_key[k]](v)
            except (TypeError, ValueError) as e:
                raise SettingsError(f"cache=.{k}: invalid value {v!r}: {e}") from None
    elif cache not in (None, True):
        raise SettingsError(f"cache= must be True, False, a directory or a mapping, got {type(cache).__name__}")
    opts["cache_dir"] = os.path.abspath(os.path.expanduser(opts["cache_dir"] or default_cache_dir()))
    if opts["max_bytes"] is _DEFAULT:
        opts["max_bytes"] = default_max_bytes(opts["cache_dir"])
    return opts

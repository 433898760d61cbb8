"""Layered, validated settings: which backend options apply to which URIs.

Sources, highest first: explicit arguments (``ckptio.configure``, call keywords) > environment
(``CKPTIO_<BACKEND>_<OPTION>``, e.g. ``CKPTIO_S3_ENDPOINT_URL``) > the TOML file > defaults.
The file is ``$CKPTIO_CONFIG``, else ``./ckptio.toml``, else ``$XDG_CONFIG_HOME/ckptio/ckptio.toml``.

    [backends.s3]                 # options for every s3:// URI
    endpoint_url = "http://127.0.0.1:9000"
    part_size = "64MiB"
    concurrency = 16

    [aliases.ckpt]                # ckpt://run7/x  ->  s3://team-bucket/checkpoints/run7/x
    target = "s3://team-bucket/checkpoints"
    [aliases.ckpt.options]        # backend options for this alias only
    endpoint_url = "http://other-endpoint:9000"

    [path_mapping]                # prefix rewrite, longest prefix wins (Cosmos's path_mapping)
    "s3://old-bucket/" = "s3://new-bucket/"

Validation happens at load time; errors name the file, the key and the reason. Secret values
never appear in ``repr`` or in :meth:`Settings.redacted`.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

from . import uri as _uri
from .errors import SettingsError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ENV_CONFIG = "CKPTIO_CONFIG"
REDACTED = "***"
_SECRET_RE = re.compile(
    r"secret|token|passw|session|credential|private|api_?key|access_?key|account_?key|connection_?string|"
    r"(^|_)sas($|_)|auth|cookie|signature|(^|_)key$", re.I)
_URL_USERINFO_RE = re.compile(r"(^[a-z][a-z0-9+.\-]*://)[^/@\s]+@", re.I)
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.I)
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "ki": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
          "mi": 2**20, "g": 10**9, "gb": 10**9, "gib": 2**30, "gi": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}


def is_secret(key: str) -> bool:
    """Whether an option name holds a secret (s3fs ``key``/``secret``, ``*_token``, adlfs ``account_key``...)."""
    return bool(_SECRET_RE.search(key))


def redact(options: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``options`` with secret values replaced by ``***`` (recursively)."""
    out: dict[str, Any] = {}
    for k, v in options.items():
        if isinstance(v, Mapping):
            out[k] = redact(v)
        else:
            if is_secret(str(k)) and v is not None:
                out[k] = REDACTED
            elif isinstance(v, str):
                out[k] = _URL_USERINFO_RE.sub(rf"\1{REDACTED}@", v)  # https://user:pass@host
            else:
                out[k] = v
    return out


def parse_size(value: Any) -> int:
    """``64MiB``/``1GB``/``1048576`` -> bytes."""
    if isinstance(value, bool):
        raise ValueError(f"expected a size, got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    m = _SIZE_RE.match(str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"expected a size such as 64MiB or 1048576, got {value!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        return value.lower() in ("1", "true", "yes", "on")
    raise ValueError(f"expected true/false, got {value!r}")


def _pos_int(value: Any) -> int:
    v = int(value)
    if v <= 0 or (isinstance(value, float) and not value.is_integer()) or isinstance(value, bool):
        raise ValueError(f"expected a positive integer, got {value!r}")
    return v


def _nonneg_int(value: Any) -> int:
    v = int(value)
    if v < 0 or isinstance(value, bool):
        raise ValueError(f"expected an integer >= 0, got {value!r}")
    return v


def _pos_float(value: Any) -> float:
    v = float(value)
    if not v > 0:
        raise ValueError(f"expected a number > 0, got {value!r}")
    return v


def _str(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(f"expected a string, got {type(value).__name__}")
    return value


def _url(value: Any) -> str:
    v = _str(value)
    if not re.match(r"^https?://[^/\s]+", v):
        raise ValueError(f"expected an http(s):// URL, got {v!r}")
    return v.rstrip("/")


def _provider(value: Any) -> Any:
    if callable(value):
        return value
    if not isinstance(value, str) or not re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*", value):
        raise ValueError(f"expected a callable or 'package.module:function', got {value!r}")
    return value


# Typed coercion for options whose meaning is shared across backends. Other keys pass through
# and are checked against the backend's constructor when it is built.
OPTION_TYPES: dict[str, Any] = {
    "part_size": parse_size,
    "max_bytes": parse_size,
    "concurrency": _pos_int,
    "retries": _nonneg_int,
    "max_attempts": _pos_int,
    "timeout": _pos_float,
    "connect_timeout": _pos_float,
    "read_timeout": _pos_float,
    "deadline": _pos_float,
    "stall_timeout": _pos_float,
    "credential_provider": _provider,
    "anon": _bool,
    "durable": _bool,
    "endpoint_url": _url,
    "region": _str,
    "profile": _str,
    "credentials_file": _str,
    "cache_dir": _str,
    "cache_verify": _bool,
    "cache_fsync": _bool,
    "project": _str,
}


def coerce_options(options: Mapping[str, Any], where: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in options.items():
        conv = OPTION_TYPES.get(k)
        try:
            out[k] = conv(v) if conv is not None and v is not None else v
        except (TypeError, ValueError) as e:
            shown = REDACTED if is_secret(k) else repr(v)
            raise SettingsError(f"{where}.{k}: invalid value {shown}: {e}") from None
    return out


@dataclass(frozen=True)
class Alias:
    """``scheme://rest`` resolves to ``target/rest`` with ``options`` on top of the target backend's."""

    scheme: str
    target: str
    options: Mapping[str, Any] = field(default_factory=dict)

    def __repr__(self) -> str:
        return f"Alias(scheme={self.scheme!r}, target={self.target!r}, options={redact(self.options)!r})"


@dataclass(frozen=True)
class Settings:
    backends: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    aliases: Mapping[str, Alias] = field(default_factory=dict)
    path_mapping: Mapping[str, str] = field(default_factory=dict)
    sources: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "backends", MappingProxyType({k: MappingProxyType(dict(v)) for k, v in self.backends.items()}))
        object.__setattr__(self, "aliases", MappingProxyType(dict(self.aliases)))
        object.__setattr__(self, "path_mapping", MappingProxyType(dict(self.path_mapping)))

    def __repr__(self) -> str:
        return f"Settings({self.redacted()!r})"

    def redacted(self) -> dict[str, Any]:
        """The effective settings as plain data, secrets replaced by ``***``."""
        return {
            "sources": list(self.sources),
            "backends": {k: redact(v) for k, v in self.backends.items()},
            "aliases": {k: {"target": a.target, "options": redact(a.options)} for k, a in self.aliases.items()},
            "path_mapping": dict(self.path_mapping),
        }

    def map_path(self, uri: str) -> str:
        """Apply ``path_mapping``: the longest matching prefix is rewritten."""
        best = max((p for p in self.path_mapping if uri.startswith(p)), key=len, default=None)
        return uri if best is None else self.path_mapping[best] + uri[len(best):]

    def resolve_alias(self, uri: str) -> tuple[str, Mapping[str, Any]]:
        """Rewrite an alias scheme to its target (aliases may chain, up to a depth of 8)."""
        extra: dict[str, Any] = {}
        for _ in range(8):
            scheme, rest = _uri.split(uri)
            alias = self.aliases.get(scheme)
            if alias is None:
                return uri, extra
            uri = _uri.join_path(alias.target, rest) if rest else alias.target
            extra = {**alias.options, **extra}
        raise SettingsError(f"alias chain too deep (a cycle?) while resolving {uri!r}")

    def merged(self, other: "Settings") -> "Settings":
        """``other`` layered on top of ``self``."""
        backends = {k: dict(v) for k, v in self.backends.items()}
        for k, v in other.backends.items():
            backends[k] = {**backends.get(k, {}), **v}
        return Settings(backends, {**self.aliases, **other.aliases}, {**self.path_mapping, **other.path_mapping},
                        self.sources + other.sources)


def from_mapping(data: Mapping[str, Any], source: str = "<arguments>") -> Settings:
    """Validate a settings mapping (the TOML file's shape) and build :class:`Settings`."""
    if not isinstance(data, Mapping):
        raise SettingsError(f"{source}: settings must be a table/mapping, got {type(data).__name__}")
    unknown = set(data) - {"backends", "aliases", "path_mapping"}
    if unknown:
        raise SettingsError(f"{source}: unknown top-level key(s) {sorted(unknown)}; expected backends, aliases, path_mapping")
    backends: dict[str, dict[str, Any]] = {}
    for name, opts in (data.get("backends") or {}).items():
        if not isinstance(opts, Mapping):
            raise SettingsError(f"{source}: backends.{name}: expected a table of options, got {type(opts).__name__}")
        backends[str(name)] = coerce_options(opts, f"{source}: backends.{name}")
    aliases: dict[str, Alias] = {}
    for scheme, spec in (data.get("aliases") or {}).items():
        where = f"{source}: aliases.{scheme}"
        if isinstance(spec, str):
            spec = {"target": spec}
        if not isinstance(spec, Mapping):
            raise SettingsError(f"{where}: expected a table with 'target' (and optional 'options'), got {type(spec).__name__}")
        if not re.fullmatch(r"[a-z][a-z0-9+.\-]*", str(scheme)):
            raise SettingsError(f"{where}: alias name must be a lowercase URI scheme (letters, digits, + . -)")
        if scheme in ("file", "s3", "gs", "gcs", "memory"):
            raise SettingsError(f"{where}: {scheme!r} is a built-in scheme and cannot be an alias")
        bad = set(spec) - {"target", "options"}
        if bad:
            raise SettingsError(f"{where}: unknown key(s) {sorted(bad)}; expected 'target' and 'options'")
        target = spec.get("target")
        if not isinstance(target, str) or not target:
            raise SettingsError(f"{where}.target: required, a URI such as 's3://bucket/prefix'")
        opts = spec.get("options") or {}
        if not isinstance(opts, Mapping):
            raise SettingsError(f"{where}.options: expected a table of backend options")
        aliases[str(scheme)] = Alias(str(scheme), target.rstrip("/") if "://" in target.rstrip("/") else target,
                                     coerce_options(opts, f"{where}.options"))
    mapping = data.get("path_mapping") or {}
    if not isinstance(mapping, Mapping) or not all(isinstance(k, str) and isinstance(v, str) for k, v in mapping.items()):
        raise SettingsError(f"{source}: path_mapping: expected a table of \"prefix\" = \"replacement\" strings")
    return Settings(backends, aliases, dict(mapping), (source,))


def load_file(path: str) -> Settings:
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise SettingsError(f"{path}: settings file not found") from None
    except tomllib.TOMLDecodeError as e:
        raise SettingsError(f"{path}: not valid TOML: {e}") from None
    return from_mapping(data, path)


def default_file(env: Mapping[str, str]) -> str | None:
    """The settings file that applies, or None (``$CKPTIO_CONFIG`` must exist if set)."""
    explicit = env.get(ENV_CONFIG)
    if explicit:
        return explicit
    if os.path.isfile("ckptio.toml"):
        return os.path.abspath("ckptio.toml")
    base = env.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    user = os.path.join(base, "ckptio", "ckptio.toml")
    return user if os.path.isfile(user) else None


def from_env(env: Mapping[str, str], backend_names: list[str]) -> Settings:
    """``CKPTIO_<BACKEND>_<OPTION>=value`` -> backend options (option names lowercased)."""
    backends: dict[str, dict[str, Any]] = {}
    names = sorted(backend_names, key=len, reverse=True)
    for key, value in env.items():
        if not key.startswith("CKPTIO_") or key == ENV_CONFIG:
            continue
        rest = key[len("CKPTIO_"):].lower()
        for name in names:
            if rest.startswith(name + "_"):
                backends.setdefault(name, {})[rest[len(name) + 1:]] = value
                break
    return from_mapping({"backends": backends}, "environment") if backends else Settings(sources=())


def load(env: Mapping[str, str] | None = None, backend_names: list[str] | None = None) -> Settings:
    """File, then environment on top. Explicit arguments are layered by the caller."""
    env = os.environ if env is None else env
    path = default_file(env)
    base = load_file(path) if path else Settings()
    return base.merged(from_env(env, backend_names or []))

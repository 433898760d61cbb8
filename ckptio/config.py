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

    [cache]                       # the node-local read cache (ckptio.cache), when a call uses it
    dir = "/local/nvme/ckptio-cache"
    max_bytes = "500GiB"          # least recently used entries go first; default min(50GiB, 25% of the
                                  # cache's filesystem); "unlimited": no limit
    verify = true                 # accepted for compatibility: every read is verified anyway

    [checkpointer]                # tiered checkpoints (ckptio.checkpointer.tiered) for remote roots
    local_tier = "/local/nvme/ckptio-tier"   # root s3://b/run7 -> local tier /local/nvme/ckptio-tier/s3/b/run7
    keep_local = 2
    max_pending = 4
    on_backlog = "block"          # or "raise"

Validation happens at load time; errors name the file, the key and the reason. Sizes and counts
must be positive; an option the backend does not take is refused (with a "did you mean");
``[backends.NAME]`` must name a registered backend or an fsspec protocol; an alias must not be
the scheme of a registered backend, and aliases must not form a cycle. Only the values of the
typed options below that are not secrets are ever shown (``repr``, :meth:`Settings.redacted`,
``ckptio config``, error messages); every other value shows as ``***``, and credentials in URLs
(``https://user:pass@host``, ``?sig=...``) are masked.
"""

from __future__ import annotations

import contextlib
import difflib
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from . import config_env as _env
from . import registry as _registry
from . import uri as _uri
from .cache.settings import CACHE_OPTIONS, CACHE_TABLE
from .errors import REDACTED, MissingDependencyError, SettingsError, UnknownSchemeError, logger
from .errors import redact as _redact_text
from .values import boolean as _bool
from .values import nonneg_int as _nonneg_int
from .values import parse_size as parse_size
from .values import pos_float as _pos_float
from .values import pos_int as _pos_int
from .values import pos_size as _pos_size
from .values import provider as _provider
from .values import string as _str
from .values import url as _url

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

_SECRET_RE = re.compile(
    r"secret|token|passw|session|credential|private|api_?key|access_?key|account_?key|connection_?string|"
    r"(^|_)sas($|_)|auth|cookie|signature|(^|_)key$",
    re.I,
)
_SCHEME_NAME_RE = re.compile(r"[a-z][a-z0-9+.\-]*")


def is_secret(key: str) -> bool:
    """Whether an option name holds a secret (s3fs ``key``/``secret``, ``*_token``, adlfs ``account_key``...)."""
    return bool(_SECRET_RE.search(key))


def redact_url(value: str) -> str:
    """``value`` with the credentials a URL may carry masked: ``https://***@host/p?***`` (:func:`errors.redact`)."""
    return _redact_text(value)


def shown(key: str, value: Any) -> Any:
    """How an option's value may be displayed: only typed, non-secret options show their value."""
    if isinstance(value, Mapping):
        return redact(value)
    if value is None:
        return None
    if key not in OPTION_TYPES or is_secret(key):
        return REDACTED  # an option we do not know may hold anything (adlfs' sas_token, a password...)
    return redact_url(value) if isinstance(value, str) else value


def redact(options: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``options`` fit to display: see :func:`shown` (recursively)."""
    return {k: shown(str(k), v) for k, v in options.items()}


# Typed coercion for options whose meaning is shared across backends; only these show their values
# (unless secret). Every option name is checked against the backend's constructor at load time.
OPTION_TYPES: dict[str, Any] = {
    "part_size": _pos_size,
    "upload_part_size": _pos_size,
    "max_buffer_bytes": _pos_size,
    "max_bytes": CACHE_TABLE["max_bytes"],
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
    "lock_timeout": _pos_float,
    "project": _str,
    "checksum": _str,
}


def coerce_option(k: str, v: Any, where: str) -> Any:
    """Option ``k``'s value ``v`` in its type; a SettingsError naming ``where`` (and the value, unless secret)."""
    conv = OPTION_TYPES.get(k)
    try:
        return conv(v) if conv is not None and v is not None else v
    except (TypeError, ValueError) as e:
        raise SettingsError(f"{where}: invalid value {shown(k, v)!r}: {e}") from None


def coerce_options(options: Mapping[str, Any], where: str) -> dict[str, Any]:
    return {k: coerce_option(k, v, f"{where}.{k}") for k, v in options.items()}


def _did_you_mean(name: str, candidates: Any) -> str:
    close = difflib.get_close_matches(name, sorted(candidates), n=1, cutoff=0.5)
    return f"; did you mean {close[0]!r}?" if close else ""


def accepted_options(entry: _registry.Entry) -> set[str] | None:
    """The option names a backend entry takes (with the cache's), or None when it takes any or its
    package is not installed (then its constructor checks them when it is built)."""
    try:
        accepted = _registry.accepted_options(entry.load())
    except MissingDependencyError:
        return None
    return None if accepted is None else accepted | set(CACHE_OPTIONS)


def check_options(options: Mapping[str, Any], entry: _registry.Entry, where: str) -> None:
    """Refuse an option ``entry``'s backend does not take (naming it, never its value)."""
    accepted = accepted_options(entry)
    if accepted is None:  # any (or its package is missing): its constructor checks them when it is built
        return
    for k in options:
        if k not in accepted:
            raise SettingsError(
                f"{where}.{k}: the {entry.name!r} backend has no option {k!r}"
                f"{_did_you_mean(k, accepted)} (it takes: {', '.join(sorted(accepted))})"
            )


def _section_backend(name: str, where: str) -> _registry.Entry:
    """The backend that ``[backends.NAME]`` configures: a registered name or an fsspec protocol."""
    entry = _registry.backends.by_name(name)
    if entry is not None:
        return entry
    if _SCHEME_NAME_RE.fullmatch(name):
        with contextlib.suppress(UnknownSchemeError):
            entry = _registry.backends.find(f"{name}://")
    if entry is None:
        names = _registry.backends.names()
        raise SettingsError(
            f"{where}: no backend is named {name!r}{_did_you_mean(name, names)} (registered: "
            f"{', '.join(names)}; or an fsspec protocol whose package is installed)"
        )
    if entry.name.split(":", 1)[-1] != name:
        raise SettingsError(
            f"{where}: {name}:// URIs use the {entry.name!r} backend: put these options under [backends.{entry.name}]"
        )
    return entry


@dataclass(frozen=True)
class Alias:
    """``scheme://rest`` resolves to ``target/rest`` with ``options`` on top of the target backend's."""

    scheme: str
    target: str
    options: Mapping[str, Any] = field(default_factory=dict)
    source: str = "<arguments>"  # where it was defined, for errors

    @property
    def where(self) -> str:
        return f"{self.source}: aliases.{self.scheme}"

    def __repr__(self) -> str:
        return f"Alias(scheme={self.scheme!r}, target={redact_url(self.target)!r}, options={redact(self.options)!r})"


def _refuse_shadowing(alias: Alias) -> None:
    """An alias named like a registered backend's scheme would silently take its URIs over."""
    prefix = next((k for k in _registry.backends.keys() if k and _uri.scheme_of(k) == alias.scheme), None)
    if prefix is not None:
        raise SettingsError(
            f"{alias.where}: {alias.scheme}:// belongs to the {_registry.backends.find(prefix).name!r} "
            f"backend; an alias cannot take over a registered scheme: rename the alias"
        )


def check_aliases(aliases: Mapping[str, Alias]) -> None:
    """No alias shadows a registered scheme, none is part of a cycle, and each one's options are
    taken by the backend its chain of targets ends at (when that is known yet)."""
    for alias in aliases.values():
        _refuse_shadowing(alias)
        chain, uri = [alias.scheme], alias.target
        while (nxt := aliases.get(_uri.scheme_of(uri))) is not None:
            if nxt.scheme in chain:
                loop = [aliases[a] for a in chain[chain.index(nxt.scheme) :]] + [nxt]
                raise SettingsError(
                    f"{nxt.where}.target: aliases form a cycle: "
                    + " -> ".join(f"{a.scheme} ({a.source})" for a in loop)
                    + "; point one of them at a storage URI"
                )
            chain.append(nxt.scheme)
            uri = nxt.target
        if alias.options:
            try:
                entry = _registry.backends.find(uri)
            except UnknownSchemeError:
                continue  # reported, naming the URI, when the alias is used
            check_options(alias.options, entry, f"{alias.where}.options")


def _backlog(value: Any) -> str:
    if value not in ("block", "raise"):
        raise ValueError("expected 'block' or 'raise'")
    return str(value)


# the ``[checkpointer]`` table: defaults of tiered Checkpointers (see :mod:`ckptio.checkpointer.tiered`)
CHECKPOINTER_TABLE: dict[str, Any] = {
    "local_tier": _str,
    "keep_local": _pos_int,
    "max_pending": _pos_int,
    "on_backlog": _backlog,
}


def _table(table: Any, where: str, keys: Mapping[str, Any], what: str) -> dict[str, Any]:
    """A validated ``[cache]``/``[checkpointer]`` table: known ``keys``, each value coerced."""
    if not isinstance(table, Mapping):
        raise SettingsError(f"{where}: expected a table of {what} options, got {type(table).__name__}")
    out: dict[str, Any] = {}
    for k, v in table.items():
        if k not in keys:
            raise SettingsError(
                f"{where}.{k}: the {what} has no option {k!r}{_did_you_mean(str(k), keys)} "
                f"(it takes: {', '.join(keys)})"
            )
        try:
            out[k] = keys[k](v)
        except (TypeError, ValueError) as e:
            raise SettingsError(f"{where}.{k}: invalid value {v!r}: {e}") from None
    return out


@dataclass(frozen=True)
class Settings:
    backends: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    aliases: Mapping[str, Alias] = field(default_factory=dict)
    path_mapping: Mapping[str, str] = field(default_factory=dict)
    sources: tuple[str, ...] = ()
    cache: Mapping[str, Any] = field(default_factory=dict)  # the [cache] table
    checkpointer: Mapping[str, Any] = field(default_factory=dict)  # the [checkpointer] table

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "backends", MappingProxyType({k: MappingProxyType(dict(v)) for k, v in self.backends.items()})
        )
        object.__setattr__(self, "aliases", MappingProxyType(dict(self.aliases)))
        object.__setattr__(self, "path_mapping", MappingProxyType(dict(self.path_mapping)))
        object.__setattr__(self, "cache", MappingProxyType(dict(self.cache)))
        object.__setattr__(self, "checkpointer", MappingProxyType(dict(self.checkpointer)))
        if self.aliases:
            check_aliases(self.aliases)

    def __repr__(self) -> str:
        return f"Settings({self.redacted()!r})"

    def redacted(self) -> dict[str, Any]:
        """The effective settings as plain data, secrets replaced by ``***``."""
        return {
            "sources": list(self.sources),
            "backends": {k: redact(v) for k, v in self.backends.items()},
            "aliases": {
                k: {"target": redact_url(a.target), "options": redact(a.options)} for k, a in self.aliases.items()
            },
            "path_mapping": {redact_url(k): redact_url(v) for k, v in self.path_mapping.items()},
            "cache": dict(self.cache),
            **({"checkpointer": dict(self.checkpointer)} if self.checkpointer else {}),
        }

    def map_path(self, uri: str) -> str:
        """Apply ``path_mapping``: the longest matching prefix is rewritten."""
        if not self.path_mapping:
            return uri
        best = max((p for p in self.path_mapping if uri.startswith(p)), key=len, default=None)
        return uri if best is None else self.path_mapping[best] + uri[len(best) :]

    def resolve_alias(self, uri: str) -> tuple[str, Mapping[str, Any]]:
        """Rewrite an alias scheme to its target (aliases may chain; cycles are refused at load)."""
        extra: dict[str, Any] = {}
        if not self.aliases:
            return uri, extra
        while True:
            scheme, rest = _uri.split(uri)
            alias = self.aliases.get(scheme)
            if alias is None:
                return uri, extra
            _refuse_shadowing(alias)  # a backend registered after the settings were loaded
            uri = _uri.join_path(alias.target, rest) if rest else alias.target
            extra = {**alias.options, **extra}

    def merged(self, other: Settings) -> Settings:
        """``other`` layered on top of ``self``."""
        backends = {k: dict(v) for k, v in self.backends.items()}
        for k, v in other.backends.items():
            backends[k] = {**backends.get(k, {}), **v}
        return Settings(
            backends,
            {**self.aliases, **other.aliases},
            {**self.path_mapping, **other.path_mapping},
            self.sources + other.sources,
            {**self.cache, **other.cache},
            {**self.checkpointer, **other.checkpointer},
        )


def from_mapping(data: Mapping[str, Any], source: str = "<arguments>") -> Settings:
    """Validate a settings mapping (the TOML file's shape) and build :class:`Settings`."""
    if not isinstance(data, Mapping):
        raise SettingsError(f"{source}: settings must be a table/mapping, got {type(data).__name__}")
    unknown = set(data) - {"backends", "aliases", "path_mapping", "cache", "checkpointer"}
    if unknown:
        raise SettingsError(
            f"{source}: unknown top-level key(s) {sorted(unknown)}; expected backends, aliases, path_mapping, "
            "cache, checkpointer"
        )
    backends: dict[str, dict[str, Any]] = {}
    for name, opts in (data.get("backends") or {}).items():
        where = f"{source}: backends.{name}"
        if not isinstance(opts, Mapping):
            raise SettingsError(f"{where}: expected a table of options, got {type(opts).__name__}")
        check_options(opts, _section_backend(str(name), where), where)
        backends[str(name)] = coerce_options(opts, where)
    aliases: dict[str, Alias] = {}
    for scheme, spec in (data.get("aliases") or {}).items():
        where = f"{source}: aliases.{scheme}"
        if isinstance(spec, str):
            spec = {"target": spec}
        if not isinstance(spec, Mapping):
            raise SettingsError(
                f"{where}: expected a table with 'target' (and optional 'options'), got {type(spec).__name__}"
            )
        if not _SCHEME_NAME_RE.fullmatch(str(scheme)):
            raise SettingsError(f"{where}: alias name must be a lowercase URI scheme (letters, digits, + . -)")
        bad = set(spec) - {"target", "options"}
        if bad:
            raise SettingsError(f"{where}: unknown key(s) {sorted(bad)}; expected 'target' and 'options'")
        target = spec.get("target")
        if not isinstance(target, str) or not target:
            raise SettingsError(f"{where}.target: required, a URI such as 's3://bucket/prefix'")
        opts = spec.get("options") or {}
        if not isinstance(opts, Mapping):
            raise SettingsError(f"{where}.options: expected a table of backend options")
        aliases[str(scheme)] = Alias(
            str(scheme),
            target.rstrip("/") if "://" in target.rstrip("/") else target,
            coerce_options(opts, f"{where}.options"),
            source,
        )
    mapping = data.get("path_mapping") or {}
    if not isinstance(mapping, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in mapping.items()
    ):
        raise SettingsError(f'{source}: path_mapping: expected a table of "prefix" = "replacement" strings')
    cache = _table(data.get("cache") or {}, f"{source}: cache", CACHE_TABLE, "cache")
    ckpt = _table(data.get("checkpointer") or {}, f"{source}: checkpointer", CHECKPOINTER_TABLE, "checkpointer")
    return Settings(backends, aliases, dict(mapping), (source,), cache, ckpt)


def load_file(path: str) -> Settings:
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise SettingsError(f"{path}: settings file not found") from None
    except IsADirectoryError:
        raise SettingsError(f"{path}: is a directory; the settings file must be a TOML file") from None
    except OSError as e:
        raise SettingsError(f"{path}: cannot read the settings file: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise SettingsError(f"{path}: not UTF-8 text (byte {e.start}); TOML files must be UTF-8") from None
    except tomllib.TOMLDecodeError as e:
        raise SettingsError(f"{path}: not valid TOML: {e}") from None
    return from_mapping(data, path)


def default_file(env: Mapping[str, str]) -> str | None:
    """The settings file that applies, or None (``$CKPTIO_CONFIG`` must exist if set)."""
    explicit = env.get(_env.ENV_CONFIG)
    if explicit:
        return explicit
    if os.path.isfile("ckptio.toml"):
        return os.path.abspath("ckptio.toml")
    base = env.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    user = os.path.join(base, "ckptio", "ckptio.toml")
    return user if os.path.isfile(user) else None


def from_env(env: Mapping[str, str], backend_names: list[str]) -> Settings:
    """The ``environment`` layer (:mod:`ckptio.config_env`), each variable checked on its own: an error names it."""
    backends: dict[str, dict[str, Any]] = {}
    for key, name, option, value in _env.variables(env, backend_names):
        entry = _registry.backends.by_name(name)
        accepted = accepted_options(entry) if entry is not None else None
        if entry is not None and accepted is not None and option not in accepted:
            raise _env.unknown_option(key, entry.name, option, accepted)
        coerce_option(option, value, f"environment variable {key}")
        backends.setdefault(name, {})[option] = value
    return from_mapping({"backends": backends}, "environment") if backends else Settings(sources=())


def load(env: Mapping[str, str] | None = None, backend_names: list[str] | None = None) -> Settings:
    """File, then environment on top. Explicit arguments are layered by the caller."""
    env = os.environ if env is None else env
    path = default_file(env)
    base = load_file(path) if path else Settings()
    if path and path not in _announced:  # a ./ckptio.toml can remap buckets: never silently
        _announced.add(path)
        n, m = len(base.path_mapping), len(base.aliases)
        _log.info(
            "ckptio settings from %s: %d path mapping%s, %d alias%s, options for backends %s",
            path,
            n,
            "" if n == 1 else "s",
            m,
            "" if m == 1 else "es",
            sorted(base.backends) or "none",
        )
    return base.merged(from_env(env, backend_names or []))


_announced: set[str] = set()  # settings files already logged in this process
_log = logger("ckptio.settings")

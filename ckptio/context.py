"""The one place that turns a URI into (backend instance, resolved URI), once per call.

A :class:`Context` layers settings (defaults < file < environment < ``configure`` arguments),
translates easy_io's ``backend_args``/``backend_key`` (with their own path mapping), applies the
settings' path mapping and alias schemes, picks the backend from the registry, wraps it in the
node-local cache when asked (``cache=``, the ``[cache]`` table or a backend's ``cache_dir``) and
caches backend instances per (backend, options). The process has one default context; :func:`reset` drops its
cached settings and clients, and tests call it between cases so nothing leaks.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Mapping
from typing import Any

from . import config as _config
from . import registry as _registry
from . import uri as _uri
from .backends.base import Backend
from .cache import settings as _cache_settings
from .config import Settings
from .errors import InvalidURIError, SettingsError, UnknownSchemeError

# easy_io's ``backend_args["backend"]`` names -> registry names
BACKEND_NAMES = {
    "s3": "s3",
    "boto3": "s3",
    "petrel": "s3",
    "gcs": "gcs",
    "gs": "gcs",
    "local": "local",
    "disk": "local",
    "memory": "memory",
}


def translate_backend_args(args: Mapping[str, Any]) -> tuple[Mapping[str, str], dict[str, Any]]:
    """Cosmos ``backend_args`` -> (path_mapping, backend options)."""
    args = dict(args)
    args.pop("backend", None)
    mapping = args.pop("path_mapping", None) or {}
    opts: dict[str, Any] = {}
    cred = args.pop("s3_credential_path", None) or args.pop("credentials_file", None)
    if cred:
        opts["credentials_file"] = os.fspath(cred)
    args.pop("enable_mc", None)  # multi-storage-client switch in Cosmos: ckptio always uses its own client
    opts.update(args)
    return mapping, opts


def _freeze(options: Mapping[str, Any]) -> str:
    return json.dumps(options, sort_keys=True, default=repr) if options else "{}"


class Context:
    def __init__(self, settings: Settings | None = None, *, env: Mapping[str, str] | None = None) -> None:
        self._explicit = settings  # when given, file/env are not read
        self._overrides = Settings()
        self._env = env
        self._settings: Settings | None = None
        self._backends: dict[tuple[str, str], Backend] = {}
        self._lock = threading.RLock()
        self._pid = os.getpid()
        self.named_backends: dict[str, dict[str, Any]] = {}  # easy_io's set_s3_backend(key=...)

    @property
    def settings(self) -> Settings:
        s = self._settings  # set once under the lock, replaced by None (never changed in place) on configure
        if s is not None:
            return s
        with self._lock:
            if self._settings is None:
                base = (
                    self._explicit
                    if self._explicit is not None
                    else _config.load(self._env, _registry.backends.names())
                )
                self._settings = base.merged(self._overrides)
            return self._settings

    def configure(self, settings: Settings) -> None:
        """Layer ``settings`` on top of everything else (the 'explicit arguments' level)."""
        with self._lock:
            self._overrides = self._overrides.merged(settings)
            self._drop()

    def reset(self) -> None:
        with self._lock:
            self._overrides = Settings()
            self.named_backends.clear()
            self._drop()

    def _drop(self) -> None:
        if os.getpid() == self._pid:
            for b in self._backends.values():
                b.close()
        # in a forked child the inherited clients belong to the parent: forget them, never close them
        self._backends.clear()
        self._pid = os.getpid()
        self._settings = None

    def resolve(
        self,
        uri: str | os.PathLike,
        *,
        backend_args: Mapping[str, Any] | None = None,
        backend_key: str | None = None,
        cache: Any = None,
        **options: Any,
    ) -> tuple[Backend, str]:
        """Backend and resolved URI for ``uri``; ``options`` override settings for this call.

        ``backend_args``/``backend_key``: easy_io's (see :func:`ckptio.set_s3_backend`); their
        ``path_mapping`` applies first, their options only to the backend they name. ``cache`` wraps
        the backend in the node-local read cache (:mod:`ckptio.cache`): True, a directory, or a
        mapping; None uses one when settings give a directory; False never.
        """
        uri = os.fspath(uri)
        if not isinstance(uri, str):
            raise TypeError(f"expected a URI string, got {type(uri).__name__}")
        uri, for_backend, extra = self._backend_args(uri, backend_args, backend_key)
        s = self.settings
        resolved, alias_options = s.resolve_alias(s.map_path(uri))
        entry = _registry.backends.find(resolved)
        if entry.name == "local":
            self._refuse_mistyped(uri, resolved)
        if extra and (for_backend is None or entry.name == BACKEND_NAMES[for_backend]):
            # only the backend the args are for gets its options: in copyfile_to_local(s3 -> /tmp,
            # backend_args=s3 credentials) the local side must not receive credentials_file
            options = {**extra, **options}
        settings_key = entry.name.split(":", 1)[-1]
        opts = {**s.backends.get(settings_key, {}), **alias_options, **options}
        if entry.name.startswith("fsspec:"):
            opts["protocol"] = settings_key
        cache_opts = _cache_settings.cache_options(cache, opts, s.cache)  # pops cache_dir/max_bytes/... from opts
        backend = self._instance(entry, opts, uri)
        if cache_opts is not None:
            from .cache import CachedBackend

            key = ("cached:" + entry.name, _freeze({**opts, "__cache__": cache_opts}))
            with self._lock:
                wrapped = self._backends.get(key)
                if wrapped is None:
                    wrapped = self._backends[key] = CachedBackend(backend, **cache_opts)
            backend = wrapped
        return backend, resolved

    def _refuse_mistyped(self, given: str, resolved: str) -> None:
        """A local path whose first component is a scheme ckptio knows (a backend's, an fsspec protocol, an
        alias) followed by ':' is a URI with its '//' missing or mangled: an error with the fix, never a
        local file named ``s3:``. Deeper components (``./a:b``, ``/tmp/x:y``) are never looked at."""
        found = _uri.leading_scheme(resolved)
        if found is None:
            return
        scheme, rest = found
        try:
            local = _registry.backends.find(f"{scheme}://").name == "local"  # file:
        except UnknownSchemeError:
            if scheme not in self.settings.aliases:
                return  # "C:/x", "notes:today": not a scheme ckptio knows
            local = False
        fix = f"{scheme}://{'/' if local else ''}" + _uri.masked(f"{scheme}:{rest}")[len(scheme) + 1 :]
        mapped = f" (which settings map to {_uri.masked(resolved)!r})" if resolved != given else ""
        given = _uri.masked(given)
        raise InvalidURIError(
            f"{given!r}{mapped} is not a URI ({scheme}: needs '//'); did you mean {fix!r}? A local path whose "
            f"first part is '{scheme}:' can be written './{given}'"
        )

    def _backend_args(
        self, uri: str, backend_args: Mapping[str, Any] | None, backend_key: str | None
    ) -> tuple[str, str | None, dict[str, Any]]:
        """``(uri after backend_args' path_mapping, the backend they are for, their options)``."""
        if backend_key is not None:
            if backend_key not in self.named_backends:
                raise SettingsError(
                    f"no backend registered under key {backend_key!r} (for {uri!r}); call "
                    f"ckptio.set_s3_backend(key={backend_key!r}, backend_args=...) first"
                )
            backend_args = {**self.named_backends[backend_key], **(backend_args or {})}
        elif backend_args is None and "default" in self.named_backends and _uri.scheme_of(uri) in ("s3", "s3a"):
            backend_args = self.named_backends["default"]
        if not backend_args:
            return uri, None, {}
        backend = backend_args.get("backend")
        if backend is not None and backend not in BACKEND_NAMES:
            raise SettingsError(f"backend_args['backend']={backend!r} is not known; use one of {sorted(BACKEND_NAMES)}")
        mapping, extra = translate_backend_args(backend_args)
        best = max((p for p in mapping if uri.startswith(p)), key=len, default=None)
        if best is not None:
            uri = mapping[best] + uri[len(best) :]
        return uri, backend, extra

    def _instance(self, entry: _registry.Entry, opts: dict[str, Any], uri: str) -> Backend:
        key = (entry.name, _freeze(opts))
        with self._lock:
            if os.getpid() != self._pid:  # forked: clients (sockets, event loops) are not fork-safe
                self._backends.clear()
                self._pid = os.getpid()
            backend = self._backends.get(key)
            if backend is None:
                cls = entry.load()
                accepted = _registry.accepted_options(cls)
                unknown = sorted(set(opts) - accepted) if accepted is not None else []
                if unknown:
                    raise SettingsError(
                        f"backend {entry.name!r} (for {uri!r}) does not accept option(s) {unknown}; "
                        f"it accepts {sorted(accepted or ())}. Settings came from: "
                        f"{', '.join(self.settings.sources) or 'defaults'} (and call arguments)"
                    )
                try:
                    backend = cls(**opts)
                except (TypeError, ValueError) as e:
                    raise SettingsError(f"backend {entry.name!r} (for {uri!r}): invalid options: {e}") from None
                self._backends[key] = backend
            return backend


_default = Context()


def default_context() -> Context:
    return _default


def resolve(uri: str | os.PathLike, **options: Any) -> tuple[Backend, str]:
    """Module-level shortcut: resolve ``uri`` in the default context."""
    return _default.resolve(uri, **options)


def reset() -> None:
    """Forget ``configure`` overrides, re-read settings on next use, close cached clients and
    empty the ``memory://`` store."""
    _default.reset()
    from .backends import memory

    memory.clear()


def configure(
    *,
    settings_file: str | None = None,
    backends: Mapping[str, Mapping[str, Any]] | None = None,
    aliases: Mapping[str, Any] | None = None,
    path_mapping: Mapping[str, str] | None = None,
    cache: Mapping[str, Any] | None = None,
) -> None:
    """Set options programmatically, on top of the file and environment (the highest layer).

    ``backends={"s3": {"endpoint_url": ...}}``, ``aliases={"ckpt": {"target": "s3://b/x", "options": {...}}}``,
    ``path_mapping={"s3://old/": "s3://new/"}``, ``cache={"dir": ..., "max_bytes": "500GiB"}`` (the
    ``[cache]`` table); ``settings_file`` layers a TOML file at this level too.
    Calls accumulate until :func:`reset`.
    """
    layer = _config.load_file(settings_file) if settings_file else Settings()
    given = (("backends", backends), ("aliases", aliases), ("path_mapping", path_mapping), ("cache", cache))
    data = {k: v for k, v in given if v}
    if data:
        layer = layer.merged(_config.from_mapping(data, "ckptio.configure()"))
    _default.configure(layer)


def settings() -> dict[str, Any]:
    """The effective settings of the default context, secrets redacted."""
    return _default.settings.redacted()

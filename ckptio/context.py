"""The one place that turns a URI into (backend instance, resolved URI).

A :class:`Context` layers settings (defaults < file < environment < ``configure`` arguments),
applies path mapping and alias schemes, picks the backend from the registry and caches backend
instances per (backend, options). The process has one default context; :func:`reset` drops its
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
from .backends import cached as _cached
from .backends.base import Backend
from .config import Settings
from .errors import SettingsError


def _freeze(options: Mapping[str, Any]) -> str:
    return json.dumps(options, sort_keys=True, default=repr)


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

    def resolve(self, uri: str | os.PathLike, *, cache: Any = None, **options: Any) -> tuple[Backend, str]:
        """Backend and resolved URI for ``uri``; ``options`` override settings for this call.

        ``cache`` wraps the backend in a node-local read cache (:mod:`ckptio.backends.cached`):
        True, a directory, or a mapping; None uses one when settings give ``cache_dir``; False never.
        """
        uri = os.fspath(uri)
        if not isinstance(uri, str):
            raise TypeError(f"expected a URI string, got {type(uri).__name__}")
        s = self.settings
        resolved, alias_options = s.resolve_alias(s.map_path(uri))
        entry = _registry.backends.find(resolved)
        settings_key = entry.name.split(":", 1)[-1]
        opts = {**s.backends.get(settings_key, {}), **alias_options, **options}
        if entry.name.startswith("fsspec:"):
            opts["protocol"] = settings_key
        cache_opts = _cached.cache_options(cache, opts)  # pops cache_dir/max_bytes/... from opts
        backend = self._instance(entry, opts, uri)
        if cache_opts is not None:
            key = ("cached:" + entry.name, _freeze({**opts, "__cache__": cache_opts}))
            with self._lock:
                wrapped = self._backends.get(key)
                if wrapped is None:
                    wrapped = self._backends[key] = _cached.CachedBackend(backend, **cache_opts)
            backend = wrapped
        return backend, resolved

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
) -> None:
    """Set options programmatically, on top of the file and environment (the highest layer).

    ``backends={"s3": {"endpoint_url": ...}}``, ``aliases={"ckpt": {"target": "s3://b/x", "options": {...}}}``,
    ``path_mapping={"s3://old/": "s3://new/"}``; ``settings_file`` layers a TOML file at this level too.
    Calls accumulate until :func:`reset`.
    """
    layer = _config.load_file(settings_file) if settings_file else Settings()
    data = {k: v for k, v in (("backends", backends), ("aliases", aliases), ("path_mapping", path_mapping)) if v}
    if data:
        layer = layer.merged(_config.from_mapping(data, "ckptio.configure()"))
    _default.configure(layer)


def settings() -> dict[str, Any]:
    """The effective settings of the default context, secrets redacted."""
    return _default.settings.redacted()

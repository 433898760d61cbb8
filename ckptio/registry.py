"""Explicit registries: backends by URI prefix, formats by file extension.

Entries may be classes or lazy ``"module:Class"`` paths, so ``import ckptio`` never imports
s3fs/gcsfs. Installed packages add entries through the ``ckptio.backends`` and ``ckptio.formats``
entry-point groups, read once on first need. Registering a taken prefix/extension again is an
error unless ``force=True``.
"""

from __future__ import annotations

import importlib
import inspect
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any, TypeVar

from . import uri as _uri
from .errors import MissingDependencyError, UnknownFormatError, UnknownSchemeError

T = TypeVar("T")


@dataclass
class Entry:
    """A registered backend or format: its name, where it lives, and the extra that provides it."""

    name: str
    keys: tuple[str, ...]  # URI prefixes ("s3://") or extensions (".pt")
    target: Any  # a class or "module:attr"
    extra: str | None = None  # pip extra that installs what it needs
    _loaded: Any = field(default=None, repr=False)
    _instance: Any = field(default=None, repr=False)

    def load(self) -> Any:
        if self._loaded is None:
            if isinstance(self.target, str):
                mod, _, attr = self.target.partition(":")
                try:
                    self._loaded = getattr(importlib.import_module(mod), attr)
                except MissingDependencyError:  # the module's own message names the package and version
                    raise
                except ImportError as e:
                    hint = (
                        f"pip install 'ckptio[{self.extra}]'" if self.extra else "install the package that provides it"
                    )
                    raise MissingDependencyError(
                        f"{self.name!r} needs a package that is not installed ({e.name or e}); run: {hint}"
                    ) from e
            else:
                self._loaded = self.target
        return self._loaded

    def instance(self) -> Any:
        """The loaded object, instantiated once if it is a class (formats are stateless singletons)."""
        if self._instance is None:
            obj = self.load()
            obj = obj() if isinstance(obj, type) else obj
            obj.name = self.name
            self._instance = obj
        return self._instance


def _norm_prefix(p: str) -> str:
    p = p.strip()
    if p in ("", "/"):
        return ""
    return p if "://" in p else f"{p.rstrip(':/')}://"


def _norm_ext(e: str) -> str:
    e = e.strip().lower()
    return e if e.startswith(".") else f".{e}"


class _Registry:
    kind = "entry"
    group = ""

    def __init__(self) -> None:
        self._entries: dict[str, Entry] = {}  # key -> entry
        self._by_scheme: dict[str, list[str]] | None = None  # BackendRegistry's index of _entries
        self._lock = threading.RLock()
        self._entry_points_loaded = False

    def register(
        self,
        name: str,
        keys: list[str] | tuple[str, ...],
        target: Any,
        *,
        extra: str | None = None,
        force: bool = False,
    ) -> Entry:
        keys = tuple(self._norm(k) for k in keys)
        if not keys:
            raise ValueError(f"{self.kind} {name!r} must be registered with at least one prefix/extension")
        with self._lock:
            taken = [k for k in keys if k in self._entries and self._entries[k].name != name]
            if taken and not force:
                owners = ", ".join(f"{k!r} (by {self._entries[k].name!r})" for k in taken)
                raise ValueError(
                    f"cannot register {self.kind} {name!r}: already registered: {owners}; pass force=True to replace"
                )
            entry = Entry(name, keys, target, extra)
            for k in keys:
                self._entries[k] = entry
            self._by_scheme = None
            return entry

    def unregister(self, name: str) -> None:
        with self._lock:
            for k in [k for k, e in self._entries.items() if e.name == name]:
                del self._entries[k]
            self._by_scheme = None

    def names(self) -> list[str]:
        self._load_entry_points()
        return sorted({e.name for e in self._entries.values()})

    def keys(self) -> list[str]:
        self._load_entry_points()
        return sorted(self._entries)

    def by_name(self, name: str) -> Entry | None:
        self._load_entry_points()
        for e in self._entries.values():
            if e.name == name:
                return e
        return None

    def _norm(self, key: str) -> str:
        raise NotImplementedError

    def _load_entry_points(self) -> None:
        if self._entry_points_loaded:
            return
        with self._lock:
            if self._entry_points_loaded:
                return
            self._entry_points_loaded = True
            for ep in metadata.entry_points(group=self.group):
                # an entry point names a class registered by decorator on import, or a class with
                # ``prefixes``/``extensions`` attributes
                try:
                    obj = ep.load()
                except Exception as e:  # one broken plugin must not break every other lookup
                    dist = getattr(getattr(ep, "dist", None), "name", None) or "an installed package"
                    warnings.warn(
                        f"ckptio: skipping the {self.kind} plug-in {ep.name!r} ({ep.value}, from {dist}) "
                        f"of entry-point group {self.group!r}: it failed to import: "
                        f"{type(e).__name__}: {e}. Reinstall or uninstall that package.",
                        RuntimeWarning,
                        stacklevel=3,
                    )
                    continue
                if self.by_name_unloaded(ep.name) is None:
                    keys = getattr(obj, "prefixes", None) or getattr(obj, "extensions", None) or ()
                    if keys:
                        self.register(ep.name, tuple(keys), obj)

    def by_name_unloaded(self, name: str) -> Entry | None:
        return next((e for e in self._entries.values() if e.name == name), None)


class BackendRegistry(_Registry):
    kind = "backend"
    group = "ckptio.backends"

    def _norm(self, key: str) -> str:
        return _norm_prefix(key)

    def find(self, uri: str) -> Entry:
        """The entry with the longest prefix matching ``uri``; bare paths go to the ``""`` entry."""
        scheme = _uri.scheme_of(uri)
        for attempt in range(2):
            best = self._match(uri, scheme)
            if best is not None:
                return best
            if attempt == 0:
                self._load_entry_points()
        if scheme:
            fs = _fsspec_protocol(scheme)
            if fs:
                return Entry(f"fsspec:{scheme}", (f"{scheme}://",), "ckptio.backends.fsspec:FsspecBackend")
        known = ", ".join(k or "<bare path>" for k in self.keys())
        raise UnknownSchemeError(
            f"no backend for {uri!r} (scheme {scheme!r}). Known prefixes: {known}. Define an alias for it under "
            f"[aliases] in ckptio.toml (or ckptio.configure(aliases=...)), or register a backend with "
            f"@ckptio.register_backend(name, prefixes=[...])."
        )

    def _match(self, uri: str, scheme: str) -> Entry | None:
        if not scheme:
            return self._entries.get("")
        with self._lock:
            index = self._by_scheme
            if index is None:  # prefixes by scheme, longest first (rebuilt after a change)
                index = {}
                for k in sorted(self._entries, key=len, reverse=True):
                    if k:
                        index.setdefault(k.split("://", 1)[0], []).append(k)
                self._by_scheme = index
            keys = index.get(scheme, ())
            if len(keys) == 1 and len(keys[0]) == len(scheme) + 3:  # the usual case: only "scheme://"
                return self._entries[keys[0]]
            low = uri[: len(scheme) + 3].lower() + uri[len(scheme) + 3 :]
            return next((self._entries[k] for k in keys if low.startswith(k)), None)


def _fsspec_protocol(scheme: str) -> bool:
    """Whether fsspec knows ``scheme`` (checked without importing the implementation)."""
    try:
        from fsspec.registry import known_implementations, registry
    except ImportError:  # pragma: no cover - fsspec is a hard dependency
        return False
    return scheme in known_implementations or scheme in registry


class FormatRegistry(_Registry):
    kind = "format"
    group = "ckptio.formats"

    def _norm(self, key: str) -> str:
        return _norm_ext(key)

    def _probe(self, name: str) -> Entry | None:
        """Every key starts with "." (_norm_ext): the longest match starts at the first dot that gives one,
        one dict look-up per dot (never an iteration, so no lock is needed)."""
        i = name.find(".")
        while i >= 0:
            entry = self._entries.get(name[i:])
            if entry is not None:
                return entry
            i = name.find(".", i + 1)
        return None

    def find(self, uri: str) -> Entry:
        """The entry with the longest extension matching ``uri``'s name (``.pth.tar`` beats ``.tar``)."""
        name = _uri.basename(uri).lower()
        entry = self._probe(name)  # no lock: a registered format is found without waiting
        if entry is not None:
            return entry
        self._load_entry_points()
        with self._lock:  # another thread may be loading the entry points: wait for it
            entry = self._probe(name)
        if entry is not None:
            return entry
        raise UnknownFormatError(
            f"no format for {_uri.masked(uri)!r}: its extension matches none of {', '.join(self.keys())}. Pass "
            f"file_format=... or register one with @ckptio.register_format(name, extensions=[...])."
        )


backends = BackendRegistry()
formats = FormatRegistry()


def register_backend(name: str, prefixes: list[str] | tuple[str, ...], *, force: bool = False) -> Callable[[T], T]:
    """Class decorator: route URIs starting with any of ``prefixes`` (``"foo"`` means ``foo://``) to the class."""

    def deco(cls: T) -> T:
        backends.register(name, prefixes, cls, force=force)
        cls.name = name  # type: ignore[attr-defined]
        cls.prefixes = tuple(_norm_prefix(p) for p in prefixes)  # type: ignore[attr-defined]
        return cls

    return deco


def register_format(name: str, extensions: list[str] | tuple[str, ...], *, force: bool = False) -> Callable[[T], T]:
    """Class decorator: use the format for files ending in any of ``extensions``."""

    def deco(cls: T) -> T:
        formats.register(name, extensions, cls, force=force)
        cls.name = name  # type: ignore[attr-defined]
        cls.extensions = tuple(_norm_ext(e) for e in extensions)  # type: ignore[attr-defined]
        return cls

    return deco


def accepted_options(cls: type) -> set[str] | None:
    """Keyword options a backend class accepts (``None``: it takes ``**kwargs`` beyond the base ones).

    A class whose extra keyword arguments are passed through to a client (the fsspec adapter's
    storage options) says so with ``accepts_any_options = True``.
    """
    if getattr(cls, "accepts_any_options", False):
        return None
    names: set[str] = set()
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        params = inspect.signature(init).parameters.values()
        names |= {p.name for p in params if p.kind is p.KEYWORD_ONLY or p.kind is p.POSITIONAL_OR_KEYWORD}
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            break
    names.discard("self")
    return names


# Built-ins. s3/gcs/fsspec are lazy: their modules import s3fs/gcsfs.
backends.register("local", ["", "file://"], "ckptio.backends.local:LocalBackend")
backends.register("memory", ["memory://"], "ckptio.backends.memory:MemoryBackend")
backends.register("s3", ["s3://", "s3a://"], "ckptio.backends.s3:S3Backend", extra="s3")
backends.register("gcs", ["gs://", "gcs://"], "ckptio.backends.gcs:GCSBackend", extra="gcs")
formats.register("txt", [".txt", ".log", ".md"], "ckptio.formats.simple:TextFormat")
formats.register("bytes", [".bin", ".bytes", ".raw"], "ckptio.formats.simple:BytesFormat")
formats.register("json", [".json"], "ckptio.formats.simple:JsonFormat")
formats.register("yaml", [".yaml", ".yml"], "ckptio.formats.simple:YamlFormat", extra="yaml")
formats.register("pickle", [".pkl", ".pickle"], "ckptio.formats.simple:PickleFormat")
formats.register("msgpack", [".msgpack", ".mpk"], "ckptio.formats.simple:MsgpackFormat")
formats.register("npy", [".npy"], "ckptio.formats.simple:NumpyFormat")
formats.register("torch", [".pt", ".pth", ".ckpt", ".pth.tar", ".bin.pt"], "ckptio.formats.torch:TorchFormat")
formats.register("fastpickle", [".fpk"], "ckptio.formats.fastpickle:FastpickleFormat")
formats.register(
    "safetensors", [".safetensors", ".safetensors.index.json"], "ckptio.formats.safetensors:SafetensorsFormat"
)

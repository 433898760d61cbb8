"""The format interface: how an object becomes bytes on a backend, and back.

A format gets the backend and the resolved URI, so it can stream, issue ranged reads or map a
local file as it sees fit. Simple formats subclass :class:`StreamFormat` and only convert to and
from a file object. A format that can describe or check its files without loading them implements
``inspect`` and ``verify`` (``ckptio.info`` / ``ckptio.verify`` and the CLI call them); both return
plain JSON data, which :func:`jsonable` and :func:`dtype_size` help build.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import difflib
import inspect
import io
import math
from collections.abc import Callable, Iterable, Iterator
from typing import IO, Any, ClassVar

from .. import uri as _uri
from ..backends.base import Backend, WriteMode, Writer
from ..errors import FormatError, UnknownOptionError
from ..osio import translate_os_errors

LOCAL_BUFFER = 64 << 10  # a stream format's small writes to a local file are gathered up to this size


class Format(abc.ABC):
    name: ClassVar[str] = "base"
    extensions: ClassVar[tuple[str, ...]] = ()
    # True: load() gets a node-local cache backend as it is and reads its entries itself (fastpickle's
    # sources do), for formats that read objects next to ``uri``; otherwise it gets the entry's local file
    reads_through_cache: ClassVar[bool] = False
    # True: load() takes ``into=``, a tree of existing tensors (``ckptio.load_into``) whose memory it may
    # read matching tensors into; the tree it returns then holds those same tensors
    loads_into: ClassVar[bool] = False
    # The keyword options load()/dump() take, declared by a format whose methods pass **kwargs on (None, and
    # a method with **kwargs: not known, anything goes to the format); a method without **kwargs is read
    # from its signature. ckptio.load/dump check a call's keywords against them (check_keywords).
    load_options: ClassVar[frozenset[str] | None] = None
    dump_options: ClassVar[frozenset[str] | None] = None
    # keywords that hand the call to the caller's own code (json's cls, torch's pickle_module): then any is taken
    open_with: ClassVar[frozenset[str]] = frozenset()

    @abc.abstractmethod
    def dump(self, obj: Any, backend: Backend, uri: str, *, mode: WriteMode = "overwrite", **kwargs: Any) -> None:
        """Serialize ``obj`` to ``uri``. Nothing is visible under ``uri`` unless this returns."""

    @abc.abstractmethod
    def load(self, backend: Backend, uri: str, **kwargs: Any) -> Any:
        """Deserialize the object at ``uri``."""

    def dump_file(self, obj: Any, f: IO, **kwargs: Any) -> None:
        """Serialize into an open file object (easy_io's ``dump(obj, file_obj)``)."""
        raise NotImplementedError(f"format {self.name!r} cannot write to a file object")

    def load_file(self, f: IO, **kwargs: Any) -> Any:
        """Deserialize from an open file object."""
        raise NotImplementedError(f"format {self.name!r} cannot read from a file object")

    def inspect(self, backend: Backend, uri: str) -> dict[str, Any]:
        """What the file holds, without reading tensor bytes (``ckptio info``), as plain JSON data:
        ``format``, ``tensors`` (each ``key``, ``dtype``, ``shape``, ``nbytes``), ``tensor_bytes``,
        ``values`` (the other leaves, flattened to dotted keys) and anything format-specific."""
        raise NotImplementedError(f"format {self.name!r}: no inspect for this format")

    def verify(self, backend: Backend, uri: str) -> dict[str, Any]:
        """Check everything the format can check (``ckptio verify``), as plain JSON data: ``checked``,
        ``unchecked`` and ``what`` was checked. FormatError/IntegrityError when the file is bad."""
        raise NotImplementedError(f"format {self.name!r}: no verify for this format")

    def options(self, operation: str, given: Iterable[str]) -> frozenset[str] | None:
        """The keywords ``load`` or ``dump`` (``operation``) takes besides the backend, URI and object, for a
        call giving ``given``; None: not known (anything is passed on)."""
        if not self.open_with.isdisjoint(given):
            return None
        mro = type(self).__mro__
        owner = next(c for c in mro if f"{operation}_options" in vars(c))
        # declared options describe the methods of the class declaring them: a subclass that overrides
        # load/load_file (dump/dump_file) may take more
        methods = next(c for c in mro if operation in vars(c) or f"{operation}_file" in vars(c))
        declared: frozenset[str] | None = getattr(self, f"{operation}_options")
        if declared is not None and issubclass(owner, methods):
            return declared
        params = inspect.signature(getattr(self, operation)).parameters.values()
        if any(p.kind is p.VAR_KEYWORD for p in params):
            return None
        return frozenset(_keywords(getattr(self, operation)) | {p.name for p in params if p.kind is p.KEYWORD_ONLY})

    def can(self, operation: str) -> bool:
        """Whether this format implements ``inspect`` or ``verify`` (the defaults only raise)."""
        return getattr(type(self), operation) is not getattr(Format, operation)

    def __repr__(self) -> str:
        return f"<format {self.name!r} {list(self.extensions)}>"


def check_keywords(
    fmt: Format,
    operation: str,
    given: dict[str, Any],
    call: Callable[..., Any],
    uri: str,
    via: Callable[..., Any] | None = None,
) -> None:
    """Refuse a keyword that neither ``call`` (the public function the caller called), ``via`` (a public function
    ``call`` passes its other keywords to) nor ``fmt``'s ``load`` or ``dump`` takes, as Python would, but naming
    ``call``, the file and every option it takes, with the closest one: never a function inside ckptio."""
    accepted = fmt.options(operation, given) if given else None
    passed_on = _keywords(via) if via is not None else set()
    unknown = sorted(set(given) - accepted - passed_on) if accepted is not None else []
    if not unknown:
        return
    takes = sorted(_keywords(call) | passed_on | accepted)  # type: ignore[operator]
    close = difflib.get_close_matches(unknown[0], takes, n=1, cutoff=0.6)
    raise UnknownOptionError(
        f"{call.__name__}() got an unexpected keyword argument {unknown[0]!r}"
        + (f"; did you mean {close[0]!r}?" if close else "")
        + f" ({call.__name__}() of {_uri.masked(uri)!r}, a {fmt.name} file, takes: {', '.join(takes)})"
    )


def _keywords(fn: Callable[..., Any]) -> set[str]:
    """The names ``fn`` takes as keywords with a default (its options, not its subject)."""
    params = inspect.signature(fn).parameters.values()
    return {p.name for p in params if p.default is not p.empty and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)}


class StreamFormat(Format):
    """A format that only needs a writable/readable binary file object."""

    text: ClassVar[bool] = False  # True: dump_file/load_file get text (str) streams

    def dump(
        self,
        obj: Any,
        backend: Backend,
        uri: str,
        *,
        mode: WriteMode = "overwrite",
        durable: bool = True,
        **kwargs: Any,
    ) -> None:
        with backend.open_writer(uri, mode=mode, durable=durable) as w:
            if self.text:
                t = io.TextIOWrapper(_RawWriter(w), encoding="utf-8", write_through=True)
                self.dump_file(obj, t, **kwargs)
                t.flush()
                t.detach()
            elif w.local_fileno() is None:
                self.dump_file(obj, w, **kwargs)  # type: ignore[arg-type]  # a Writer is a binary file-like, not an IO
            else:  # a local file: the dozens of small writes torch.save & co. make, gathered (the writer
                # starts writeback as they land)
                with translate_os_errors(w.uri):
                    f = io.BufferedWriter(_RawWriter(w), LOCAL_BUFFER)  # closing it leaves w open
                    try:
                        self.dump_file(obj, f, **kwargs)
                        f.flush()
                    finally:
                        with contextlib.suppress(OSError):  # after a failed write: that error, not the flush's
                            f.close()

    def load(self, backend: Backend, uri: str, **kwargs: Any) -> Any:
        f = backend.open_reader(uri)
        try:
            if self.text:
                return self.load_file(io.TextIOWrapper(f, encoding="utf-8"), **kwargs)
            return self.load_file(f, **kwargs)
        except FormatError as e:
            if uri in str(e):
                raise
            raise type(e)(f"{uri}: {e}") from e
        finally:
            f.close()


class _RawWriter(io.RawIOBase):
    """A :class:`Writer` as the raw binary stream ``io.TextIOWrapper`` needs (a Writer is not one: it
    has no ``readable``, ``seekable`` or ``closed``). Closing it leaves the writer to its ``with`` block."""

    def __init__(self, w: Writer) -> None:
        super().__init__()
        self._w = w

    @property
    def name(self) -> str:
        return self._w.uri

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        return self._w.write(b)


def jsonable(obj: Any) -> Any:
    """Plain JSON data from inspection results (dataclasses, dtypes, sizes, tuples...)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [jsonable(v) for v in obj]
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else repr(obj)
    if isinstance(obj, bytes):
        return f"<{len(obj)} bytes>"
    name = type(obj).__module__ + "." + type(obj).__name__
    if name in ("torch.dtype", "torch.device"):
        return str(obj).removeprefix("torch.")
    if name == "torch.Size":
        return list(obj)
    return repr(obj)


def flatten(obj: Any, leaf: type | tuple[type, ...] = (), prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted key, leaf) of an inspected tree: dicts, and lists holding containers or ``leaf``
    objects (a format's tensor placeholders), are walked into."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from flatten(v, leaf, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(obj, (list, tuple)) and any(isinstance(v, (dict, list, tuple, *_types(leaf))) for v in obj):
        for i, v in enumerate(obj):
            yield from flatten(v, leaf, f"{prefix}.{i}" if prefix else str(i))
    else:
        yield prefix, obj


def _types(leaf: type | tuple[type, ...]) -> tuple[type, ...]:
    return leaf if isinstance(leaf, tuple) else (leaf,)


def dtype_size(dtype: str) -> int:
    """Bytes per element of a torch dtype named ``"float32"`` or ``"torch.float32"``."""
    import torch

    return torch.empty((), dtype=getattr(torch, dtype.removeprefix("torch.")), device="cpu").element_size()

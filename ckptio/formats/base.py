"""The format interface: how an object becomes bytes on a backend, and back.

A format gets the backend and the resolved URI, so it can stream, issue ranged reads or map a
local file as it sees fit. Simple formats subclass :class:`StreamFormat` and only convert to and
from a file object.
"""

from __future__ import annotations

import abc
import io
from typing import IO, Any, ClassVar

from ..backends.base import Backend, WriteMode, Writer
from ..errors import FormatError


class Format(abc.ABC):
    name: ClassVar[str] = "base"
    extensions: ClassVar[tuple[str, ...]] = ()
    # True: load() gets a node-local cache backend as it is and reads its entries itself (fastpickle's
    # sources do), for formats that read objects next to ``uri``; otherwise it gets the entry's local file
    reads_through_cache: ClassVar[bool] = False

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

    def inspect(self, backend: Backend, uri: str) -> Any:
        """What the file holds, without reading tensor bytes (``ckptio info``)."""
        raise NotImplementedError(f"format {self.name!r} cannot inspect files")

    def verify(self, backend: Backend, uri: str) -> dict[str, Any]:
        """Check everything the format can check (``ckptio verify``); FormatError/IntegrityError if bad."""
        raise NotImplementedError(f"format {self.name!r} cannot verify files")

    def __repr__(self) -> str:
        return f"<format {self.name!r} {list(self.extensions)}>"


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
            else:
                self.dump_file(obj, w, **kwargs)  # type: ignore[arg-type]  # a Writer is a binary file-like, not an IO

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

"""The registered safetensors :class:`~ckptio.formats.base.Format`: ``dump`` / ``load`` of a file
or a stream, sharded checkpoints by their index, and ``headers`` / ``inspect`` / ``verify``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import IO, TYPE_CHECKING, Any

from ...backends.base import Backend, WriteMode
from ...errors import FormatError
from ..base import Format
from ..fastpickle.read import open_source, source_for, with_source
from ..fastpickle.source import Source
from .layout import INDEX_SUFFIX, Inspection
from .read import load_index, load_source, read_header, read_index

if TYPE_CHECKING:
    import torch

# writing imports torch (.write, fastpickle's .write): inside dump/dump_file, so ``ckptio info``/``verify``
# (headers only) does not


class SafetensorsFormat(Format):
    """``dump(tensors, uri, metadata=None)``; ``load(uri, keys=None, map_location=None, mmap=None)``.

    ``mmap=None`` maps local files and reads anything else; ``keys`` loads only those tensors
    (KeyError for a key the file lacks). An index URI loads the sharded checkpoint it describes.
    ``allow_pickle`` is accepted as every format takes it; safetensors holds nothing to unpickle.
    """

    name = "safetensors"
    extensions = (".safetensors", INDEX_SUFFIX)
    reads_through_cache = True  # shards are found next to the index, not next to a cache entry

    def dump(  # type: ignore[override]  # its own keywords only: an unknown one is a TypeError, not ignored
        self,
        obj: Any,
        backend: Backend,
        uri: str,
        *,
        mode: WriteMode = "overwrite",
        durable: bool = True,
        metadata: Mapping[str, str] | None = None,
    ) -> None:
        if uri.lower().endswith(INDEX_SUFFIX):
            raise ValueError(
                f"{uri}: writing sharded safetensors is not supported; dump each shard to a .safetensors file"
            )
        from ..fastpickle.write import sink_for
        from .write import prepare, write_tensors

        header, tensors = prepare(obj, metadata)  # fails before anything is created
        with backend.open_writer(uri, mode=mode, durable=durable) as w:
            write_tensors(header, tensors, sink_for(w, durable and getattr(backend, "durable", True)))

    def load(  # type: ignore[override]  # its own keywords only, as dump
        self,
        backend: Backend,
        uri: str,
        *,
        keys: Iterable[str] | None = None,
        map_location: Any = None,
        mmap: bool | None = None,
        allow_pickle: bool = False,
    ) -> dict[str, torch.Tensor]:
        if uri.lower().endswith(INDEX_SUFFIX):
            return load_index(backend, uri, keys, map_location=map_location, mmap=mmap)
        return with_source(
            source_for(backend, uri), lambda src: load_source(src, keys=keys, map_location=map_location, mmap=mmap)
        )

    def dump_file(self, obj: Any, f: IO, *, metadata: Mapping[str, str] | None = None, **kw: Any) -> None:
        from ..fastpickle.write import Sink, writer_for
        from .write import prepare, write_tensors

        header, tensors = prepare(obj, metadata)
        write_tensors(header, tensors, Sink(writer_for(f.write)))

    def load_file(  # type: ignore[override]  # its own keywords only, as dump
        self,
        f: IO,
        *,
        keys: Iterable[str] | None = None,
        map_location: Any = None,
        mmap: bool | None = None,
        allow_pickle: bool = False,
    ) -> dict[str, torch.Tensor]:
        return with_source(
            open_source(f, {}), lambda src: load_source(src, keys=keys, map_location=map_location, mmap=mmap)
        )

    def headers(self, backend: Backend, uri: str) -> Inspection:
        """The header(s), validated; no tensor bytes are read."""
        if not uri.lower().endswith(INDEX_SUFFIX):

            def one(src: Source) -> Inspection:
                metadata, entries, _ = read_header(src)
                return Inspection(uri, src.size, metadata, entries, [uri])

            return with_source(source_for(backend, uri), one)
        metadata, weight_map = read_index(backend, uri)
        out = Inspection(uri, backend.stat(uri).size, metadata)
        for shard in dict.fromkeys(weight_map.values()):
            part = self.headers(backend, shard)
            listed = [e for e in part.tensors if weight_map.get(e.key) == shard]
            missing = {k for k, s in weight_map.items() if s == shard} - {e.key for e in listed}
            if missing:
                raise FormatError(f"{uri} maps {sorted(missing)[0]!r} to {shard}, which has no such tensor")
            out.tensors += listed
            out.files.append(shard)
            out.size += part.size
        return out

    def inspect(self, backend: Backend, uri: str) -> dict[str, Any]:
        insp = self.headers(backend, uri)
        tensors = [
            {"key": t.key, "dtype": t.torch_dtype or t.dtype, "shape": list(t.shape), "nbytes": t.nbytes}
            for t in insp.tensors
        ]
        out: dict[str, Any] = {
            "format": "safetensors",
            "tensors": tensors,
            "tensor_bytes": sum(t["nbytes"] for t in tensors),
            "values": insp.metadata,
            "size": insp.size,
        }
        if insp.files != [uri]:
            out["shards"] = len(insp.files)
        return out

    def verify(self, backend: Backend, uri: str) -> dict[str, Any]:
        """Everything safetensors can check: the header(s), offsets, sizes and the shard index."""
        insp = self.headers(backend, uri)
        return {
            "checked": len(insp.files),
            "unchecked": 0,
            "tensors": len(insp.tensors),
            "what": "headers, offsets and sizes of every file (safetensors stores no checksums)",
        }

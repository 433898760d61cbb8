"""The registered ``fastpickle`` :class:`~ckptio.formats.base.Format` and the public ``save`` / ``load``
/ ``inspect``; ``FastpickleFormat.inspect`` and ``.verify`` give the JSON-able reports of ``ckptio
info`` and ``ckptio verify``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import IO, TYPE_CHECKING, Any

from ...backends.base import Backend, WriteMode
from ...errors import FormatError
from ..base import Format
from .decode import decode_tree, tensor_factory
from .layout import FLAG_PICKLE, VERSION, Inspection, Meta
from .meta import read_meta
from .payloads import map_payloads, read_payloads
from .read import gc_paused, open_source, source_for, with_source
from .report import VERIFIED, inspect_report
from .select import Ref, refs, select, substitute
from .source import Source

if TYPE_CHECKING:
    import torch

# Writing and loading tensors import torch (.encode, .write, .into): inside the functions that do it, so
# inspecting a file (``ckptio info``: .read, .decode, .report) does not.

__all__ = ["save", "load", "inspect", "FastpickleFormat"]


def load_source(
    src: Source,
    *,
    map_location: Any = None,
    mmap: bool | None = None,
    keys: Iterable[Any] | None = None,
    verify: bool | None = None,
    allow_pickle: bool = False,
    into: Any = None,
    check: Callable[[Any], None] | None = None,
) -> Any:
    """``check``: called with the file's tree (tensors as their :class:`.layout.TensorInfo`: shape, dtype) before
    any tensor byte is read or written into ``into``; what it raises is the load's error."""
    if verify is None:  # an explicit mapping stays lazy unless verification is asked for
        verify = mmap is not True
    share = mmap is None  # by default a remote load may return views of what it read ahead (not mmap=False)
    if mmap is None:  # a file ckptio opened by path (replaced by rename, never rewritten in place): mapped
        mmap = src.mappable and into is None
    # a full load reads ahead the ends of a remote file (staged); a load into the caller's tensors does not
    full = keys is None and not mmap and into is None
    if full and share:
        src = src.held_whole()  # a small memory:// object: one read, then views of it
    meta = read_meta(src, full=full, views=share)
    if meta.flags & FLAG_PICKLE and not allow_pickle:
        raise FormatError(
            f"{src.name} contains pickled objects, and unpickling can run arbitrary code; "
            f"pass allow_pickle=True only if you trust the file"
        )
    if check is not None:
        if meta.check is not None:  # a damaged header or metadata is the error to report, not a mismatch
            meta.check()
            meta.check = None
        check(decode_tree(meta, meta.tensors.__getitem__, allow_pickle))
    if keys is not None:
        keys = list(keys)
        skeleton = decode_tree(meta, Ref, allow_pickle)
        picked = [(k, select(skeleton, k)) for k in keys]
        needed: set[int] = set()
        for _, sub in picked:
            refs(sub, needed)
        sidxs = sorted({meta.tensors[i].storage for i in needed})
    else:
        sidxs = sorted({t.storage for t in meta.tensors})
    import torch

    from .into import byte_view

    targets = {} if into is None or mmap or keys is not None else _targets(meta, into, map_location, allow_pickle)
    try:
        if mmap:
            payloads = map_payloads(src, meta, sidxs, verify)
        else:
            bufs = {meta.tensors[i].storage: byte_view(t) for i, t in targets.items()}
            payloads = read_payloads(src, meta, sidxs, verify, bufs, share)
            for t in targets.values():  # written behind autograd's back: as an in-place op would
                torch.autograd.graph.increment_version(t)
    finally:
        if meta.check is not None:  # a bad header or metadata checksum is the error to report
            meta.check()
    make = tensor_factory(meta, payloads, map_location, targets)
    if keys is not None:
        return {(k if isinstance(k, str) else ".".join(map(str, k))): substitute(sub, make) for k, sub in picked}
    return decode_tree(meta, make, allow_pickle)


def _targets(meta: Meta, into: Any, map_location: Any, allow_pickle: bool) -> dict[int, torch.Tensor]:
    """The stored tensors to read into the caller's tensors (:mod:`.into`); the metadata is checked first."""
    from .into import plan_into

    if meta.check is not None:  # remote full loads check it after the reads: no target is touched before
        meta.check()
        meta.check = None
    return plan_into(meta, decode_tree(meta, Ref, allow_pickle), into, map_location)


def load(
    uri_or_file: Any,
    *,
    map_location: Any = None,
    mmap: bool | None = None,
    keys: Iterable[Any] | None = None,
    verify: bool | None = None,
    allow_pickle: bool = False,
    **backend_options: Any,
) -> Any:
    """Load a fastpickle file from a URI or an open binary file. Never runs code unless ``allow_pickle``.

    ``map_location`` works like ``torch.load``'s (device, string, dict of locations, or
    ``fn(storage, location)``). A local file (a path, a local URI, a node-local cache entry) is mapped
    by default: tensors are copy-on-write views of a private mapping (``mmap=None``), no second copy
    of the bytes is made, and every payload checksum is verified first (two threads hash). ``mmap=False``
    reads into fresh memory instead (an open file object always is); ``mmap=True`` maps without
    verifying (lazily paged: only the pages used are read) unless ``verify=True``. A mapped tensor
    sees the file's pages: a program that truncates or rewrites the file in place (not ckptio, which
    replaces files by rename) can change it or crash the process with SIGBUS on access; load with
    ``mmap=False`` where that can happen. ``keys=["model.fc.weight", "optim"]`` reads only the byte
    ranges those subtrees need and returns ``{key: value}``; dict keys may themselves contain dots.
    Payload checksums are verified unless ``verify=False``; the metadata checksum always is.
    """
    return with_source(
        open_source(uri_or_file, backend_options),
        lambda src: load_source(
            src, map_location=map_location, mmap=mmap, keys=keys, verify=verify, allow_pickle=allow_pickle
        ),
    )


def inspect(uri_or_file: Any, **backend_options: Any) -> Inspection:
    """The tree (tensors replaced by :class:`TensorInfo`) and the tensor table; reads no tensor bytes."""
    return with_source(open_source(uri_or_file, backend_options), _inspection)


def _inspection(src: Source) -> Inspection:
    meta = read_meta(src)
    tree = decode_tree(meta, meta.tensors.__getitem__, allow_pickle=False, describe=True)
    return Inspection(VERSION, meta.size, bool(meta.flags & FLAG_PICKLE), tree, meta.tensors)


def save(
    obj: Any,
    uri_or_file: Any,
    *,
    allow_pickle: bool = False,
    durable: bool = True,
    mode: WriteMode = "overwrite",
    **backend_options: Any,
) -> None:
    """Save ``obj`` to a URI (any backend, committed atomically) or a writable binary file.

    Unsupported value types raise ``TypeError`` naming their key path, unless ``allow_pickle=True``
    pickles them (the file is then marked and needs ``allow_pickle=True`` to load). ``durable=False``
    skips fsync on local files.
    """
    if isinstance(uri_or_file, (str, os.PathLike)):
        from ...context import resolve

        backend, uri = resolve(uri_or_file, **backend_options)
        FastpickleFormat().dump(obj, backend, uri, mode=mode, durable=durable, allow_pickle=allow_pickle)
    else:
        from .encode import encode
        from .write import Sink, write_stream, writer_for

        with gc_paused():
            enc, tree = encode(obj, allow_pickle)
            write_stream(enc, tree, Sink(writer_for(uri_or_file.write)))


class FastpickleFormat(Format):
    """``.fpk`` for :func:`ckptio.dump` / :func:`ckptio.load`; options as for :func:`save` / :func:`load`."""

    name = "fastpickle"
    extensions = (".fpk",)
    loads_into = True  # load(into=...): see :mod:`.into`
    load_options = frozenset({"map_location", "mmap", "keys", "verify", "allow_pickle", "into", "check"})
    dump_options = frozenset({"mode", "durable", "allow_pickle"})

    def dump(
        self,
        obj: Any,
        backend: Backend,
        uri: str,
        *,
        mode: WriteMode = "overwrite",
        durable: bool = True,
        allow_pickle: bool = False,
        **kwargs: Any,
    ) -> None:
        if kwargs:
            raise TypeError(f"fastpickle dump got unexpected options {sorted(kwargs)}")
        from .encode import encode
        from .write import sink_for, write_stream

        with gc_paused():
            enc, tree = encode(obj, allow_pickle)  # fails before anything is created
            with backend.open_writer(uri, mode=mode, durable=durable) as w:
                write_stream(enc, tree, sink_for(w, durable and getattr(backend, "durable", True)))

    def load(self, backend: Backend, uri: str, **kwargs: Any) -> Any:
        return with_source(source_for(backend, uri), lambda src: load_source(src, **kwargs))

    def inspect(self, backend: Backend, uri: str) -> dict[str, Any]:
        """What ``ckptio info`` shows of the file, JSON-able: tensor table, other values, version; reads
        no tensor bytes."""
        return inspect_report(with_source(source_for(backend, uri), _inspection))

    def verify(self, backend: Backend, uri: str) -> dict[str, Any]:
        """Check every checksum (a full load); raises IntegrityError on corruption, FormatError on a file
        that needs ``allow_pickle``. Returns what ``ckptio verify`` shows: ``{"what": ...}``."""
        self.load(backend, uri, verify=True)
        return {"what": VERIFIED}

    def dump_file(self, obj: Any, f: IO, **kwargs: Any) -> None:
        save(obj, f, **kwargs)

    def load_file(self, f: IO, **kwargs: Any) -> Any:
        return load(f, **kwargs)

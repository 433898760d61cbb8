"""Reading an ``.fpk`` file's metadata from a source (:mod:`.read`): header, footer and metadata
checked and validated (:func:`.layout.validate`) before anything is decoded or allocated; for a
remote full load the source reads ahead first, and the header is checked once its request is in.
"""

from __future__ import annotations

import msgpack
import xxhash

from ...errors import FormatError, IntegrityError
from ...threads import Pool
from .. import sniff
from .layout import ALIGN, FOOTER, FOOTER_MAGIC, HEADER, MAGIC, VERSION, Meta, reason, validate
from .read import BackendSource
from .source import Source


def _not_fpk(name: str, header: bytes | memoryview) -> FormatError:
    """The error for a file without fastpickle's magic: the format its first bytes show, if known."""
    return sniff.mismatch(name, "fastpickle", header) or FormatError(f"{name}: not a fastpickle file (bad magic)")


def read_meta(src: Source, full: bool = False, views: bool = False) -> Meta:
    """The validated metadata. ``full``: every payload will be read (remote sources may read ahead);
    ``views``: payloads read ahead may be returned as views of what holds them (a remote source then
    reads a small object's middle ahead too: :meth:`BackendSource.read_ahead`)."""
    ahead = src if full and isinstance(src, BackendSource) and not src.local else None
    if ahead is not None:  # the header is checked once its request is in, while the payloads are being read
        ahead.read_ahead(middle=views)  # the object's size comes with its first request's headers
    name, size = src.name, src.size
    if size < HEADER.size + FOOTER.size:
        short = IntegrityError(f"{name}: {size} bytes is too short for a fastpickle file (truncated?)")
        raise (sniff.mismatch(name, "fastpickle", src.view(0, size)) if size else None) or short
    # remote sources: the header and a speculative tail (footer + usually all metadata) in parallel
    tail_len = min(size - HEADER.size, max(FOOTER.size, src.prefetch))
    header: bytes | memoryview = b""
    deferred = ahead is not None
    if ahead is not None:
        tail = src.view(size - tail_len, tail_len)
    elif src.concurrency > 1 and src.prefetch and not src.local:  # no request latency to hide locally
        with Pool(2, thread_name_prefix="fpk-meta") as ex:
            head_f = ex.submit(src.read, 0, HEADER.size)
            tail = src.view(size - tail_len, tail_len)
            header = head_f.result()
    else:
        header, tail = src.view(0, HEADER.size), src.view(size - tail_len, tail_len)
    footer = tail[-FOOTER.size :]
    meta_off, meta_len, meta_hash, rec_size, version, flags, foot_hash, magic = FOOTER.unpack(footer)
    if not deferred and header[:8] != MAGIC:
        raise _not_fpk(name, header)
    if magic != FOOTER_MAGIC or xxhash.xxh3_64_intdigest(footer[:48]) != foot_hash:
        if deferred and src.view(0, HEADER.size)[:8] != MAGIC:
            raise _not_fpk(name, src.view(0, HEADER.size))
        raise IntegrityError(
            f"{name}: no valid footer in the last {FOOTER.size} bytes: the file is truncated or has trailing bytes"
        )
    if version > VERSION:
        raise FormatError(f"{name}: fastpickle version {version} is newer than this reader ({VERSION}); upgrade ckptio")
    if rec_size != size:
        raise IntegrityError(f"{name}: file is {size} bytes but its footer records {rec_size} (truncated or extended)")
    if meta_off < HEADER.size or meta_off + meta_len + FOOTER.size != size:
        raise IntegrityError(f"{name}: metadata range [{meta_off}, {meta_off + meta_len}) does not fit the file")
    if meta_off >= size - tail_len:
        meta_bytes = tail[meta_off - (size - tail_len) : -FOOTER.size]
    else:
        meta_bytes = src.view(meta_off, meta_len)

    def check_header(header: bytes | memoryview) -> None:
        hmagic, hversion, hflags, align = HEADER.unpack(header)
        if hmagic != MAGIC:
            raise _not_fpk(name, header)
        h = xxhash.xxh3_64()
        h.update(header)
        h.update(meta_bytes)
        if h.intdigest() != meta_hash:
            raise IntegrityError(
                f"{name}: metadata checksum mismatch (header or bytes [{meta_off}, {meta_off + meta_len}))"
            )
        if (hversion, hflags) != (version, flags) or align != ALIGN:
            raise FormatError(f"{name}: header and footer disagree")

    if not deferred:
        check_header(header)
    try:
        try:
            meta = msgpack.unpackb(meta_bytes, raw=False, strict_map_key=False, use_list=True)
            out = validate(meta, name, size, meta_off, flags)
        except FormatError:
            raise
        except (ValueError, TypeError, KeyError, IndexError, OverflowError, RecursionError) as e:
            raise FormatError(f"{name}: malformed metadata: {reason(e)}") from e
    except FormatError:
        if deferred:  # a checksum mismatch (corruption) explains malformed metadata better
            check_header(src.view(0, HEADER.size))
        raise
    if deferred:  # verified before anything is decoded or returned; the footer's own checksum held
        out.check = lambda: check_header(src.view(0, HEADER.size))
    return out

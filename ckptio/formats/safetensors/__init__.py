"""safetensors (``.safetensors``) and sharded safetensors (``.safetensors.index.json``), without the package.

Layout (https://github.com/huggingface/safetensors)::

    u64 N      little-endian length of the header
    N bytes    JSON object, UTF-8, starts with ``{``, padded with spaces:
               {"__metadata__": {str: str}, KEY: {"dtype": "F32", "shape": [2, 3], "data_offsets": [BEGIN, END]}, ...}
    tensors    raw little-endian bytes; each tensor's [BEGIN, END) is relative to the end of the header

Writing matches ``safetensors.torch.save_file`` byte for byte: tensors ordered by dtype (the
package's enum order, largest first) then key, compact JSON, the header padded to a multiple of 8.
One difference: metadata keys keep the caller's order (the package writes them in hash order, so
its own output varies between runs when there are several).

Reading treats the file as untrusted. Before anything is allocated the header length is checked
against the file and a 100 MB limit, then the header must be a JSON object without duplicate keys,
every dtype known, every shape a list of non-negative integers whose size in bytes is exactly
``END - BEGIN``, and the tensors must cover the data exactly: no gap, no overlap, nothing after the
last one (the package's own rules). Every violation is a :class:`~ckptio.errors.FormatError`
(:class:`~ckptio.errors.IntegrityError` for truncation) naming the file and the key.

Loads reuse fastpickle's sources and the backend's parallel ranged reads. A local file (or node-cache
entry) is mapped privately and each tensor is a copy-on-write view of the mapping (what
``safetensors.torch.load_file`` does; ``mmap=False`` reads into fresh memory with ``preadv``
instead). Any other storage: the header first (one read of the first 256 KiB), then, for a full
load, the rest of the file into one allocation with the backend's ``readinto`` (``part_size``
ranges, ``concurrency`` at a time, no staging copy), each tensor a storage of its own over its
bytes, as with a mapping; with ``keys`` only the byte ranges of those tensors, through fastpickle's
coalesced parallel reads. A tensor stored at an offset that is not a multiple of its element size
is copied into aligned memory.

A sharded checkpoint is loaded by naming its index (``ckptio.load(".../model.safetensors.index.json")``):
the shards it names in ``weight_map`` are read from the index's directory, each only for the keys
the index assigns to it, and returned as one dict. A shard name must be a relative path below that
directory ending in ``.safetensors`` (no ``..``, no absolute path, no URI).

The package, by responsibility: :mod:`.layout` (limits, the dtype table, header validation),
:mod:`.read` (headers, shard indexes, tensors), :mod:`.write` (the header and the byte stream),
:mod:`.format` (the registered Format). This module re-exports the public names.
"""

from .format import SafetensorsFormat
from .layout import INDEX_SUFFIX, MAX_HEADER, Inspection, TensorEntry, parse_header

__all__ = ["SafetensorsFormat", "Inspection", "TensorEntry", "MAX_HEADER", "INDEX_SUFFIX", "parse_header"]

"""fastpickle: a safe, zero-copy, tensor-aware checkpoint format (``.fpk``).

Any training state (nested dicts, lists, tuples, sets, scalars, tensors, numpy arrays, optimizer and
scheduler state dicts) is stored at disk speed, and loading never executes code unless the file was
written with, and is read with, ``allow_pickle=True``.

The package, by responsibility: :mod:`.layout` (the byte layout, dtype tables, metadata validation),
:mod:`.encode` (object tree -> msgpack tree, tensor table, storages), :mod:`.write` (sinks, the byte
stream), :mod:`.read` (sources), :mod:`.meta` (the checked metadata), :mod:`.pacing` (what a remote
store's replies showed, and the read sizes drawn from it), :mod:`.payloads` (payload reads and
mappings), :mod:`.decode` (tree decoding,
tensors from payloads), :mod:`.select` (partial loads), :mod:`.format` (the registered Format and
``save`` / ``load`` / ``inspect``). ``ckptio.fastpickle`` re-exports the public names.
"""

from .format import FastpickleFormat, inspect, load, save
from .layout import Inspection, PickledObject, TensorInfo

__all__ = ["save", "load", "inspect", "FastpickleFormat", "Inspection", "TensorInfo", "PickledObject"]

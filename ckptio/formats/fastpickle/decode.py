"""Decoding a ``.fpk`` object tree without native recursion, and making its tensors and arrays from
payloads that were read (see :mod:`.read`), on the devices ``map_location`` asks for.
"""

from __future__ import annotations

import collections
import pickle
import struct
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import msgpack
import numpy as np

from ... import torch_internals as _ti
from ...errors import FormatError
from .layout import (
    EXT_BIGINT,
    EXT_COMPLEX,
    EXT_DEVICE,
    EXT_DTYPE,
    EXT_FROZENSET,
    EXT_GDICT,
    EXT_NPDTYPE,
    EXT_NPSCALAR,
    EXT_ODICT,
    EXT_PICKLE,
    EXT_SET,
    EXT_SIZE,
    EXT_TENSOR,
    EXT_TUPLE,
    MAX_DEPTH,
    UINT64_MAX,
    Meta,
    PickledObject,
    _torch_tables,
    describe_payload,
    is_int,
    np_dtype,
    reason,
)

if TYPE_CHECKING:
    import torch

_CONTAINER_EXTS = frozenset((EXT_TUPLE, EXT_ODICT, EXT_GDICT, EXT_SET, EXT_FROZENSET))


class _Pending:
    """A container extension whose items hold containers, built later by :func:`decode_tree`'s loop.

    ``data`` is its msgpack, still to unpack (``items`` stays empty until then), or None once ``items``
    holds the unpacked list. Nested extensions are never unpacked from inside msgpack's ext hook more
    than one level down: each nested ``unpackb`` takes tens of KB of C stack, so a few hundred nested
    tuples used to overflow it (a segfault).
    """

    __slots__ = ("code", "data", "items", "depth", "parent", "slot")

    def __init__(self, code: int, data: bytes | None, items: list) -> None:
        self.code, self.data, self.items = code, data, items
        self.parent: Any = None  # the list or dict holding it, at ``slot``, ``depth`` containers deep
        self.slot: Any = None
        self.depth = 0


_WALK = frozenset((list, dict, _Pending))
_BUILT = frozenset((tuple, set, frozenset, collections.OrderedDict))  # from extensions holding no containers


def _place(top: list | dict, depth: int, placed: list[_Pending]) -> None:
    """Check the nesting below ``top`` (a container at ``depth``); note where each placeholder sits.

    A container whose items hold no list, dict or placeholder is not walked: a long list of numbers
    or a small dict of tensors costs no Python work per item.
    """
    stack = [(top, depth)]
    while stack:
        c, d = stack.pop()
        d += 1  # the depth of c's items
        if _flat(c.values() if type(c) is dict else c, d):
            continue
        if d > MAX_DEPTH:
            raise _too_deep()
        for k, v in c.items() if type(c) is dict else enumerate(c):
            t = type(v)
            if t is list or t is dict:
                if not _flat(v.values() if t is dict else v, d + 1):
                    stack.append((v, d))
            elif t is _Pending:
                v.parent, v.slot, v.depth = c, k, d
                placed.append(v)


def _flat(items: Iterable[Any], d: int) -> bool:
    """Whether ``items`` (at depth ``d``) hold no list, dict or placeholder; raises if they hold containers
    built already deeper than MAX_DEPTH."""
    if not _WALK.isdisjoint(map(type, items)):
        return False
    if d > MAX_DEPTH and not _BUILT.isdisjoint(map(type, items)):
        raise _too_deep()
    return True


def _too_deep() -> FormatError:
    return FormatError(f"containers nested more than {MAX_DEPTH} deep, the most fastpickle supports")


def _build(code: int, items: list) -> Any:
    if code == EXT_TUPLE:
        return tuple(items)
    if code == EXT_SET:
        return set(items)
    if code == EXT_FROZENSET:
        return frozenset(items)
    if len(items) % 2:
        raise FormatError("dict with an odd number of items")
    pairs = zip(items[0::2], items[1::2], strict=True)
    return collections.OrderedDict(pairs) if code == EXT_ODICT else dict(pairs)


def _unpack_plain(data: bytes) -> Any:
    """Unpack data that holds no container extensions (an extension comes back as an ExtType)."""
    return msgpack.unpackb(data, raw=False, strict_map_key=False, use_list=True)


def decode_tree(meta: Meta, tensor: Callable[[int], Any], allow_pickle: bool, describe: bool = False) -> Any:
    """Decode the object tree; ``tensor(i)`` supplies tensor ``i``. ``describe``: pickles become PickledObject.

    No native recursion: the ext hook unpacks a container extension one level down, where nested
    ones become :class:`_Pending` placeholders. One holding no containers (a tuple of numbers) is
    built at once; any other is placed by :func:`_place`, which checks the depth against the same
    MAX_DEPTH as at save; a loop unpacks and places the placeholders' own placeholders, then builds
    them deepest first, each into its slot.
    """
    ntensors = len(meta.tensors)
    created = 0

    def leaf(code: int, data: bytes) -> Any:
        if code == EXT_TENSOR:
            idx = int.from_bytes(data, "little")
            if len(data) != 4 or idx >= ntensors:
                raise FormatError(f"tensor reference {data!r} out of range")
            return tensor(idx)
        if code == EXT_SIZE:
            dims = _unpack_plain(data)
            if type(dims) is not list or not all(is_int(d, 0, UINT64_MAX) for d in dims):
                raise FormatError("torch.Size with non-integer dimensions")
            import torch  # here, not at the top: inspecting a tree without these values needs no torch

            return torch.Size(dims)
        if code == EXT_BIGINT:
            return int.from_bytes(data, "little", signed=True)
        if code == EXT_COMPLEX:
            re, im = struct.unpack("<dd", data)
            return complex(re, im)
        if code == EXT_DTYPE:
            dt = _torch_tables()[0].get(data.decode())
            if dt is None:
                raise FormatError(f"unknown torch dtype {data[:40]!r}")
            return dt
        if code == EXT_DEVICE:
            import torch

            return torch.device(data.decode())
        if code == EXT_NPDTYPE:
            return np_dtype(data.decode(), "numpy dtype value")
        if code == EXT_NPSCALAR:
            v = _unpack_plain(data)
            if type(v) is not list or len(v) != 2:
                raise FormatError("numpy scalar is not a [dtype, bytes] pair")
            dts, raw = v
            npdt = np_dtype(dts, "numpy scalar")
            if type(raw) is not bytes or len(raw) != npdt.itemsize or not npdt.itemsize:
                raise FormatError(f"numpy scalar of {dts} with {len(raw) if type(raw) is bytes else 'no'} bytes")
            return np.frombuffer(raw, dtype=npdt)[0]
        if code == EXT_PICKLE:
            if describe:
                return PickledObject(len(data))
            if not allow_pickle:  # unreachable through load(), which checks the file flag first
                raise FormatError(f"{meta.source} contains pickled objects; pass allow_pickle=True if you trust it")
            return pickle.loads(data)
        raise FormatError(f"unknown extension type {code}")

    def inner(code: int, data: bytes) -> Any:  # one level down: containers wait for the loop
        nonlocal created
        if code in _CONTAINER_EXTS:
            created += 1
            return _Pending(code, data, [])
        return leaf(code, data)

    def hook(code: int, data: bytes) -> Any:
        nonlocal created
        if code not in _CONTAINER_EXTS:
            return leaf(code, data)
        items = msgpack.unpackb(data, ext_hook=inner, raw=False, strict_map_key=False, use_list=True)
        if type(items) is not list:
            raise FormatError(f"extension {code} does not hold a list")
        if _WALK.isdisjoint(map(type, items)):
            return _build(code, items)
        created += 1
        return _Pending(code, None, items)

    def unpack(data: bytes) -> Any:
        return msgpack.unpackb(data, ext_hook=hook, raw=False, strict_map_key=False, use_list=True)

    try:
        root = [unpack(meta.tree)]
        placed: list[_Pending] = []
        _place(root, 0, placed)
        i = 0
        while i < len(placed):  # placed grows as placeholders' items are placed in turn
            p = placed[i]
            i += 1
            if p.data is not None:
                items = unpack(p.data)
                if type(items) is not list:
                    raise FormatError(f"extension {p.code} does not hold a list")
                p.items, p.data = items, None
            _place(p.items, p.depth, placed)
        if created != len(placed):
            raise FormatError("a tuple, set or dict extension used as a map key")
        if not placed:  # no tuple, set or non-str-keyed dict: nothing left to build
            return root[0]
        by_depth: list[list[_Pending]] = [[] for _ in range(MAX_DEPTH + 1)]
        for p in placed:
            by_depth[p.depth].append(p)
        for level in reversed(by_depth):  # the deepest first: a placeholder's items are built before it
            for p in level:
                p.parent[p.slot] = _build(p.code, p.items)
        return root[0]
    except FormatError as e:
        raise FormatError(f"{meta.source}: malformed tree: {e}") from e
    except (
        ValueError,
        TypeError,
        KeyError,
        IndexError,
        OverflowError,
        RecursionError,
        struct.error,
        UnicodeDecodeError,
        RuntimeError,
    ) as e:
        raise FormatError(f"{meta.source}: malformed tree: {reason(e)}") from e


def _target_storage(storage: torch.UntypedStorage, location: str, map_location: Any) -> torch.UntypedStorage:
    import torch

    if callable(map_location):
        out = map_location(storage, location)
        if out is not None:
            return getattr(out, "_untyped_storage", out)
        map_location = None
    if isinstance(map_location, dict):
        target = map_location.get(location, location)
    elif map_location is not None:
        target = str(map_location)
    else:
        target = location
    try:
        dev = torch.device(target)
    except (RuntimeError, TypeError, ValueError) as e:
        raise FormatError(f"invalid device location {target!r}") from e
    if dev.type == "cpu":
        return storage
    if dev.type == "meta":  # shapes, strides and dtypes without data, as torch.load(map_location="meta") gives
        return torch.UntypedStorage(storage.nbytes(), device=dev)
    try:
        return storage.to(device=dev)
    except Exception as e:  # no such device, or its module is not available here
        raise FormatError(
            f"cannot restore tensors saved on {location!r} to {target!r} ({type(e).__name__}: {e}); "
            f"pass map_location='cpu' or another device"
        ) from e


def tensor_factory(
    meta: Meta, payloads: dict[int, torch.Tensor], map_location: Any, targets: dict[int, torch.Tensor] | None = None
) -> Callable[[int], Any]:
    """``make(tensor index)``: the stored tensor over its payload (``targets``: tensors read in place are
    the caller's own)."""
    import torch

    dtypes, quant_int = _torch_tables()
    storages: dict[int, torch.UntypedStorage] = {}
    made: dict[int, Any] = dict(targets or {})

    cpu_only = map_location is None or (isinstance(map_location, (str, torch.device)) and str(map_location) == "cpu")

    def storage(sidx: int) -> torch.UntypedStorage:
        st = storages.get(sidx)
        if st is None:
            st = payloads[sidx].untyped_storage()
            if not (cpu_only and meta.storages[sidx][3] == "cpu"):
                st = _target_storage(st, meta.storages[sidx][3], map_location)
            storages[sidx] = st
        return st

    if not (cpu_only and meta.all_cpu):  # devices first: their errors name the file and tensor, not the tree
        for sidx in sorted(payloads.keys() & {t.storage for t in meta.tensors if t.kind != "numpy"}):
            try:
                storage(sidx)
            except FormatError as e:
                raise FormatError(f"{meta.source}: {describe_payload(meta, sidx)}: {e}") from e

    def torch_dtype(name: str, path: str) -> torch.dtype:
        dt = dtypes.get(name)
        if dt is None:  # a dtype of a newer torch than this one (the file passed the checks of layout.ELEMENTS)
            raise FormatError(f"{meta.source}: tensor {path!r} has dtype {name}, which this torch version lacks")
        return dt

    def make(idx: int) -> Any:
        out: Any = made.get(idx)
        if out is not None:
            return out
        info = meta.tensors[idx]
        if info.kind == "torch":  # the usual case first
            st = storage(info.storage)
            out = torch.empty(0, dtype=torch_dtype(info.dtype, info.path), device=st.device).set_(
                st, info.storage_offset, info.shape, info.stride
            )
            if info.parameter:
                out = torch.nn.Parameter(out, requires_grad=info.requires_grad)
            elif info.requires_grad:
                out.requires_grad_(True)
        elif info.kind == "numpy":
            dt = np_dtype(info.dtype, meta.source)
            u8 = payloads[info.storage]
            out = u8.numpy().view(dt).reshape(info.shape) if u8.numel() else np.empty(info.shape, dtype=dt)
        else:  # "quantized" (validate() admits no other kind)
            st = storage(info.storage)
            ints = torch.empty(0, dtype=quant_int[torch_dtype(info.dtype, info.path)], device=st.device).set_(
                st, info.storage_offset, info.shape, info.stride
            )
            q = meta.qparams[idx]
            if q[0] == "per_tensor_affine":
                out = _ti.make_per_tensor_quantized_tensor(ints, q[1], q[2])
            else:
                out = _ti.make_per_channel_quantized_tensor(
                    ints,
                    torch.tensor(q[1], dtype=torch.float64, device=st.device),
                    torch.tensor(q[2], dtype=torch.int64, device=st.device),
                    q[3],
                )
        made[idx] = out
        return out

    return make

"""Loading pickles without running code: the default of the ``pickle`` format (``.pkl``).

``pickle.load`` calls whatever the file names, so a crafted ``.pkl`` runs code. :func:`load` uses the
C unpickler with ``find_class`` restricted to an allow-list, and ``persistent_load`` refused:

* immutable built-in types and the stdlib's C types (``set``, ``frozenset``, ``complex``, ``slice``,
  ``list``, ``dict``, ``tuple``, ``int``, ``float``, ``str``, ``bool``, ``collections.OrderedDict``,
  ``defaultdict``, ``deque``, ``datetime``'s classes; ``decimal.Decimal`` is checked). Being immutable, none of
  them can be rewritten by a ``BUILD`` opcode (``setattr`` on a class), and their constructors only
  build data. ``bytes``/``bytearray``/``_codecs.encode`` go through checks (no size arguments, only
  the latin-1 text that pickle protocols 0-2 use for bytes).
* numpy arrays, scalars and dtypes, rebuilt by ckptio. numpy's own unpickling trusts the file: a
  dtype's ``__setstate__`` takes its flags, field offsets and item size from the file, so a crafted
  dtype turns raw bytes into object pointers (a crash at best). Here ``numpy.dtype`` and
  ``_reconstruct`` return stand-ins that only record what the file says; a dtype is then built by
  ``numpy.dtype()`` from its parsed description (type code, byte order, fields, subarray, datetime
  unit), never from the file's flags (but the aligned-struct bit), and an array from such a dtype and
  data of the right size (a list for object dtypes, bytes otherwise), so no state from the file
  reaches numpy's ``__setstate__`` unchecked. Only ``numpy.ndarray`` itself is admitted, no
  subclass. The C unpickler keeps the stand-in wherever the file put it, so when a file held numpy
  objects one pass over the result swaps the stand-ins for the arrays and dtypes (plain pickles
  skip it and load at full C speed).

Everything else (any other class or function, ``copyreg._reconstructor``, ``builtins.eval``, torch
tensors...) raises :class:`FormatError` naming the class, before anything is called. Files from
trusted sources load with plain ``pickle`` through ``allow_pickle=True``.

Extension codes (the ``EXT1/2/4`` opcodes of :mod:`copyreg`'s registry) are refused: the C unpickler
serves a code that any earlier load in the process resolved from a cache, without ``find_class``.
While the process has codes registered (rare), loads go through pickle's Python unpickler, whose
extension lookup this module overrides; otherwise no code can resolve and the C unpickler is used.

Nothing large is allocated from a small file, and no shared object changes: the memo indices are
checked before unpickling (:func:`ckptio.formats.pickle_scan.memo_problem`); the checked functions
refuse ``BUILD`` (:mod:`ckptio.formats.pickle_guard`); a ``Decimal`` whose integer part would have
more digits than ``int()`` converts from text (``sys.get_int_max_str_digits()``) is refused, so
``int(Decimal("1E+3000000"))`` cannot run for minutes; object arrays together may take at most
16 bytes per byte of the pickle (their items' pointers), and an array of a subarray dtype (which
numpy never pickles: it folds the subarray into the shape) is refused.
"""

from __future__ import annotations

import collections
import datetime
import decimal
import math
import pickle
import re
import sys
from typing import IO, Any

from ..errors import FormatError
from .pickle_guard import guard
from .pickle_scan import memo_problem

_HINT = "if you trust the file, load it with allow_pickle=True (plain pickle, which runs code from the file)"

_TYPES: dict[tuple[str, str], Any] = {
    **{("builtins", t.__name__): t for t in (set, frozenset, complex, slice, list, dict, tuple, int, float, str, bool)},
    ("builtins", "Ellipsis"): Ellipsis,
    **{("collections", t.__name__): t for t in (collections.OrderedDict, collections.defaultdict, collections.deque)},
    **{
        ("datetime", t.__name__): t
        for t in (datetime.date, datetime.time, datetime.datetime, datetime.timedelta, datetime.timezone)
    },
}
_IMMUTABLE_TYPE = 1 << 8  # Py_TPFLAGS_IMMUTABLETYPE (Python >= 3.10)
_NP_MODULES = ("numpy.core.multiarray", "numpy._core.multiarray")  # numpy 1.x / 2.x
_NP_NUMERIC = ("numpy.core.numeric", "numpy._core.numeric")
_ENCODINGS = frozenset({"latin1", "latin-1", "iso-8859-1", "ascii", "utf-8", "utf8"})
_DTYPE_KINDS = frozenset("biufcSUVOMm")  # numpy's classic dtypes (not e.g. StringDType, whose data are pointers)
_DTYPE_CODE = re.compile(r"[A-Za-z?][A-Za-z0-9]{0,15}\Z")
_DATETIME_UNIT = re.compile(r"[A-Za-z\u03bc]{1,7}\Z")
_NATIVE = "<" if sys.byteorder == "little" else ">"
_ALIGNED_STRUCT = 0x80  # NPY_ALIGNED_STRUCT in a pickled dtype's flags
_ATOMS = frozenset(
    {
        str,
        bytes,
        int,
        float,
        bool,
        complex,
        type(None),
        bytearray,
        decimal.Decimal,
        datetime.date,
        datetime.time,
        datetime.datetime,
        datetime.timedelta,
        datetime.timezone,
    }
)


def load(f: IO[bytes], **kwargs: Any) -> Any:
    """Unpickle ``f`` admitting only plain data (see the module docstring); ``FormatError`` otherwise.

    ``kwargs`` are ``pickle.Unpickler``'s (``encoding``, ``errors``, ``fix_imports``, ``buffers``).
    """
    import copyreg
    import io

    data = f.read()
    why = memo_problem(data)
    if why is not None:
        raise FormatError(f"the pickle {why}; refusing to unpickle it (the file is corrupt or crafted)")
    u = (_PyUnpickler if copyreg._inverted_registry else _Unpickler)(io.BytesIO(data), **kwargs)  # type: ignore[attr-defined]
    u.object_budget = 16 * len(data) + (1 << 20)
    try:
        obj = u.load()
        return _swap_stand_ins(obj, {}) if u.made_stand_ins else obj
    except FormatError:
        raise
    except RecursionError:
        raise FormatError("the pickle nests too deeply to load") from None
    except (
        pickle.UnpicklingError,
        EOFError,
        ValueError,
        TypeError,
        AttributeError,
        KeyError,
        IndexError,
        ArithmeticError,
    ) as e:  # ArithmeticError: OverflowError, decimal.InvalidOperation
        raise FormatError(f"not a readable pickle of plain data ({type(e).__name__}: {e})") from e


class _Checks:
    """The checks, for pickle's C unpickler (:class:`_Unpickler`) and its Python one (:class:`_PyUnpickler`)."""

    made_stand_ins = False  # set on the instance when a load made one
    object_budget = 1 << 20  # bytes object arrays may still take (load sets it from the pickle's size)

    def find_class(self, module: str, name: str) -> Any:
        import _compat_pickle

        # protocols 0-2 name Python 2 modules (__builtin__.set); map them as pickle's own find_class does
        module, name = _compat_pickle.NAME_MAPPING.get((module, name), (module, name))
        module = _compat_pickle.IMPORT_MAPPING.get(module, module)
        obj = _TYPES.get((module, name))
        if obj is not None and (not isinstance(obj, type) or obj.__flags__ & _IMMUTABLE_TYPE):
            return obj
        special = {
            ("_codecs", "encode"): self._encode,
            ("builtins", "bytes"): self._bytes,
            ("builtins", "bytearray"): self._bytearray,
            ("decimal", "Decimal"): self._decimal,
            ("numpy", "ndarray"): NDARRAY,
            ("numpy", "dtype"): self._dtype,
        }.get((module, name))
        if special is None and module in _NP_MODULES:
            special = {"_reconstruct": self._reconstruct, "scalar": self._scalar}.get(name)
        if special is None and module in _NP_NUMERIC and name == "_frombuffer":
            special = self._frombuffer
        if special is None:
            raise FormatError(
                f"refusing to unpickle {module}.{name}: loading a pickle runs no code by default, "
                f"and only plain data is admitted (containers, numbers, strings, bytes, datetime, "
                f"numpy arrays); {_HINT}"
            )
        # the checked functions as callables that refuse BUILD (which would change them for the process)
        return special if special is NDARRAY else guard(special, f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        raise FormatError(
            f"refusing to unpickle a persistent reference ({type(pid).__name__}): plain pickles of "
            f"data have none; {_HINT}"
        )

    # ---- checked stand-ins for builtins that could allocate or run codecs -----------------------------
    def _encode(self, text: Any, encoding: Any = "utf-8") -> bytes:
        if type(text) is str and encoding == "latin1":  # what pickle writes: the fast path
            return text.encode("latin1")
        if type(text) is not str or not isinstance(encoding, str) or encoding.lower() not in _ENCODINGS:
            raise FormatError(
                f"refusing _codecs.encode({type(text).__name__}, {encoding!r}): pickles encode "
                f"bytes as latin-1 text only; {_HINT}"
            )
        return text.encode(encoding)

    def _decimal(self, value: Any = "0", context: Any = None) -> decimal.Decimal:
        if context is not None:
            raise FormatError(f"refusing decimal.Decimal with a context ({_what(context)}): pickles pass none")
        d = decimal.Decimal(value)
        limit = getattr(sys, "get_int_max_str_digits", lambda: 0)() or 4300  # what int() converts from text
        if d.is_finite() and d.adjusted() >= limit:
            raise FormatError(
                f"refusing decimal.Decimal with {d.adjusted() + 1} digits before the point: more than the "
                f"{limit} int() converts (converting it would run for minutes)"
            )
        return d

    def _bytes(self, *args: Any) -> bytes:
        return bytes(*_data_args("bytes", args))

    def _bytearray(self, *args: Any) -> bytearray:
        return bytearray(*_data_args("bytearray", args))

    # ---- numpy -----------------------------------------------------------------------------------
    def _dtype(self, code: Any, align: Any = False, copy: Any = True) -> DtypeStandIn:
        if not isinstance(code, str) or not _DTYPE_CODE.match(code) or type(align) is not bool:
            raise FormatError(f"refusing numpy.dtype({code!r}, {align!r}): not a pickled dtype's type code")
        self.made_stand_ins = True
        return DtypeStandIn(code, align)

    def _reconstruct(self, subtype: Any, shape: Any = (0,), typecode: Any = b"b") -> ArrayStandIn:
        if subtype is not NDARRAY:
            raise FormatError(
                f"refusing numpy _reconstruct of {_what(subtype)}: only numpy.ndarray is admitted "
                f"(no subclass); {_HINT}"
            )
        self.made_stand_ins = True
        return ArrayStandIn(self._spend)

    def _spend(self, nbytes: int, what: str) -> None:
        if nbytes > self.object_budget:
            raise FormatError(
                f"pickled numpy array of {what} would take {nbytes} bytes, more than its items in the pickle "
                f"can fill (object arrays may take 16 bytes per byte of the pickle)"
            )
        self.object_budget -= nbytes

    def _scalar(self, dtype: Any, data: Any = None) -> Any:
        np = _numpy()
        dt = _dtype_of(dtype)
        if dt.hasobject:
            if dt != np.dtype(object):
                raise FormatError(f"refusing a numpy scalar of {dt} (objects inside a structured scalar)")
            return data  # numpy's own rule: an object scalar is the object
        if type(data) is not bytes or len(data) != dt.itemsize:
            raise FormatError(f"numpy scalar of {dt} needs {dt.itemsize} bytes, got {_what(data)}")
        return np.frombuffer(data, dtype=dt)[0]

    def _frombuffer(self, buf: Any, dtype: Any, shape: Any, order: Any) -> Any:
        np = _numpy()
        dt = _dtype_of(dtype)
        if dt.hasobject or not isinstance(buf, (bytes, bytearray, pickle.PickleBuffer)) or order not in ("C", "F"):
            raise FormatError(f"refusing numpy _frombuffer({_what(buf)}, {dt}, order={order!r})")
        shape = _shape(shape)
        if memoryview(buf).nbytes != math.prod(shape) * dt.itemsize:
            raise FormatError(f"numpy array of {dt} and shape {shape} with {memoryview(buf).nbytes} bytes of data")
        return np.frombuffer(buf, dtype=dt).reshape(shape, order=order)


class _Unpickler(_Checks, pickle.Unpickler):
    pass


class _PyUnpickler(_Checks, pickle._Unpickler):
    def get_extension(self, code: int) -> None:
        raise FormatError(
            f"refusing to unpickle copyreg extension code {code}: plain pickles of data have none; {_HINT}"
        )


NDARRAY = object()  # numpy.ndarray: only _reconstruct's subtype; no attributes, and not a type (NEWOBJ refuses it)


class DtypeStandIn:
    """What a pickled ``numpy.dtype`` says; :attr:`value` is the dtype numpy builds from that description."""

    __slots__ = ("code", "align", "state", "_value")

    def __init__(self, code: str, align: bool) -> None:
        self.code, self.align, self.state, self._value = code, align, None, None

    def __setstate__(self, state: Any) -> None:
        if self.state is not None or self._value is not None:
            raise FormatError("a pickled numpy dtype is given its state twice, or after its use")
        self.state = state

    @property
    def value(self) -> Any:
        if self._value is None:
            self._value = _build_dtype(self.code, self.state)
        return self._value


class ArrayStandIn:
    """A pickled ``numpy.ndarray``; its ``__setstate__`` (the BUILD opcode) builds :attr:`value`."""

    __slots__ = ("_value", "_spend")

    def __init__(self, spend: Any) -> None:
        self._value, self._spend = None, spend

    def __setstate__(self, state: Any) -> None:
        if self._value is not None:
            raise FormatError("a pickled numpy array is given its state twice")
        self._value = _build_array(state, self._spend)

    @property
    def value(self) -> Any:
        if self._value is None:
            raise FormatError("a pickled numpy array has no data (no BUILD after _reconstruct)")
        return self._value


def _numpy() -> Any:
    import numpy

    return numpy


def _what(obj: Any) -> str:
    if obj is NDARRAY:
        return "numpy.ndarray"
    return f"{obj.__module__}.{obj.__qualname__}" if isinstance(obj, type) else type(obj).__name__


def _data_args(name: str, args: tuple) -> tuple:
    if (
        len(args) > 2
        or (args and type(args[0]) not in (bytes, bytearray, list, str))
        or (
            len(args) == 2
            and (type(args[0]) is not str or not isinstance(args[1], str) or args[1].lower() not in _ENCODINGS)
        )
    ):
        raise FormatError(f"refusing {name}{tuple(_what(a) for a in args)}: only bytes data or latin-1 text")
    return args


def _int(v: Any, what: str) -> int:
    if type(v) is not int:
        raise FormatError(f"pickled numpy {what} is {_what(v)}, not an int")
    return v


def _shape(shape: Any) -> tuple[int, ...]:
    if type(shape) is int:
        shape = (shape,)
    if type(shape) is not tuple:
        raise FormatError(f"pickled numpy shape is a {_what(shape)}, not a tuple of sizes")
    for n in shape:
        if type(n) is not int or n < 0:
            raise FormatError(f"pickled numpy shape {shape!r} is not a tuple of sizes")
    return shape


def _dtype_of(obj: Any) -> Any:
    if type(obj) is not DtypeStandIn:
        raise FormatError(f"a pickled numpy dtype is a {_what(obj)}")
    return obj.value


def _build_dtype(code: str, state: Any) -> Any:
    """A dtype from a pickled dtype's type code and state, built by ``numpy.dtype()`` from its parts."""
    np = _numpy()
    try:
        base = np.dtype(code)
        if base.names is not None or base.subdtype is not None or base.kind not in _DTYPE_KINDS:
            raise FormatError(f"pickled numpy dtype code {code!r} is not a plain type code")
        if state is None:
            return base
        if type(state) is not tuple or len(state) not in (8, 9):
            raise FormatError(f"pickled numpy dtype state is a {_what(state)}, not DType's 8 or 9 fields")
        version, order, sub, names, fields, elsize, _alignment, flags = state[:8]
        meta = state[8] if len(state) == 9 else None
        if version not in (3, 4) or type(version) is not int or order not in ("<", ">", "|", "="):
            raise FormatError(f"pickled numpy dtype state has version {version!r}, byte order {order!r}")
        elsize, flags = _int(elsize, "dtype item size"), _int(flags, "dtype flags")
        if sub is not None:
            if type(sub) is not tuple or len(sub) != 2:
                raise FormatError("pickled numpy subarray dtype is not (dtype, shape)")
            dt = np.dtype((_dtype_of(sub[0]), _shape(sub[1])))
        elif names is not None:
            dt = np.dtype(_struct_spec(names, fields, elsize), align=bool(flags & _ALIGNED_STRUCT))
        elif base.kind in "Mm" and type(meta) is tuple and len(meta) == 2 and type(meta[1]) is tuple:
            unit, num = meta[1][:2]
            unit = unit.decode("ascii") if type(unit) is bytes else unit
            if type(unit) is not str or not _DATETIME_UNIT.match(unit):
                raise FormatError(f"pickled numpy datetime unit {unit!r}")
            dt, meta = np.dtype(f"{code}[{_int(num, 'datetime step')}{unit}]"), meta[0]
        elif base.kind in "USV" and elsize > 0:
            dt = np.dtype(f"{base.kind}{elsize // 4 if base.kind == 'U' else elsize}")
        else:
            dt = base
        if order in "<>" and order != _NATIVE and dt.byteorder != "|":
            dt = dt.newbyteorder(order)
        if elsize > 0 and dt.itemsize != elsize:
            raise FormatError(f"pickled numpy dtype {dt} says its items have {elsize} bytes")
        return np.dtype(dt, metadata=meta) if isinstance(meta, dict) and meta else dt
    except (TypeError, ValueError, UnicodeDecodeError) as e:
        if isinstance(e, FormatError):
            raise
        raise FormatError(f"not a valid pickled numpy dtype ({e})") from e


def _struct_spec(names: Any, fields: Any, elsize: int) -> dict[str, Any]:
    if type(names) is not tuple or type(fields) is not dict or any(type(n) is not str for n in names):
        raise FormatError("pickled numpy structured dtype has malformed names/fields")
    spec: dict[str, list] = {"names": [], "formats": [], "offsets": [], "titles": []}
    for n in names:
        f = fields.get(n)
        if type(f) is not tuple or len(f) not in (2, 3) or (len(f) == 3 and not isinstance(f[2], (str, type(None)))):
            raise FormatError(f"pickled numpy field {n!r} is not (dtype, offset[, title])")
        spec["names"].append(n)
        spec["formats"].append(_dtype_of(f[0]))
        spec["offsets"].append(_int(f[1], "field offset"))
        spec["titles"].append(f[2] if len(f) == 3 else None)
    return {**spec, "itemsize": elsize}


def _build_array(state: Any, spend: Any) -> Any:
    np = _numpy()
    if type(state) is tuple and len(state) == 5 and type(state[0]) is int and state[0] == 1:
        state = state[1:]
    if type(state) is not tuple or len(state) != 4:
        raise FormatError(f"pickled numpy array state is a {_what(state)}, not (version, shape, dtype, order, data)")
    shape, dt, fortran, data = _shape(state[0]), _dtype_of(state[1]), state[2], state[3]
    if type(fortran) not in (bool, int):
        raise FormatError("pickled numpy array's order flag is not a bool")
    n = math.prod(shape)
    if dt.subdtype is not None:  # numpy folds a subarray dtype into the shape: never pickled, not rebuilt exactly
        raise FormatError(f"pickled numpy array of the subarray dtype {dt}: numpy never writes one")
    if dt.hasobject:
        if type(data) is not list or len(data) != n:
            raise FormatError(f"pickled numpy array of {dt} needs a list of {n} items, got {_what(data)}")
        spend(n * dt.itemsize, f"{dt} and shape {shape}")
        data = _swap_stand_ins(data, {})
        if dt.names is not None:  # numpy's __setstate__ loses a field's conversion error: assign item by item
            arr = np.empty(shape, dtype=dt, order="F" if fortran else "C")
            flat = arr.flat  # C order, as __setstate__ fills
            for i, v in enumerate(data):
                flat[i] = v
            return arr
    elif type(data) is not bytes or len(data) != n * dt.itemsize:
        raise FormatError(
            f"pickled numpy array of {dt} and shape {shape} needs {n * dt.itemsize} bytes of data, got {_what(data)}"
        )
    arr = np.empty(0, dtype=np.int8)
    arr.__setstate__((1, shape, dt, bool(fortran), data))  # numpy's own code, given a dtype built by numpy
    return arr


def _swap_stand_ins(obj: Any, memo: dict[int, tuple[Any, Any]]) -> Any:
    """``obj`` with numpy stand-ins replaced by their values (containers changed in place; tuples,
    frozensets and slices rebuilt). ``memo`` maps ``id`` to (object, result), so shared objects and
    cycles stay shared (it holds the object: a rebuilt tuple's id is not reused while it runs)."""
    t = type(obj)
    if t is DtypeStandIn or t is ArrayStandIn:
        return obj.value
    if t in _ATOMS:
        return obj
    done = memo.get(id(obj))
    if done is not None:
        return done[1]
    memo[id(obj)] = (obj, obj)
    if t is list or t is collections.deque:
        for i, v in enumerate(obj):
            r = _swap_stand_ins(v, memo)
            if r is not v:
                obj[i] = r
    elif t is dict or t is collections.OrderedDict or t is collections.defaultdict:
        plain_keys = True
        for k, v in obj.items():  # values are replaced in place (the size does not change)
            if type(k) not in _ATOMS:
                plain_keys = False
                break
            r = _swap_stand_ins(v, memo)
            if r is not v:
                obj[k] = r
        if not plain_keys:  # a key may be a stand-in (a dtype) or hold one: rebuild, keeping the order
            items = [(_swap_stand_ins(k, memo), _swap_stand_ins(v, memo)) for k, v in obj.items()]
            obj.clear()
            obj.update(items)
    elif t is set:
        items = [_swap_stand_ins(v, memo) for v in obj]
        obj.clear()
        obj.update(items)
    elif t is tuple or t is frozenset or t is slice:
        old = (obj.start, obj.stop, obj.step) if t is slice else obj
        items = [_swap_stand_ins(v, memo) for v in old]
        if any(a is not b for a, b in zip(items, old, strict=True)):
            new = slice(*items) if t is slice else t(items)
            memo[id(obj)] = (obj, new)
            return new
    return obj

"""What unpickling would do to the process, found by walking a pickle's opcodes without running any.

Every unpickler ckptio hands untrusted bytes to (``.pkl``, DCP ``.metadata``, DCP non-tensor
items, ``.pt`` files through torch's ``weights_only`` unpickler, ``ckptio info``'s inspector) is
given the pickle only after :func:`problem` found nothing. A pickle is a straight-line program, so
a walk that tracks what each stack slot holds sees what the unpickler will do. It refuses:

* **memo bombs**: ``PUT``/``BINPUT``/``LONG_BINPUT`` at an index beyond the number of opcodes
  before it. CPython's C unpickler sizes its memo array by the largest index (10 bytes of pickle
  can make it allocate 32 GiB); here the memo stays within 16 bytes per opcode of the pickle.
* **changes to shared objects**: ``BUILD``, ``SETITEM(S)``, ``APPEND(S)``, ``ADDITEMS`` applied to
  a global (a class, function or module-level object that ``GLOBAL``/``STACK_GLOBAL``/``EXT``
  resolved) or to a call result in ``shared`` (enum members). ``BUILD`` on a class sets attributes
  of the class for the whole process (``pathlib.PurePath._str``: every later path). They may only
  apply to objects the unpickler itself created.
* **allocations from a small argument**: a call (``REDUCE``/``NEWOBJ``) of a global for which
  ``calls(module, name)`` says ``"sized"``, given an int or a tuple holding one
  (``bytearray(2**30)``), or ``"never"`` (``torch.FloatTensor``: pickles never call it); and
  ``budgets``: calls whose size argument (the product of a tuple of ints) must fit, all calls
  together, in ``limit`` elements.
* malformed pickles (unknown opcodes, truncated arguments, a stack or memo entry that is not
  there), which the unpicklers would refuse too, only later.

:func:`problem` is one pass in Python over the opcodes (for the pickles torch reads, which torch's
own unpickler walks in Python too). :func:`memo_problem` checks only the memo, at C speed (a regular
expression consumes runs of opcodes that cannot grow it; Python looks at the others), for the large
pickles ckptio's own C unpicklers read, which keep shared objects unchanged by admitting only
objects that refuse ``BUILD`` and container updates (see :mod:`ckptio.formats.safepickle` and
:mod:`ckptio.dcp.metadata`).
"""

from __future__ import annotations

import math
import pickletools
import re
import struct
from collections.abc import Callable, Mapping

__all__ = ["memo_problem", "no_checks", "problem"]

_MARK = object()  # on the walk's stack, like the unpickler's metastack boundary
_OTHER = object()  # any object the unpickler creates (containers, instances, numbers we do not track, ...)


class _Global:
    """A stack slot holding an object the unpickler did not create (a resolved global, a shared call result)."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name


def no_checks(module: str, name: str) -> str | None:
    return None


# opcode byte -> (name, argument kind): kinds are a fixed byte count (>= 0) or one of pickletools'
# negative markers (UP_TO_NEWLINE, TAKEN_FROM_ARGUMENT1/4/4U/8U)
_OPS: dict[int, tuple[str, int]] = {
    ord(op.code): (op.name, op.arg.n if op.arg is not None else 0) for op in pickletools.opcodes
}
_LEN = {pickletools.TAKEN_FROM_ARGUMENT1: 1, pickletools.TAKEN_FROM_ARGUMENT4: 4, pickletools.TAKEN_FROM_ARGUMENT4U: 4,
        pickletools.TAKEN_FROM_ARGUMENT8U: 8}  # fmt: skip
_LEN_FMT = {1: "<B", 4: "<I", 8: "<Q"}
_PUSH_OTHER = frozenset(
    {
        "NONE", "NEWTRUE", "NEWFALSE", "FLOAT", "BINFLOAT", "STRING", "BINSTRING", "SHORT_BINSTRING",
        "UNICODE", "BINUNICODE", "SHORT_BINUNICODE", "BINUNICODE8", "BINBYTES", "SHORT_BINBYTES",
        "BINBYTES8", "BYTEARRAY8", "EMPTY_LIST", "EMPTY_DICT", "EMPTY_SET", "NEXT_BUFFER", "PERSID",
    }
)  # fmt: skip
_FROM_MARK = frozenset({"LIST", "DICT", "FROZENSET"})  # pop to the mark, push a new container
_INTS = frozenset({"BININT", "BININT1", "BININT2", "LONG1", "LONG4", "INT", "LONG"})
_TUPLE_N = {"EMPTY_TUPLE": 0, "TUPLE1": 1, "TUPLE2": 2, "TUPLE3": 3}


class _Malformed(Exception):
    pass


def problem(
    data: bytes | bytearray | memoryview,
    *,
    calls: Callable[[str, str], str | None] = no_checks,
    shared: frozenset[str] = frozenset(),
    budgets: Mapping[str, int] | None = None,
    limit: int = 0,
) -> str | None:
    """Why unpickling ``data`` could change shared objects or allocate far beyond it; None if it cannot.

    ``calls(module, name)``: ``"sized"`` when calling that global with an int allocates from it,
    ``"never"`` when no call of it is admitted, else None.
    ``shared``: ``module.name`` of callables that return shared objects (enum classes).
    ``budgets``: ``module.name`` -> position of a size argument; those sizes together must stay
    within ``limit``. Only the first pickle in ``data`` is walked (up to its STOP).
    """
    try:
        return _walk(memoryview(data).cast("B"), calls, shared, budgets or {}, limit)
    except _Malformed as e:
        return f"is not a well-formed pickle ({e})"
    except (IndexError, struct.error, ValueError, UnicodeDecodeError) as e:
        return f"is not a well-formed pickle ({type(e).__name__}: {e})"


def _walk(
    mv: memoryview,
    calls: Callable[[str, str], str | None],
    shared: frozenset[str],
    budgets: Mapping[str, int],
    limit: int,
) -> str | None:
    n = len(mv)
    stack: list = []
    memo: dict[int, object] = {}
    pos = ops = spent = 0
    strings = bool(budgets) or calls is not no_checks or bool(shared)  # STACK_GLOBAL needs the names
    while True:
        if pos >= n:
            raise _Malformed("ends without a STOP opcode")
        code = mv[pos]
        op = _OPS.get(code)
        if op is None:
            raise _Malformed(f"unknown opcode {code:#x} at byte {pos}")
        name, kind = op
        at = pos
        pos += 1
        ops += 1
        arg: object = None
        if kind > 0:
            end = pos + kind
            if end > n:
                raise _Malformed(f"{name} at byte {at} is truncated")
            raw = mv[pos:end]
            pos = end
            if kind <= 4 or name == "FRAME":
                arg = int.from_bytes(raw, "little", signed=name == "BININT")
            else:
                arg = raw  # BINFLOAT
        elif kind < 0:
            if kind == pickletools.UP_TO_NEWLINE:
                end = _line_end(mv, pos, n, name, at)
                arg = bytes(mv[pos:end])
                pos = end + 1
                if name in ("GLOBAL", "INST"):
                    end = _line_end(mv, pos, n, name, at)
                    arg = (arg, bytes(mv[pos:end]))
                    pos = end + 1
            else:
                width = _LEN[kind]
                if pos + width > n:
                    raise _Malformed(f"{name} at byte {at} is truncated")
                size = int.from_bytes(mv[pos : pos + width], "little", signed=kind == pickletools.TAKEN_FROM_ARGUMENT4)
                pos += width
                if size < 0 or pos + size > n:
                    raise _Malformed(f"{name} at byte {at} claims {size} bytes past the end")
                if name in ("LONG1", "LONG4"):
                    arg = int.from_bytes(mv[pos : pos + size], "little", signed=True)
                elif strings and name in ("SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8"):
                    arg = bytes(mv[pos : pos + size]).decode("utf-8", "surrogatepass")
                pos += size
        # ---- the stack effect
        if name in _PUSH_OTHER:
            stack.append(arg if type(arg) is str else _OTHER)
        elif name in ("BINGET", "LONG_BINGET", "GET"):
            idx = _index(arg, name)
            if idx not in memo:
                raise _Malformed(f"{name} at byte {at} reads memo entry {idx}, which was never stored")
            stack.append(memo[idx])
        elif name in ("BINPUT", "LONG_BINPUT", "PUT"):
            idx = _index(arg, name)
            if idx > ops:
                return f"stores a pickle memo entry at index {idx} (at byte {at}), beyond anything it holds"
            memo[idx] = _top(stack, name, at)
        elif name == "MEMOIZE":
            memo[len(memo)] = _top(stack, name, at)
        elif name == "MARK":
            stack.append(_MARK)
        elif name in _INTS:
            if name in ("INT", "LONG"):
                arg = _int_text(arg)  # type: ignore[arg-type]
            stack.append(arg)
        elif name in _TUPLE_N:
            k = _TUPLE_N[name]
            if len(stack) < k or any(v is _MARK for v in stack[len(stack) - k :]):
                raise _Malformed(f"{name} at byte {at} has too few items on the stack")
            items = tuple(stack[len(stack) - k :])
            del stack[len(stack) - k :]
            stack.append(items)
        elif name == "TUPLE":
            stack.append(tuple(_pop_mark(stack, name, at)))
        elif name in _FROM_MARK:
            _pop_mark(stack, name, at)
            stack.append(_OTHER)
        elif name in ("APPEND", "SETITEM", "BUILD"):
            _pop(stack, 2 if name == "SETITEM" else 1, name, at)
            target = _top(stack, name, at)
            if type(target) is _Global:
                return f"applies {name} to {target.name} (at byte {at}): it would change it for the whole process"
        elif name in ("APPENDS", "SETITEMS", "ADDITEMS"):
            _pop_mark(stack, name, at)
            target = _top(stack, name, at)
            if type(target) is _Global:
                return f"applies {name} to {target.name} (at byte {at}): it would change it for the whole process"
        elif name in ("REDUCE", "NEWOBJ", "NEWOBJ_EX"):
            if name == "NEWOBJ_EX":
                _pop(stack, 1, name, at)
            args = _pop(stack, 1, name, at)[0]
            fn = _pop(stack, 1, name, at)[0]
            result: object = _OTHER
            if type(fn) is _Global:
                module, _, attr = fn.name.rpartition(".")
                check = calls(module, attr)
                if check == "never":
                    return f"calls {fn.name} (at byte {at}), which pickles of data never call"
                if check == "sized" and _has_int(args):
                    return (
                        f"calls {fn.name} with a number (at byte {at}), which would allocate from it; "
                        f"pickles pass it data, never a size"
                    )
                where = budgets.get(fn.name)
                if where is not None:
                    spent += _elements(args, where)
                    if spent > limit:
                        return (
                            f"calls {fn.name} for {spent} elements in all (at byte {at}), more than the "
                            f"{limit} bytes stored"
                        )
                if fn.name in shared:
                    result = _Global(f"the result of {fn.name}")
            elif fn is _MARK:
                raise _Malformed(f"{name} at byte {at} calls a MARK")
            stack.append(result)
        elif name in ("GLOBAL", "INST"):
            module, attr = (x.decode("utf-8", "surrogatepass") for x in arg)  # type: ignore[attr-defined]
            if name == "INST":
                _pop_mark(stack, name, at)
                stack.append(_OTHER)
            else:
                stack.append(_Global(f"{module}.{attr}"))
        elif name == "STACK_GLOBAL":
            module, attr = _pop(stack, 2, name, at)
            stack.append(_Global(f"{module}.{attr}" if type(module) is str and type(attr) is str else "a global"))
        elif name == "OBJ":
            if not _pop_mark(stack, name, at):
                raise _Malformed(f"OBJ at byte {at} has no class")
            stack.append(_OTHER)
        elif name in ("EXT1", "EXT2", "EXT4"):
            stack.append(_Global(f"extension code {arg}"))
        elif name == "POP":
            _pop(stack, 1, name, at)
        elif name == "POP_MARK":
            _pop_mark(stack, name, at)
        elif name == "DUP":
            stack.append(_top(stack, name, at))
        elif name == "BINPERSID":
            _pop(stack, 1, name, at)
            stack.append(_OTHER)
        elif name == "READONLY_BUFFER":
            _top(stack, name, at)
        elif name == "STOP":
            if len(stack) != 1 or stack[0] is _MARK:
                raise _Malformed(f"STOP at byte {at} leaves {len(stack)} items on the stack")
            return None
        elif name not in ("PROTO", "FRAME"):
            raise _Malformed(f"opcode {name} at byte {at} is not handled")  # pragma: no cover - all are


_NEWLINE = re.compile(b"\n")


def _line_end(mv: memoryview, pos: int, n: int, name: str, at: int) -> int:
    m = _NEWLINE.search(mv, pos)
    if m is None:
        raise _Malformed(f"{name} at byte {at} has no end of line")
    return m.start()


def _index(arg: object, name: str) -> int:
    """A memo index: an int argument, or the text line of GET/PUT."""
    return arg if type(arg) is int else _int_line(arg, name)  # type: ignore[arg-type]


def _int_line(arg: bytes, name: str) -> int:
    text = arg.strip()
    if not text.isdigit() or len(text) > 20:
        raise _Malformed(f"{name} has index {arg[:30]!r}")
    return int(text)


def _int_text(arg: bytes) -> object:
    text = arg.rstrip(b"L").strip()
    if len(text) > 4000:  # int() refuses more digits than sys.get_int_max_str_digits() anyway
        return _OTHER
    try:
        return int(text, 10)
    except ValueError:
        return _OTHER  # "I01" booleans, "00"...: not sizes


def _top(stack: list, name: str, at: int) -> object:
    if not stack or stack[-1] is _MARK:
        raise _Malformed(f"{name} at byte {at} finds no object on the stack")
    return stack[-1]


def _pop(stack: list, k: int, name: str, at: int) -> list:
    if len(stack) < k or any(v is _MARK for v in stack[len(stack) - k :]):
        raise _Malformed(f"{name} at byte {at} finds too few objects on the stack")
    out = stack[len(stack) - k :]
    del stack[len(stack) - k :]
    return out


def _pop_mark(stack: list, name: str, at: int) -> list:
    for i in range(len(stack) - 1, -1, -1):
        if stack[i] is _MARK:
            out = stack[i + 1 :]
            del stack[i:]
            return out
    raise _Malformed(f"{name} at byte {at} finds no MARK")


def _has_int(args: object) -> bool:
    if type(args) is int:
        return True
    return type(args) is tuple and any(type(a) is int or (type(a) is tuple and _has_int(a)) for a in args)


def _elements(args: object, where: int) -> int:
    size = args[where] if type(args) is tuple and len(args) > where else None
    if type(size) is not tuple or not all(type(s) is int for s in size):
        return 0  # not a size this walk can see: the callee checks it
    return math.prod(max(s, 0) for s in size)


# ---- the memo alone, at C speed ----------------------------------------------------------------------


def _tokens() -> re.Pattern[bytes]:
    def cls(codes: bytes) -> bytes:
        return b"[" + b"".join(re.escape(bytes([c])) for c in codes) + b"]"

    short = b"|".join(re.escape(bytes([k])) + (b"[\\s\\S]{%d}" % k if k else b"") for k in range(256))
    token = b"|".join(
        [
            cls(b"(0123N\x88\x89)]}\x8ftl\x85\x86\x87daesu\x90\x91bR\x81\x92\x93\x94Qo\x97\x98"),  # no argument
            cls(b"Khq\x80\x82") + b"[\\s\\S]",  # one byte (BINPUT: an index below 256)
            cls(b"M\x83") + b"[\\s\\S]{2}",
            cls(b"Jj\x84") + b"[\\s\\S]{4}",
            cls(b"G\x95") + b"[\\s\\S]{8}",
            cls(b"\x8cCU\x8a") + b"(?:" + short + b")",  # a one-byte length, then that many bytes
            cls(b"ci") + b"[^\\n]*\\n[^\\n]*\\n",  # GLOBAL, INST: two lines
            cls(b"ILFSVPg") + b"[^\\n]*\\n",
        ]
    )
    # bounded runs: an unbounded repeat of a group keeps state per iteration in Python < 3.11
    return re.compile(b"(?:" + token + b"){0,4096}")


_RUN = _tokens()


def memo_problem(data: bytes | bytearray | memoryview) -> str | None:
    """Why the C unpickler could allocate a memo far larger than ``data`` (or ``data`` is not a
    pickle); None if it cannot. Only the first pickle in ``data`` is walked (up to its STOP)."""
    mv = memoryview(data).cast("B")
    n, pos, match = len(mv), 0, _RUN.match
    try:
        while True:
            end = match(mv, pos).end()  # type: ignore[union-attr]  # {0,...} always matches
            if end > pos:
                pos = end
                continue
            if pos >= n:
                raise _Malformed("ends without a STOP opcode")
            code = mv[pos]
            if code == 0x2E:  # STOP
                return None
            op = _OPS.get(code)
            if op is None:
                raise _Malformed(f"unknown opcode {code:#x} at byte {pos}")
            name, kind = op
            at, pos = pos, pos + 1
            if name in ("PUT", "LONG_BINPUT"):
                if name == "PUT":
                    end = _line_end(mv, pos, n, name, at)
                    idx, pos = _int_line(bytes(mv[pos:end]), name), end + 1
                else:
                    if pos + 4 > n:
                        raise _Malformed(f"{name} at byte {at} is truncated")
                    idx, pos = int.from_bytes(mv[pos : pos + 4], "little"), pos + 4
                if idx > at:
                    return f"stores a pickle memo entry at index {idx} (at byte {at}), beyond anything it holds"
            elif kind in _LEN:  # a longer length prefix than the expression handles
                width = _LEN[kind]
                if pos + width > n:
                    raise _Malformed(f"{name} at byte {at} is truncated")
                size = int.from_bytes(mv[pos : pos + width], "little", signed=kind == pickletools.TAKEN_FROM_ARGUMENT4)
                pos += width + size
                if size < 0 or pos > n:
                    raise _Malformed(f"{name} at byte {at} claims {size} bytes past the end")
            else:
                raise _Malformed(f"{name} at byte {at} is truncated or malformed")
    except _Malformed as e:
        return f"is not a well-formed pickle ({e})"

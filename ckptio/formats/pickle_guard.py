"""What ckptio's restricted unpicklers hand the C unpickler for an admitted global: objects a pickle cannot change.

The C unpickler applies ``BUILD`` (``__setstate__``, or ``setattr``/``__dict__`` updates),
``SETITEM(S)``, ``APPEND(S)`` and ``ADDITEMS`` to whatever is on its stack, including the class or
function a ``GLOBAL`` resolved: a few bytes of ``.metadata`` could set ``pathlib.PurePath._str``
for the whole process. :func:`guard` returns, for an admitted global:

* an immutable type (``Py_TPFLAGS_IMMUTABLETYPE``: ``set``, ``torch.Size``...) or an object without
  attributes (``torch.float32``) as it is;
* for any other class, a stand-in class whose metaclass refuses ``BUILD`` and attribute changes,
  whose call (``REDUCE``) calls the class and whose ``__new__`` (``NEWOBJ``) returns
  ``cls.__new__(cls)``: the objects built are instances of the real class;
* for an enum, a callable returning a stand-in equal to the member (a member is shared: ``BUILD``
  on it would change it for the process);
* for a function, a callable object that refuses ``BUILD``.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable
from typing import Any

from ..errors import FormatError

__all__ = ["guard"]

_IMMUTABLE_TYPE = 1 << 8  # Py_TPFLAGS_IMMUTABLETYPE (Python >= 3.10)


def _refuse(what: str) -> FormatError:
    return FormatError(
        f"a pickle applies BUILD (or sets attributes) to {what}, which it did not create: that would "
        f"change it for the whole process; refusing it (the file is corrupt or crafted)"
    )


class _Frozen(type):
    """Metaclass of the stand-in classes: no attribute set or deleted, no BUILD."""

    def __setattr__(cls, name: str, value: Any) -> None:
        raise _refuse(cls._what)  # type: ignore[attr-defined]

    def __delattr__(cls, name: str) -> None:
        raise _refuse(cls._what)  # type: ignore[attr-defined]

    def __setstate__(cls, state: Any) -> None:  # the C unpickler's BUILD looks this up on the class
        raise _refuse(cls._what)  # type: ignore[attr-defined]

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:  # REDUCE: build the real object
        return cls._real(*args, **kwargs)  # type: ignore[attr-defined]


class _Call:
    """A function, callable as it is; ``BUILD`` and attribute changes are refused."""

    __slots__ = ("_fn", "_what")
    _fn: Callable[..., Any]
    _what: str

    def __init__(self, fn: Callable[..., Any], what: str) -> None:
        object.__setattr__(self, "_fn", fn)
        object.__setattr__(self, "_what", what)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._fn(*args, **kwargs)

    def __setattr__(self, name: str, value: Any) -> None:
        raise _refuse(self._what)

    def __setstate__(self, state: Any) -> None:
        raise _refuse(self._what)


class _Member:
    """An enum member as a pickle's call returns it: equal to (and hashing as) the member, unchangeable."""

    __slots__ = ("member",)
    member: enum.Enum

    def __init__(self, member: enum.Enum) -> None:
        object.__setattr__(self, "member", member)

    def __eq__(self, other: object) -> bool:
        return other is self.member or (type(other) is _Member and other.member is self.member)

    def __hash__(self) -> int:
        return hash(self.member)

    def __repr__(self) -> str:
        return repr(self.member)

    def __setattr__(self, name: str, value: Any) -> None:
        raise _refuse(repr(self.member))

    def __setstate__(self, state: Any) -> None:
        raise _refuse(repr(self.member))


def _stand_in_class(cls: type, what: str) -> type:
    new: Any
    if cls.__new__ is object.__new__ and cls.__init__ is not object.__init__:  # type: ignore[misc]
        # NEWOBJ calls new(stand-in, *args): object.__new__(cls, stand-in, *args) at C speed, which
        # ignores the extra arguments of a class with its own __init__ (the dataclasses of DCP metadata)
        new = functools.partial(object.__new__, cls)
    else:

        def new(_: type, *args: Any, **kwargs: Any) -> Any:  # NEWOBJ: cls.__new__(cls, *args)
            return cls.__new__(cls, *args, **kwargs)

    return _Frozen(cls.__name__, (), {"__new__": new, "__slots__": (), "_real": cls, "_what": what})


def guard(obj: Any, what: str) -> Any:
    """``obj`` (an admitted global, ``what`` its name) as the unpickler may be given it (module docstring)."""
    if isinstance(obj, type):
        if obj.__flags__ & _IMMUTABLE_TYPE:
            return obj
        if issubclass(obj, enum.Enum):
            return _Call(lambda *args: _Member(obj(*args)), what)
        return _stand_in_class(obj, what)
    if callable(obj):
        return _Call(obj, what)
    if type(obj).__flags__ & _IMMUTABLE_TYPE and not hasattr(obj, "__dict__"):
        return obj
    raise FormatError(f"{what} cannot be admitted by an unpickler: a pickle could change it")

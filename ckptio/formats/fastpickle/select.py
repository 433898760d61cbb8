"""Partial loads (``keys=``): picking subtrees by dotted key from a tree whose tensors are :class:`Ref`
placeholders, the tensors they need, and putting the loaded tensors in their place.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

from .layout import path_str


class Ref:
    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index

    def __hash__(self) -> int:
        return hash((Ref, self.index))

    def __eq__(self, other: Any) -> bool:
        return type(other) is Ref and other.index == self.index


def _split_key(key: Any) -> list:
    if isinstance(key, (list, tuple)):
        return list(key)
    if not isinstance(key, str):
        raise TypeError(f"keys must be dotted strings or sequences of path components, got {key!r}")
    return key.split(".") if key else []


def select(tree: Any, key: Any) -> Any:
    """The subtree at ``key`` (dotted path; dict keys may contain dots, the longest match wins)."""
    parts = _split_key(key)
    node, i = tree, 0
    while i < len(parts):
        part = parts[i]
        if isinstance(node, dict):
            best = None
            for k in node:  # the longest dict key spelled by parts[i:j]
                ks = str(k)
                for j in range(len(parts), i, -1):
                    if ks == ".".join(map(str, parts[i:j])):
                        if best is None or j > best[1]:
                            best = (k, j)
                        break
            if best is None:
                raise KeyError(f"no key {path_str(parts[: i + 1])!r} in the checkpoint")
            node, i = node[best[0]], best[1]
        elif isinstance(node, (list, tuple)):
            try:
                node = node[int(part)]
            except (ValueError, IndexError):
                raise KeyError(f"no key {path_str(parts[: i + 1])!r} in the checkpoint") from None
            i += 1
        else:
            raise KeyError(f"no key {path_str(parts[: i + 1])!r} in the checkpoint")
    return node


def refs(x: Any, out: set[int]) -> None:
    if type(x) is Ref:
        out.add(x.index)
    elif isinstance(x, dict):
        for k, v in x.items():
            refs(k, out)
            refs(v, out)
    elif isinstance(x, (list, tuple, set, frozenset)):
        for v in x:
            refs(v, out)


def substitute(x: Any, make: Callable[[int], Any]) -> Any:
    t = type(x)
    if t is Ref:
        return make(x.index)
    if t is dict or t is collections.OrderedDict:
        return t((substitute(k, make), substitute(v, make)) for k, v in x.items())
    if t is list:
        return [substitute(v, make) for v in x]
    if t is tuple or t is set or t is frozenset:
        return t(substitute(v, make) for v in x)
    return x

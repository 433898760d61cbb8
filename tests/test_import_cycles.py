"""No import circles among ckptio's modules: data flows one way (ARCHITECTURE.md).

Every import counts: module level, inside functions (a late import hides a circle, it does not break
it) and under ``TYPE_CHECKING``. An import of ``pkg.mod`` or ``from pkg import mod`` is an edge to
``pkg.mod``; ``from pkg import name`` (not a module) an edge to ``pkg``. Parent packages' ``__init__``
are not counted as dependencies of their submodules.
"""

from __future__ import annotations

import ast
from pathlib import Path

import ckptio

ROOT = Path(ckptio.__file__).parent


def _modules() -> dict[str, Path]:
    out = {}
    for p in ROOT.rglob("*.py"):
        parts = p.relative_to(ROOT.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


def imports(name: str, path: Path, modules: dict[str, Path]) -> dict[str, int]:
    """Module -> line of the first import of it in ``path`` (any depth: functions, TYPE_CHECKING)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")
                up = up[: len(up) - (node.level - 1)]
                base = ".".join(up + ([node.module] if node.module else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for t in targets:
            if t in modules and t != name:
                out.setdefault(t, node.lineno)
    return out


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(graph[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(graph[w])))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    x = stack.pop()
                    on.discard(x)
                    comp.append(x)
                    if x == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def test_no_import_cycles_among_ckptio_modules():
    modules = _modules()
    graph = {m: imports(m, p, modules) for m, p in modules.items()}
    problems = []
    for comp in cycles(graph):
        inside = set(comp)
        edges = [
            f"{m} -> {t} ({modules[m].relative_to(ROOT.parent)}:{line})"
            for m in comp
            for t, line in graph[m].items()
            if t in inside
        ]
        problems.append("circle: " + "; ".join(edges))
    assert not problems, "\n".join(problems) + "\nbreak it by moving the shared piece down (not by a late import)"


def test_the_cycle_finder_finds_a_function_level_circle(tmp_path):
    a = tmp_path / "a.py"
    b = tmp_path / "b.py"
    a.write_text("from . import b\n")
    b.write_text("def f():\n    from .a import g\n")
    modules = {"p.a": a, "p.b": b}
    graph = {m: imports(m, p, modules) for m, p in modules.items()}
    assert graph == {"p.a": {"p.b": 1}, "p.b": {"p.a": 2}}
    assert cycles(graph) == [["p.a", "p.b"]]
    assert cycles({"x": {"y": 1}, "y": {}}) == []

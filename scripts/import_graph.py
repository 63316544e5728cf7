"""kvbench's import graph, read with ``ast`` (nothing is imported): cycles, imports inside functions,
lines per file.

    python scripts/import_graph.py            # the four sections below
    python scripts/import_graph.py --json     # the same, as JSON

(a) Import cycles: the strongly connected components of the graph of project imports, counting the
    imports placed inside functions as well as those at module level (an import inside a function
    still makes the two modules depend on each other; it only hides the loop from Python).
(b) Every import of a project module placed inside a function, as ``file:line``.
(c) Lines per file: max and median over the project's ``.py`` files, and the largest ones.
(d) Imports that reach up the layering (:data:`LAYERS`), and the modules no layer holds.

tests/test_layering.py asserts on (a), (b) and (d).

Project modules are those under ``src/kvbench`` and ``src/hydra_plugins``. ``from pkg import name``
is an edge to ``pkg.name`` when that is a module,
else to ``pkg``. As in import-linter, importing ``a.b.c`` is an edge to ``a.b.c`` only, not to the
packages ``a`` and ``a.b`` whose ``__init__`` Python also runs. Imports under ``if TYPE_CHECKING:``
never run and are left out.
"""

from __future__ import annotations

import argparse
import ast
import json
import statistics
import sys
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Folder -> the dotted name of the package it holds.
SOURCES = {
    ROOT / "src" / "kvbench": "kvbench",
    ROOT / "src" / "hydra_plugins": "hydra_plugins",
}
# The layering, top to bottom: a module may import its own layer and those below it. A module
# belongs to the layer naming its longest prefix. Reports read records only: below them is storage.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("entry", ("kvbench.__main__", "hydra_plugins")),
    ("sweep", ("kvbench.sweep",)),
    ("logging", ("kvbench.logger",)),
    ("run", ("kvbench.run", "kvbench.config", "kvbench.baseline")),
    ("protocols", ("kvbench.eval",)),
    ("stack", ("kvbench.stack",)),
    (
        "techniques",
        (
            "kvbench.roles",
            "kvbench.select",
            "kvbench.allocation",
            "kvbench.compressors",
            "kvbench.schedulers",
            "kvbench.routers",
            "kvbench.calibration",
        ),
    ),
    ("data", ("kvbench.data",)),
    ("models", ("kvbench.models", "kvbench.codec")),
    ("cache engine", ("kvbench.cache", "kvbench.kernels")),
    ("reports", ("kvbench.report",)),
    (
        "storage",
        (
            "kvbench",  # the package's __init__: versions only
            "kvbench.results",
            "kvbench.cellstate",
            "kvbench.paths",
            "kvbench.errors",
            "kvbench.limits",
            "kvbench.metrics",
        ),
    ),
]


@dataclass(frozen=True)
class Import:
    """One project import: ``source`` imports ``target`` at ``file:line`` (inside a function or not)."""

    source: str
    target: str
    file: str
    line: int
    in_function: bool


def modules() -> dict[str, Path]:
    """Every project module's dotted name and file."""
    found = {}
    for folder, package in SOURCES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([package, *parts])] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _walk(node: ast.AST, in_function: bool = False) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Every import statement under ``node``, and whether it sits inside a function body."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.Import | ast.ImportFrom):
            yield child, in_function
        elif isinstance(child, ast.If) and _is_type_checking(child.test):
            for other in child.orelse:
                yield from _walk(other, in_function)
        else:
            inside = in_function or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
            yield from _walk(child, inside)


def _known(name: str, known: set[str]) -> str | None:
    """``name`` or its longest prefix that is a project module; None for a third-party module."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in known:
            return candidate
        parts.pop()
    return None


def _base(stmt: ast.ImportFrom, module: str, is_package: bool) -> str:
    if not stmt.level:
        return stmt.module or ""
    here = module.split(".") if is_package else module.split(".")[:-1]
    here = here[: len(here) - (stmt.level - 1)]
    return ".".join([*here, *([stmt.module] if stmt.module else [])])


def imports(found: dict[str, Path] | None = None) -> list[Import]:
    """Every project import of every project module (module level and inside functions)."""
    found = found or modules()
    known = set(found)
    out = []
    for module, path in found.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        rel = str(path.relative_to(ROOT))
        for stmt, in_function in _walk(tree):
            if isinstance(stmt, ast.Import):
                names = [alias.name for alias in stmt.names]
            else:
                base = _base(stmt, module, path.name == "__init__.py")
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in stmt.names]
            for target in dict.fromkeys(t for t in (_known(n, known) for n in names) if t):
                if target != module:
                    out.append(Import(module, target, rel, stmt.lineno, in_function))
    return out


def cycles(edges: list[Import]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    graph: dict[str, set[str]] = {}
    for e in edges:
        graph.setdefault(e.source, set()).add(e.target)
        graph.setdefault(e.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph) + 100))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def layer_of(module: str) -> int | None:
    """The index in :data:`LAYERS` of the layer that holds ``module`` (0 is the top); None if none."""
    best: tuple[int, int] | None = None  # (prefix length, layer)
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and (
                best is None or len(prefix) > best[0]
            ):
                best = (len(prefix), index)
    return best[1] if best else None


def _layer_name(module: str) -> str:
    index = layer_of(module)
    return LAYERS[index][0] if index is not None else "none"


def upward(edges: list[Import]) -> list[Import]:
    """The imports whose target sits in a higher layer than their source."""
    out = []
    for e in edges:
        source, target = layer_of(e.source), layer_of(e.target)
        if source is not None and target is not None and target < source:
            out.append(e)
    return out


def line_counts(found: dict[str, Path] | None = None) -> dict[str, int]:
    found = found or modules()
    return {str(p.relative_to(ROOT)): len(p.read_text(encoding="utf-8").splitlines()) for p in found.values()}


def analyse() -> dict:
    found = modules()
    edges = imports(found)
    lines = line_counts(found)
    sccs = cycles(edges)
    return {
        "modules": len(found),
        "cycles": [
            {
                "modules": scc,
                "edges": [asdict(e) for e in edges if e.source in scc and e.target in scc],
            }
            for scc in sccs
        ],
        "in_function": [asdict(e) for e in edges if e.in_function],
        "upward": [
            {**asdict(e), "layers": [_layer_name(e.source), _layer_name(e.target)]} for e in upward(edges)
        ],
        "unplaced": sorted(m for m in found if layer_of(m) is None),
        "lines": {
            "files": len(lines),
            "max": max(lines.values()),
            "median": statistics.median(lines.values()),
            "largest": dict(sorted(lines.items(), key=lambda kv: -kv[1])[:8]),
        },
    }


def _short(module: str) -> str:
    return module.removeprefix("kvbench.")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the analysis as JSON")
    args = parser.parse_args(argv)
    result = analyse()
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"(a) import cycles: {len(result['cycles'])} (over {result['modules']} modules)")
    for n, cycle in enumerate(result["cycles"], 1):
        print(f"  {n}. {', '.join(_short(m) for m in cycle['modules'])}")
        for e in cycle["edges"]:
            where = "in a function" if e["in_function"] else "module level"
            print(f"     {_short(e['source'])} -> {_short(e['target'])}  {e['file']}:{e['line']} ({where})")
    inside = result["in_function"]
    files = sorted({e["file"] for e in inside})
    statements = sorted({(e["file"], e["line"]) for e in inside})
    print(
        f"(b) project imports inside functions: {len(statements)} statements "
        f"({len(inside)} module edges) in {len(files)} modules"
    )
    for file, line in statements:
        targets = ", ".join(_short(e["target"]) for e in inside if (e["file"], e["line"]) == (file, line))
        print(f"  {file}:{line}  {targets}")
    lines = result["lines"]
    print(f"(c) lines per file over {lines['files']} files: max {lines['max']}, median {lines['median']:g}")
    for file, n in lines["largest"].items():
        print(f"  {n:5d}  {file}")
    up = result["upward"]
    statements = sorted({(e["file"], e["line"]) for e in up})
    print(f"(d) imports that reach up the layering: {len(statements)} statements")
    for e in up:
        layers = " -> ".join(e["layers"])
        print(f"  {_short(e['source'])} -> {_short(e['target'])}  {e['file']}:{e['line']} ({layers})")
    for module in result["unplaced"]:
        print(f"  {module}: in no layer (add it to LAYERS in scripts/import_graph.py)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""kvbench's layering (issue 12), as scripts/import_graph.py reads it with ``ast``: no import cycle,
no project import hidden inside a function, no import that reaches up the layers.

The allow-lists below hold what the technique layer's rework still has to remove, each with its
reason. Delete an entry when its import goes: an entry that no longer matches anything fails
:func:`test_allow_lists_hold_only_what_is_still_there`, so the lists can only shrink.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("import_graph", ROOT / "scripts" / "import_graph.py")
assert _spec is not None and _spec.loader is not None
graph = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = graph  # dataclasses look their module up while the class is built
_spec.loader.exec_module(graph)

# Cycles still allowed: each the set of modules it may span, and why. (None left.)
ALLOWED_CYCLES: dict[frozenset[str], str] = {}

# Project imports allowed inside a function: (importing module, imported module) -> why. A lazy
# import is fine for an optional heavy third-party package (wandb), never to dodge a cycle.
ALLOWED_IN_FUNCTION: dict[tuple[str, str], str] = {}

# Imports allowed to reach up the layers (graph.LAYERS): (importing module, imported module) -> why.
ALLOWED_UPWARD: dict[tuple[str, str], str] = {}

RESULT = graph.analyse()


def _where(edges: list[dict]) -> str:
    return "\n".join(f"  {e['source']} -> {e['target']} at {e['file']}:{e['line']}" for e in edges)


def test_no_import_cycle_but_the_allowed_ones():
    unexpected = [
        c for c in RESULT["cycles"] if not any(set(c["modules"]) <= allowed for allowed in ALLOWED_CYCLES)
    ]
    assert not unexpected, "import cycles (edges inside functions count too):\n" + "\n".join(
        f"{', '.join(c['modules'])}:\n{_where(c['edges'])}" for c in unexpected
    )


def test_no_project_import_inside_a_function_but_the_allowed_ones():
    hidden = [e for e in RESULT["in_function"] if (e["source"], e["target"]) not in ALLOWED_IN_FUNCTION]
    assert not hidden, (
        "imports of project modules inside functions (move them to the top; if that makes a cycle, "
        "move the shared piece down a layer):\n" + _where(hidden)
    )


def test_no_import_reaches_up_the_layers_and_every_module_has_a_layer():
    up = [e for e in RESULT["upward"] if (e["source"], e["target"]) not in ALLOWED_UPWARD]
    assert not up, "imports that reach up the layering (scripts/import_graph.py LAYERS):\n" + _where(up)
    assert not RESULT["unplaced"], f"modules in no layer: add them to LAYERS: {RESULT['unplaced']}"


def test_allow_lists_hold_only_what_is_still_there():
    cycles = [set(c["modules"]) for c in RESULT["cycles"]]
    stale = [", ".join(sorted(a)) for a in ALLOWED_CYCLES if not any(c <= a for c in cycles)]
    inside = {(e["source"], e["target"]) for e in RESULT["in_function"]}
    stale += [" -> ".join(k) for k in ALLOWED_IN_FUNCTION if k not in inside]
    up = {(e["source"], e["target"]) for e in RESULT["upward"]}
    stale += [" -> ".join(k) for k in ALLOWED_UPWARD if k not in up]
    assert not stale, f"allow-list entries that match nothing any more: delete them: {stale}"


def test_the_analysis_sees_imports_inside_functions(tmp_path):
    """The analysis itself: a function-level import is an edge, and closes a cycle."""
    (tmp_path / "a.py").write_text("import kvbench.b\n")
    (tmp_path / "b.py").write_text("def f():\n    from kvbench import a\n")
    found = {"kvbench.a": tmp_path / "a.py", "kvbench.b": tmp_path / "b.py"}
    root = graph.ROOT
    graph.ROOT = tmp_path
    try:
        edges = graph.imports(found)
    finally:
        graph.ROOT = root
    assert {(e.source, e.target, e.in_function) for e in edges} == {
        ("kvbench.a", "kvbench.b", False),
        ("kvbench.b", "kvbench.a", True),
    }
    assert graph.cycles(edges) == [["kvbench.a", "kvbench.b"]]

"""No import cycle under edgetl/, counting imports inside functions too (issue #14 item 7).

A lazy import hides a cycle from the interpreter but not from a reader: the two modules
still depend on each other. Here every ``import edgetl...`` / ``from edgetl... import``
anywhere in a module (functions and TYPE_CHECKING blocks included) is an edge.
"""

from __future__ import annotations

import ast
from pathlib import Path

import edgetl

PACKAGE = Path(edgetl.__file__).parent


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def import_graph() -> dict[str, set[str]]:
    """Module -> the edgetl modules it imports anywhere in its text."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                deps.add(node.module)
                deps.update(f"{node.module}.{a.name}" for a in node.names)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
        graph[name] = {d for d in deps if d in modules and d != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as a list of modules (first repeated last), or None."""
    state: dict[str, int] = {}  # 1 on the path, 2 done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep]
            if dep not in state:
                found = visit(dep, path + [dep])
                if found:
                    return found
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state:
            found = visit(start, [start])
            if found:
                return found
    return None


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle_under_edgetl():
    graph = import_graph()
    assert "edgetl.memory.runtime" in graph and "edgetl.models.lean" in graph
    assert "edgetl.memory.leaf" in graph["edgetl.memory.rules"]
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle)


MAX_MODULE_LINES = 650  # "about 600": rooms split along their seams (export.py, 633, is the largest)


def test_no_module_under_edgetl_is_over_about_600_lines():
    sizes = {name: len(path.read_text().splitlines()) for name, path in _modules().items()}
    assert len(sizes) > 40  # the walk found the package
    big = {name: n for name, n in sizes.items() if n > MAX_MODULE_LINES}
    assert not big, big


def test_the_models_do_not_import_the_accounting():
    """Issue #42 item 5: the layers and the accounting that measures them share the cost types
    and the meta-op memo, which sit below both (edgetl.cost, edgetl.metaop); models/ imports
    nothing of memory/ (memory/ reads models/)."""
    graph = import_graph()
    models = {name: deps for name, deps in graph.items() if name.startswith("edgetl.models")}
    assert "edgetl.cost" in graph["edgetl.models.lean.frozen"]  # the walk sees these imports
    wrong = {name: sorted(d for d in deps if d.startswith("edgetl.memory")) for name, deps in models.items()}
    assert not {name: deps for name, deps in wrong.items() if deps}, wrong

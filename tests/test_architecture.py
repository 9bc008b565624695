"""The house rules a reviewer would otherwise check by hand: imports in one direction, small modules.

The import graph is read from the source (ast), every ``import refmla...`` counted wherever it
stands, inside a function too: an import moved into a function still makes a cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "refmla"
MAX_MODULE_LINES = 450  # "a few hundred lines"; a module past it must be split or listed below with why
LONG_MODULES: dict[str, str] = {}  # module -> the reason it stays long


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py")) if "sitecustomize" not in p.parts}


def imported(path: Path, name: str, known: set[str]) -> set[str]:
    """The refmla modules ``path`` imports (``from refmla.x import y`` is refmla.x.y when that is a module)."""
    is_pkg = path.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative import
                pkg = name.split(".") if is_pkg else name.split(".")[:-1]
                pkg = pkg[: len(pkg) - node.level + 1]
                base = ".".join(pkg + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        out |= {t for t in targets if t in known and t != name}
    return out


def import_graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {name: imported(path, name, known) for name, path in mods.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One cycle as [a, b, ..., a], or [] when the graph is acyclic."""
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def visit(n: str) -> list[str]:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph[n]):
            if state.get(m) == 1:
                return stack[stack.index(m) :] + [m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        stack.pop()
        state[n] = 2
        return []

    for n in sorted(graph):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return []


def test_the_import_graph_has_no_cycle():
    cycle = find_cycle(import_graph())
    assert not cycle, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) == []


def test_the_bottom_imports_nothing_of_refmla():
    graph = import_graph()
    for bottom in ("refmla.util", "refmla.schedule", "refmla.paged", "refmla.pool", "refmla.scales", "refmla.attended"):
        assert graph[bottom] <= {"refmla.util"}, f"{bottom} imports {sorted(graph[bottom])}"


@pytest.mark.parametrize("name", sorted(modules()))
def test_modules_stay_small(name):
    lines = len(modules()[name].read_text().splitlines())
    if name in LONG_MODULES:
        pytest.skip(f"{name}: {lines} lines, kept long: {LONG_MODULES[name]}")
    assert lines <= MAX_MODULE_LINES, f"{name} has {lines} lines: split it along its seams"

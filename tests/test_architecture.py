"""The house rules a reviewer would otherwise check by hand, read from the tree itself: imports in
the order the package docstring states, the hook's boundary, every module listed in its
package's docstring, small modules.

The import graph is read from the source (ast), every ``import refmla...`` counted wherever it
stands, at module level or inside a function (an import moved into a function still makes a
cycle), and so is every import by name: ``importlib.import_module("refmla.x")`` / ``__import__``
with a literal name, and a ``"refmla.x:Name"`` registry entry that is loaded that way. Each check is a
function of a package folder, so the tests below also run it on a copy with a planted violation:
a check that cannot fail checks nothing.
"""

from __future__ import annotations

import ast
import re
import shutil
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "refmla"
MAX_MODULE_LINES = 450  # "a few hundred lines"; a module past it must be split or listed below with why
LONG_MODULES: dict[str, str] = {}  # module -> the reason it stays long
NOT_MODULES = ("sitecustomize",)  # the hook's start-up file: run by the interpreter, never imported


def module_name(path: Path, package: Path = PACKAGE) -> str:
    rel = path.relative_to(package.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules(package: Path = PACKAGE) -> dict[str, Path]:
    files = sorted(package.rglob("*.py"))
    return {module_name(p, package): p for p in files if not any(n in p.parts for n in NOT_MODULES)}


def imported(path: Path, name: str, known: set[str], top_level_only: bool = False) -> set[str]:
    """The refmla modules ``path`` imports (``from refmla.x import y`` is refmla.x.y when that is a
    module); ``top_level_only``: only the statements at module level, none inside a function."""
    is_pkg = path.name == "__init__.py"
    out = set()
    tree = ast.parse(path.read_text(), str(path))
    funcs = (ast.FunctionDef, ast.AsyncFunctionDef)
    nodes = [n for top in tree.body if not isinstance(top, funcs) for n in ast.walk(top)] if top_level_only else ast.walk(tree)
    for node in nodes:
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative import
                pkg = name.split(".") if is_pkg else name.split(".")[:-1]
                pkg = pkg[: len(pkg) - node.level + 1]
                base = ".".join(pkg + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        elif isinstance(node, ast.Call) and by_name(node):
            targets = [node.args[0].value]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and ":" in node.value:
            targets = [node.value.split(":", 1)[0]]  # "refmla.backends.triton:TritonBackend"
        else:
            continue
        out |= {t for t in targets if t in known and t != name}
    return out


def by_name(call: ast.Call) -> bool:
    """``importlib.import_module("...")``, ``import_module("...")`` or ``__import__("...")`` with a literal name."""
    f = call.func
    called = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
    literal = bool(call.args) and isinstance(call.args[0], ast.Constant) and isinstance(call.args[0].value, str)
    return called in ("import_module", "__import__") and literal


ROOT = "refmla"  # the package root: its constants (version, format name) are importable by every module
ROOT_LAZY = {"refmla.api"}  # what the root's functions may name: refmla.replay / synth / regions, on first use


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the refmla modules it imports. The root counts only its module-level imports: every
    module depends on its package root anyway, and the root's ``__getattr__`` hands out the API on
    first use (:func:`root_lazy_imports` checks that it names nothing else)."""
    mods = modules(package)
    known = set(mods)
    return {name: imported(path, name, known, top_level_only=name == ROOT) for name, path in mods.items()}


def root_lazy_imports(package: Path = PACKAGE) -> set[str]:
    """What the root's functions import beyond ROOT_LAZY (none)."""
    mods = modules(package)
    return imported(mods[ROOT], ROOT, set(mods)) - ROOT_LAZY


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


# --------------------------------------------------------------------------------------------
# What the package docstring states
# --------------------------------------------------------------------------------------------

ENTRY = re.compile(r"^ {4}(\w+(?:\.py|/))\s")  # a layout line: "    util.py   ...", "    capture/  ..."


def docstring(package_dir: Path) -> str:
    return ast.get_docstring(ast.parse((package_dir / "__init__.py").read_text())) or ""


def layout(package: Path = PACKAGE) -> list[str]:
    """The root docstring's layout, in order: ["util.py", "atomic.py", ..., "hook/"]."""
    return [m.group(1) for line in docstring(package).splitlines() if (m := ENTRY.match(line))]


def entry_of(module: str, package: Path = PACKAGE) -> str | None:
    """The layout entry a module belongs to: refmla.capture.read -> "capture/", refmla.util -> "util.py"."""
    parts = module.split(".")
    if len(parts) == 1:
        return None  # the package root (its version and format name), importable by all
    top = parts[1]
    return f"{top}/" if (package / top).is_dir() else f"{top}.py"


def upward_imports(package: Path = PACKAGE) -> list[str]:
    """Imports of an entry listed later in the layout ("imports go down this list, never up"), and
    modules whose entry the layout does not list."""
    order = {e: i for i, e in enumerate(layout(package))}
    bad = []
    for a, targets in sorted(import_graph(package).items()):
        ea = entry_of(a, package)
        if ea is not None and ea not in order:
            bad.append(f"{a}: {ea} is not in the layout")
            continue
        for b in sorted(targets):
            eb = entry_of(b, package)
            if ea is None or eb is None or eb == ea:
                continue
            if order.get(eb, -1) > order[ea]:
                bad.append(f"{a} imports {b} ({eb} is listed after {ea})")
    return bad


def hook_boundary(package: Path = PACKAGE) -> list[str]:
    """What the root docstring says the hook may import: "hook/ ... (imports only A, B and C)"."""
    text = " ".join(docstring(package).split())
    m = re.search(r"hook/ [^(]*\(imports only ([^)]*)\)", text)
    assert m, "the layout states the hook's boundary: 'hook/ ... (imports only ...)'"
    return [w.strip() for w in re.split(r",| and ", m.group(1)) if w.strip()]


def hook_violations(package: Path = PACKAGE) -> list[str]:
    allowed = set(hook_boundary(package))
    bad = []
    for a, targets in sorted(import_graph(package).items()):
        if entry_of(a, package) != "hook/":
            continue
        for b in sorted(targets):
            eb = entry_of(b, package)
            if eb not in ("hook/", *allowed) and not (eb is None and "refmla" in allowed):
                bad.append(f"{a} imports {b}: outside the hook's boundary ({', '.join(sorted(allowed))})")
    return bad


KIND_WORDS = ("sparse", "dense", "paged", "blocktable", "block_table")  # a capture kind named in a function's name
KIND_MODULES = ("refmla.sparse", "refmla.hypotheses", "refmla.localize")  # reached through refmla.kinds only


def kind_specific(package: Path = PACKAGE) -> list[str]:
    """What in pipeline.py belongs to one capture kind: a function or class named after a kind, an
    import of a kind's own modules (its reference, hypothesis families, localization): the one
    replay gets them from the capture's kind (refmla.kinds)."""
    path = package / "pipeline.py"
    found = [f"pipeline.py defines {n.name}: specific to one capture kind" for n in ast.walk(ast.parse(path.read_text()))
             if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
             and any(w in n.name.lower() for w in KIND_WORDS)]  # fmt: skip
    found += [f"refmla.pipeline imports {m}: a kind's own module (go through refmla.kinds)"
              for m in sorted(imported(path, "refmla.pipeline", set(modules(package))))
              if any(m == k or m.startswith(k + ".") for k in KIND_MODULES)]  # fmt: skip
    return found


def unlisted_modules(package: Path = PACKAGE) -> list[str]:
    """Modules and sub-packages a package's docstring does not name (as ``name.py``, ``name/`` or a
    line that starts with the name)."""
    bad = []
    for init in sorted(package.rglob("__init__.py")):
        pkg = init.parent
        if any(n in pkg.parts for n in NOT_MODULES):
            continue
        doc = docstring(pkg)
        children = [p.stem for p in pkg.glob("*.py") if p.name != "__init__.py"]
        children += [d.name for d in pkg.iterdir() if (d / "__init__.py").is_file()]
        children += [d.name for d in pkg.iterdir() if d.is_dir() and d.name in NOT_MODULES]
        for name in sorted(children):
            named = re.search(rf"(?<![\w.]){re.escape(name)}(\.py|/)(?!\w)", doc) or re.search(
                rf"^\s+{re.escape(name)}\s", doc, re.M
            )
            if not named:
                bad.append(f"{module_name(pkg / name, package)} is not listed in {module_name(init, package)}'s docstring")
    return bad


# --------------------------------------------------------------------------------------------
# The rules, on the real tree
# --------------------------------------------------------------------------------------------


def test_the_import_graph_has_no_cycle():
    cycle = find_cycle(import_graph())
    assert not cycle, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) == []


def test_the_root_imports_nothing_and_names_only_the_api_on_first_use():
    assert import_graph()[ROOT] == set() and root_lazy_imports() == set()


def test_the_bottom_imports_nothing_of_refmla():
    graph = import_graph()
    for bottom in ("refmla.util", "refmla.schedule", "refmla.paged", "refmla.pool", "refmla.scales", "refmla.attended"):
        assert graph[bottom] <= {"refmla.util"}, f"{bottom} imports {sorted(graph[bottom])}"


def test_imports_follow_the_layout_order():
    assert layout()[0] == "util.py" and "hook/" in layout()
    assert upward_imports() == []


def test_the_hook_imports_only_what_the_layout_allows():
    assert hook_violations() == []


def test_the_replay_has_one_path_for_every_capture_kind():
    assert kind_specific() == []


def test_every_module_is_listed_in_its_package_docstring():
    assert unlisted_modules() == []


def test_the_readme_links_to_the_one_layout():
    readme = (PACKAGE.parent / "README.md").read_text()
    assert "refmla/__init__.py" in readme, "the README points to the layout in refmla/__init__.py"
    assert sum(f"    {e} " in readme or f"`{e}`" in readme.split("## ")[0] for e in layout()) < len(layout()) // 2, (
        "the README carries a second copy of the layout"
    )


@pytest.mark.parametrize("name", sorted(modules()))
def test_modules_stay_small(name):
    lines = len(modules()[name].read_text().splitlines())
    if name in LONG_MODULES:
        pytest.skip(f"{name}: {lines} lines, kept long: {LONG_MODULES[name]}")
    assert lines <= MAX_MODULE_LINES, f"{name} has {lines} lines: split it along its seams"


# --------------------------------------------------------------------------------------------
# Each rule fails on a planted violation (in a copy of the package)
# --------------------------------------------------------------------------------------------


@pytest.fixture
def copy(tmp_path) -> Path:
    dst = tmp_path / "refmla"
    shutil.copytree(PACKAGE, dst, ignore=shutil.ignore_patterns("__pycache__"))
    return dst


def _append(path: Path, text: str) -> None:
    path.write_text(path.read_text() + text)


@pytest.mark.parametrize("planted", [
    "\nfrom refmla.cli import main  # noqa\n",  # at module level
    "\n\ndef _planted():\n    from refmla.cli import main  # noqa\n",  # inside a function
    "\n\ndef _planted():\n    import importlib\n\n    return importlib.import_module('refmla.cli')\n",  # by name
    "\n_PLANTED = {'x': 'refmla.cli:main'}  # a registry entry loaded by name\n",
], ids=["module_level", "in_function", "import_module", "registry"])  # fmt: skip
def test_an_upward_import_is_caught(copy, planted):
    _append(copy / "util.py", planted)
    assert any("refmla.util imports refmla.cli" in v for v in upward_imports(copy))
    assert not upward_imports()  # the real tree has none


def test_a_root_import_beyond_the_api_is_caught(copy):
    _append(copy / "__init__.py", "\n\ndef _planted():\n    from refmla.cli import main  # noqa\n")
    assert root_lazy_imports(copy) == {"refmla.cli"} and import_graph(copy)[ROOT] == set()
    _append(copy / "__init__.py", "\nfrom refmla.cli import main  # noqa\n")
    assert import_graph(copy)[ROOT] == {"refmla.cli"}


def test_a_module_outside_the_layout_is_caught(copy):
    (copy / "stray.py").write_text('"""not in the layout"""\n')
    assert any("stray.py is not in the layout" in v for v in upward_imports(copy))


def test_a_hook_import_outside_its_boundary_is_caught(copy):
    _append(copy / "hook" / "config.py", "\n\ndef _planted():\n    from refmla.pipeline import replay_file  # noqa\n")
    assert any("refmla.hook.config imports refmla.pipeline" in v for v in hook_violations(copy))


def test_a_module_missing_from_its_package_docstring_is_caught(copy):
    (copy / "capture" / "planted_module.py").write_text('"""planted"""\n')
    (copy / "backends" / "aiter" / "planted_kernel.py").write_text('"""planted"""\n')
    found = unlisted_modules(copy)
    assert any("refmla.capture.planted_module is not listed" in v for v in found)
    assert any("refmla.backends.aiter.planted_kernel is not listed" in v for v in found)


def test_sparse_has_no_pipeline_of_its_own():
    """refmla/sparse/ keeps only what is its own (layouts, decode, presets, adapters, its mistakes):
    reading, judging, diagnosing, replaying, rendering and the goldens are the one pipeline (issue 28)."""
    own = {p.stem for p in (PACKAGE / "sparse").glob("*.py")}
    assert not own & {"io", "judge", "diagnosis", "replay", "render", "golden"}, sorted(own)


def test_a_kind_specific_function_in_the_replay_is_caught(copy):
    _append(copy / "pipeline.py", "\n\ndef replay_sparse(cap, opts):\n    from refmla.sparse.reference import sparse_reference  # noqa\n")
    found = kind_specific(copy)
    assert any("defines replay_sparse" in v for v in found), found
    assert any("imports refmla.sparse.reference" in v for v in found), found
    assert kind_specific() == []  # the real tree has none

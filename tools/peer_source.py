"""One module-level function of a peer project's source file (a test's torch reference), executed
without the rest of the file: the file is parsed with ``ast``, and only the function, the
module-level functions it reaches and the file's own import statements of the names they use run.
Shared by tools/aiter_peer.py and tools/flashmla_peer.py (nothing of either project is copied here).
"""

from __future__ import annotations

import ast
import builtins
import subprocess
from pathlib import Path
from typing import Callable


def load_function(path: Path, entry: str, not_loadable: frozenset, error: type, module_name: str,
                  why: str = "not loadable here", unannotated: bool = False) -> tuple[Callable, tuple[str, ...]]:
    """(the function ``entry`` of the file ``path``, the names of the functions that ran); ``error``
    (one line naming the file) when the file is missing, unparsable, lacks ``entry``, or ``entry``
    needs a name the file binds only through a package in ``not_loadable`` or a relative import
    (``why`` says what that package is). ``unannotated``: annotations dropped (they may name the
    unloadable package's types; they do nothing)."""
    try:
        tree = ast.parse(path.read_text(), filename=str(path))
    except (SyntaxError, UnicodeDecodeError) as e:
        raise error(f"{path}: cannot be parsed ({e})") from None
    defs = {n.name: (_unannotated(n) if unannotated else n) for n in tree.body if isinstance(n, ast.FunctionDef)}
    if entry not in defs:
        raise error(f"{path}: no module-level function {entry}")
    imports = {a.asname or a.name.split(".")[0]: n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))
               for a in n.names}  # fmt: skip
    needed, bound, todo = set(), {}, [entry]
    while todo:  # the functions entry reaches through the module's globals
        name = todo.pop()
        if name in needed:
            continue
        needed.add(name)
        for g in sorted(free_names(defs[name])):
            if g in defs:
                todo.append(g)
            elif g in imports:
                bound[g] = imports[g]
            elif not hasattr(builtins, g):
                raise error(f"{path}: {name} uses {g}, which the file does not bind at module level")
    for g, node in sorted(bound.items()):
        root = ((node.module or "") if isinstance(node, ast.ImportFrom) else _only(node, g).names[0].name).split(".")[0]
        if root in not_loadable or (isinstance(node, ast.ImportFrom) and node.level):
            raise error(f"{path}: the reference needs {g}, which comes from {root or 'a relative import'} ({why})")
    body = [_only(node, g) for g, node in sorted(bound.items())] + [defs[n.name] for n in tree.body
                                                                     if isinstance(n, ast.FunctionDef) and n.name in needed]  # fmt: skip
    namespace: dict = {"__name__": module_name, "__file__": str(path)}
    exec(compile(ast.Module(body=body, type_ignores=[]), str(path), "exec"), namespace)  # noqa: S102 (their checkout)
    return namespace[entry], tuple(n.name for n in body if isinstance(n, ast.FunctionDef))


def _unannotated(fn: ast.FunctionDef) -> ast.FunctionDef:
    """The function with its annotations dropped (arguments, return, annotated locals)."""
    for node in ast.walk(fn):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            node.returns = None
        elif isinstance(node, ast.arg):
            node.annotation = None
        elif isinstance(node, ast.AnnAssign):  # a local's annotation is never evaluated: no name of it is needed
            node.annotation = ast.copy_location(ast.Constant(None), node.annotation)
    return fn


def _only(node: ast.stmt, name: str) -> ast.stmt:
    """The import statement cut to the one alias that binds ``name``."""
    alias = next(a for a in node.names if (a.asname or a.name.split(".")[0]) == name)
    new = ast.ImportFrom(node.module, [alias], node.level) if isinstance(node, ast.ImportFrom) else ast.Import([alias])
    return ast.fix_missing_locations(ast.copy_location(new, node))


def free_names(fn: ast.FunctionDef) -> set[str]:
    """Names a function reads that it does not bind itself (its globals, builtins included)."""
    a = fn.args
    local = {x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs, *filter(None, (a.vararg, a.kwarg)))}
    loads = set()
    for node in ast.walk(fn):
        if isinstance(node, ast.Name):
            (loads if isinstance(node.ctx, ast.Load) else local).add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node is not fn:
            local.add(node.name)
        elif isinstance(node, ast.arg):
            local.add(node.arg)  # a nested function's or lambda's parameter
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            local.update(x.asname or x.name.split(".")[0] for x in node.names)
    return loads - local


def commit(repo: Path) -> str:
    """The checkout's HEAD, for the record ("" when it is not a git checkout)."""
    try:
        r = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return r.stdout.strip() if r.returncode == 0 else ""

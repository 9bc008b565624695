"""aiter's own torch reference for MLA, loaded at run time from an aiter checkout the user points at.

aiter's ``op_tests/test_mla.py`` imports aiter (ROCm only) and pandas and sets torch's default
device to CUDA at module level, so it cannot be imported on a CPU machine. This loader reads the
file, parses it with ``ast`` and executes only ``torch_mla_extend`` and the module-level functions
it calls (today ``ref_masked_attention``), found by the global names their bodies use, together
with the file's own imports of those names (``torch``). No other statement of the file runs, aiter
is never imported, and none of aiter's code is copied into refmla. A global name the functions need
that the file binds only through an aiter import, or not at all, is refused with one line naming it
(:class:`AiterPeerError`), as is a missing file or function.

    peer = load_aiter_peer("/path/to/aiter")   # the checkout (or REFMLA_AITER_REPO)
    out, lse = peer.decode(q, kv_buffer, kv_indptr, kv_indices, kv_lora_rank=512, sm_scale=0.13)
"""

from __future__ import annotations

import ast
import builtins
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

ENV = "REFMLA_AITER_REPO"  # where the benchmark and the tests look for the checkout when not told
FILE = Path("op_tests") / "test_mla.py"
ENTRY = "torch_mla_extend"


class AiterPeerError(ValueError):
    """The checkout cannot give aiter's torch reference (one line: the file and what is missing)."""


@dataclass(frozen=True)
class AiterPeer:
    """aiter's torch_mla_extend as loaded, with where it came from."""

    fn: Callable  # torch_mla_extend(q, kvc_cache, qo_indptr, kv_indptr, kv_indices, sm_scale, Dv, rope, dtype)
    path: Path  # the test_mla.py it was read from
    functions: tuple[str, ...]  # the functions executed, in file order
    commit: str  # the checkout's HEAD ("" when not a git checkout)

    def decode(self, q, kv_buffer, kv_indptr, kv_indices, *, kv_lora_rank: int, sm_scale: float):
        """Decode (one query row per request) as aiter's own tests call it: qo_indptr = 0..B,
        the indices as stored, q's dtype as the output dtype. q [B, H, D] -> out [B, H, Dv], lse [B, H]."""
        qo_indptr = torch.arange(q.shape[0] + 1, dtype=kv_indptr.dtype)
        rope = kv_buffer.shape[-1] - kv_lora_rank
        return self.fn(q, kv_buffer, qo_indptr, kv_indptr, kv_indices, sm_scale, kv_lora_rank, rope, q.dtype)


def load_aiter_peer(repo: str | Path) -> AiterPeer:
    """aiter's torch_mla_extend from ``repo``/op_tests/test_mla.py (module docstring)."""
    path = Path(repo) / FILE
    if not path.is_file():
        raise AiterPeerError(f"{path}: no such file (--aiter-repo / {ENV} must name an aiter checkout)")
    try:
        tree = ast.parse(path.read_text(), filename=str(path))
    except (SyntaxError, UnicodeDecodeError) as e:
        raise AiterPeerError(f"{path}: cannot be parsed ({e})") from None
    defs = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    if ENTRY not in defs:
        raise AiterPeerError(f"{path}: no module-level function {ENTRY}")
    imports = _imports(tree)
    needed, bound, todo = set(), {}, [ENTRY]
    while todo:  # the functions ENTRY reaches through the module's globals
        name = todo.pop()
        if name in needed:
            continue
        needed.add(name)
        for g in sorted(_free_names(defs[name])):
            if g in defs:
                todo.append(g)
            elif g in imports:
                bound[g] = imports[g]
            elif not hasattr(builtins, g):
                raise AiterPeerError(f"{path}: {name} uses {g}, which the file does not bind at module level")
    for g, node in sorted(bound.items()):
        root = ((node.module or "") if isinstance(node, ast.ImportFrom) else _only(node, g).names[0].name).split(".")[0]
        if root == "aiter" or (isinstance(node, ast.ImportFrom) and node.level):
            where = root or "a relative import"
            raise AiterPeerError(f"{path}: the reference needs {g}, which comes from {where} (not loadable here)")
    keep = [defs[n] for n in needed]
    body = [_only(node, g) for g, node in sorted(bound.items())] + [n for n in tree.body if any(n is k for k in keep)]
    namespace: dict = {"__name__": "aiter_op_tests_test_mla", "__file__": str(path)}
    exec(compile(ast.Module(body=body, type_ignores=[]), str(path), "exec"), namespace)  # noqa: S102 (their checkout)
    functions = tuple(n.name for n in body if isinstance(n, ast.FunctionDef))
    return AiterPeer(namespace[ENTRY], path, functions, _commit(Path(repo)))


def _imports(tree: ast.Module) -> dict[str, ast.stmt]:
    """Module-level names bound by import statements -> the statement."""
    out = {}
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for a in node.names:
                out[a.asname or a.name.split(".")[0]] = node
    return out


def _only(node: ast.stmt, name: str) -> ast.stmt:
    """The import statement cut to the one alias that binds ``name``."""
    alias = next(a for a in node.names if (a.asname or a.name.split(".")[0]) == name)
    new = ast.ImportFrom(node.module, [alias], node.level) if isinstance(node, ast.ImportFrom) else ast.Import([alias])
    return ast.fix_missing_locations(ast.copy_location(new, node))


def _free_names(fn: ast.FunctionDef) -> set[str]:
    """Names a function reads that it does not bind itself (its globals, builtins included)."""
    a = fn.args
    local = {x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs, *filter(None, (a.vararg, a.kwarg)))}
    loads = set()
    for node in ast.walk(fn):
        if isinstance(node, ast.Name):
            (loads if isinstance(node.ctx, ast.Load) else local).add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node is not fn:
            local.add(node.name)
        elif isinstance(node, ast.arg) and node not in (*a.posonlyargs, *a.args, *a.kwonlyargs):
            local.add(node.arg)  # a nested function's or lambda's parameter
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            local.update(x.asname or x.name.split(".")[0] for x in node.names)
    return loads - local


def _commit(repo: Path) -> str:
    """The checkout's HEAD, for the record ("" when it is not a git checkout)."""
    try:
        r = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return r.stdout.strip() if r.returncode == 0 else ""

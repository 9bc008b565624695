"""The sparse decode part of `refmla replay` (sparse captures are handed here; `refmla synth` of a
sparse preset is refmla.api.synth)."""

from __future__ import annotations

import sys
from typing import Sequence

from refmla.cli.common import print_json, unrun_exit, worst_exit
from refmla.compare import Tolerance
from refmla.sparse.io import is_sparse_file
from refmla.sparse.render import render_sparse
from refmla.sparse.replay import replay_sparse


def split_sparse(paths: Sequence[str]) -> tuple[list[str], list[str]]:
    """(dense captures, sparse captures), in the order given."""
    sparse = [p for p in paths if is_sparse_file(p)]
    return [p for p in paths if p not in sparse], sparse


def replay_sparse_files(paths: Sequence[str], args, tol: Tolerance) -> int:
    """Replay each sparse capture, print its table (or JSON), an invalid one as one stderr line; the worst exit code."""
    reports = [replay_sparse(p, backends=args.backend or None, tol=tol, explain_failures=not args.no_explain)
               for p in paths]  # fmt: skip
    for r in reports:
        if r.verdict == "invalid":
            print(f"refmla: error: {r.error}", file=sys.stderr)
    good = [r for r in reports if r.verdict != "invalid"]
    if args.json:
        print_json(good[0] if len(good) == 1 else good)
    elif good:
        print("\n\n".join(render_sparse(r) for r in good))
    not_run = unrun_exit(good, args.backend, getattr(args, "allow_skip", False))  # asked for, did not run: 3
    return worst_exit(max(r.exit_code for r in reports), not_run)


__all__ = ["replay_sparse_files", "split_sparse"]

"""The sparse decode part of `refmla replay` (sparse captures are handed here) and of
`refmla synth` (a sparse preset)."""

from __future__ import annotations

import json
import sys
from typing import Sequence

from refmla.capture import CaptureError
from refmla.cli.common import EXIT_INVALID, EXIT_OK, print_json
from refmla.compare import Tolerance
from refmla.sparse.io import is_sparse_file
from refmla.sparse.make import synth_sparse
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
    return max(r.exit_code for r in reports)


def synth_sparse_cmd(args) -> int:
    try:
        planted = synth_sparse(args.out, args.preset, args.fault, args.seed, layer=args.layer)
    except (ValueError, CaptureError) as e:
        print(f"refmla: error: {args.out}: {e}", file=sys.stderr)
        return EXIT_INVALID
    layer = "" if args.layer is None else f" layer {args.layer}"
    print(f"wrote {args.out} (preset {args.preset}{layer}, planted {json.dumps(planted)})")
    return EXIT_OK


__all__ = ["replay_sparse_files", "split_sparse", "synth_sparse_cmd"]

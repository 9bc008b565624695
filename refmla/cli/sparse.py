"""The sparse decode part of `refmla replay` (sparse captures are handed here) and of
`refmla synth` (a sparse preset)."""

from __future__ import annotations

import json
import sys
from typing import Optional, Sequence, Union

from refmla.batch import replay_one
from refmla.capture import CaptureError
from refmla.cli.common import EXIT_INVALID, EXIT_OK
from refmla.options import ReplayOptions
from refmla.render.replay import render_or_say
from refmla.results import ReplayReport
from refmla.sparse.io import is_sparse_file
from refmla.sparse.make import synth_sparse
from refmla.sparse.render import render_sparse
from refmla.sparse.replay import SparseReport, replay_sparse
from refmla.util import error_text


def split_sparse(paths: Sequence[str]) -> tuple[list[str], list[str]]:
    """(dense captures, sparse captures), in the order given."""
    sparse = [p for p in paths if is_sparse_file(p)]
    return [p for p in paths if p not in sparse], sparse


def replay_kind(path: str, opts: ReplayOptions, sparse: frozenset = frozenset(),
                sparse_backends: Optional[tuple] = None) -> Union[ReplayReport, SparseReport]:  # fmt: skip
    """One capture of a mixed batch (refmla.batch.replay_many's task, picklable, never raising): a
    path in ``sparse`` through the sparse replay with ``sparse_backends``, any other the dense one.
    refmla failing on a sparse capture (MemoryError included) is its ``invalid`` report."""
    if path not in sparse:
        return replay_one(path, opts)
    try:
        return replay_sparse(path, backends=sparse_backends, tol=opts.tol, explain_failures=opts.explain)
    except Exception as e:
        return SparseReport(str(path), "invalid", error=str(CaptureError(path, "replay", error_text(e))))


def render_any(report) -> str:
    """A dense or a sparse report's text."""
    return render_sparse(report) if isinstance(report, SparseReport) else render_or_say(report)


def synth_sparse_cmd(args) -> int:
    try:
        planted = synth_sparse(args.out, args.preset, args.fault, args.seed, layer=args.layer)
    except (ValueError, CaptureError) as e:
        print(f"refmla: error: {args.out}: {e}", file=sys.stderr)
        return EXIT_INVALID
    layer = "" if args.layer is None else f" layer {args.layer}"
    print(f"wrote {args.out} (preset {args.preset}{layer}, planted {json.dumps(planted)})")
    return EXIT_OK


__all__ = ["render_any", "replay_kind", "split_sparse", "synth_sparse_cmd"]

"""`refmla replay CAPTURE... [--backend NAME]... [--json]`: captures through the backends."""

from __future__ import annotations

import sys
from functools import partial

from refmla.atomic import WriteError
from refmla.backends import ALL_NAMES
from refmla.batch import replay_many
from refmla.cli.common import EXIT_INVALID, expand_captures, need_matplotlib, print_json, report_invalid, single_file
from refmla.cli.replay_flags import add_replay_flags, replay_options
from refmla.cli.sparse import render_any, replay_kind, split_sparse
from refmla.render.replay import summary_table
from refmla.results import ReplayReport
from refmla.replay import worst_status
from refmla.series import attach_series
from refmla.util import first_line
from refmla.sparse.backends import BACKENDS as SPARSE_BACKENDS

SPARSE_ONLY = [n for n in SPARSE_BACKENDS if n not in ALL_NAMES]  # aiter_sparse, tilelang


def add_parser(sub) -> None:
    r = sub.add_parser("replay", help="replay captures through the backends, compare with the reference")
    r.add_argument("captures", nargs="+", metavar="CAPTURE", help="capture files or directories")
    add_replay_flags(r, list(ALL_NAMES) + SPARSE_ONLY, "replay captures in parallel processes")
    r.set_defaults(func=run)


def run(args) -> int:
    paths = expand_captures(args.captures)
    sparse = split_sparse(paths)[1]
    sparse_backends = tuple(args.backend) if args.backend else None  # every name: the sparse replay sorts them
    if args.backend:  # the dense backends asked for (a sparse-only name is for the sparse captures)
        args.backend = [b for b in args.backend if b not in SPARSE_ONLY] or None
    opts = replay_options(args)
    if args.plot:
        need_matplotlib()
    task = partial(replay_kind, sparse=frozenset(sparse), sparse_backends=sparse_backends) if sparse else None
    everything = replay_many(paths, opts, jobs=args.jobs, task=task)  # dense and sparse, in the order given
    for r in everything:  # each unusable capture: one line on stderr (exit 2); the others are still reported
        if r.verdict == "invalid":
            report_invalid(r.capture, r.error, r.metadata.errors if isinstance(r, ReplayReport) else [])
    reports = [r for r in everything if isinstance(r, ReplayReport)]
    if len(reports) > 1:
        attach_series(reports)  # each report gets its findings against the previous step
    failed = _plots(reports, args.plot) if args.plot else []
    if args.json:  # ONE document: an object for one file, else one array of every capture's report
        print_json(everything[0] if len(everything) == 1 and single_file(args.captures) else everything)
    else:
        text = [render_any(r) for r in everything if isinstance(r, ReplayReport) or r.verdict != "invalid"]
        print("\n\n".join(text))
        if len(reports) > 1:
            print("\n" + summary_table(reports))
    for line in failed:  # after the reports: a plot that fails costs no report
        print(f"refmla: error: {line}", file=sys.stderr)
    return max(worst_status(everything), EXIT_INVALID if failed else 0)


def _plots(reports, out_dir) -> list[str]:
    """Write the plots; returns one line per failure (the target refused, a capture's plot failed)."""
    from refmla.plots import plot_replay

    failed: list[str] = []
    try:
        for path in plot_replay(reports, out_dir, failures=failed):
            print(f"wrote {path}", file=sys.stderr)
    except (WriteError, OSError) as e:
        failed.append(f"--plot {out_dir}: {first_line(e)}")
    return failed

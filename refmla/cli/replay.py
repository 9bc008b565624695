"""`refmla replay CAPTURE... [--backend NAME]... [--json]`: captures through the backends."""

from __future__ import annotations

import sys

from refmla.atomic import WriteError
from refmla.backends import ALL_NAMES
from refmla.batch import WithSteps, replay_many
from refmla.cp.replay import KIND as CP_KIND
from refmla.cp.replay import group_steps
from refmla.cli.common import (EXIT_INVALID, drawable, expand_captures, need_matplotlib, print_json, report_invalid,
                               single_file, unrun_exit, worst_exit)
from refmla.cli.replay_flags import add_replay_flags, replay_options
from refmla.render.replay import render_or_say, summary_table
from refmla.pipeline import SPARSE_ONLY, worst_status
from refmla.chain import link
from refmla.series import attach_series
from refmla.util import error_text, first_line
from refmla.merge.backends import BACKENDS as MERGE_BACKENDS
from refmla.indexer.backends import BACKENDS as INDEXER_BACKENDS

MERGE_ONLY = list(MERGE_BACKENDS)  # the merge kernels, for merge captures (refmla.merge.backends)
INDEXER_ONLY = list(INDEXER_BACKENDS)  # the engines' indexer code, for indexer captures (refmla.indexer.backends)


def add_parser(sub) -> None:
    r = sub.add_parser("replay", help="replay captures through the backends, compare with the reference")
    r.add_argument("captures", nargs="+", metavar="CAPTURE", help="capture files or directories")
    add_replay_flags(r, list(ALL_NAMES) + SPARSE_ONLY + MERGE_ONLY + INDEXER_ONLY, "replay captures in parallel processes")
    r.set_defaults(func=run)


def run(args) -> int:
    paths, origins = [], []  # every kind: dense, block-table, verify, sparse decode; and the argument each came from
    for given in args.captures:
        found = expand_captures([given])
        paths, origins = paths + found, origins + [given] * len(found)
    units, steps = group_steps(paths, origins)  # the DCP ranks of one step: one unit (refmla.cp.replay)
    asked = args.backend
    opts = replay_options(args)
    if args.plot:
        need_matplotlib()
    reports = replay_many(units, opts, jobs=args.jobs, task=WithSteps(steps) if steps else None)
    for r in reports:  # each unusable capture: one line on stderr (exit 2); the others are still reported
        if r.verdict == "invalid":
            report_invalid(r.capture, r.error, r.metadata.errors)
    per_capture = [r for r in reports if r.kind != CP_KIND]  # a step of ranks has no series of its own
    if len(per_capture) > 1:
        try:
            attach_series(per_capture, opts)  # findings against the previous step, and stale_metadata
        except Exception as e:  # an aid across captures: never the cost of the reports themselves
            print(f"refmla: warning: series checks skipped: {error_text(e)}", file=sys.stderr)
        link(per_capture)  # writer <-> reader: the writer's or the contract's part, another layer, stale rows (never raises)
    failed = _plots(drawable(reports), args.plot) if args.plot else []
    if args.json:
        print_json(reports[0] if len(reports) == 1 and single_file(args.captures) else reports)
    else:
        print("\n\n".join(render_or_say(r) for r in reports))
        if len(reports) > 1:
            print("\n" + summary_table(reports))
    for line in failed:  # after the reports: a plot that fails costs no report
        print(f"refmla: error: {line}", file=sys.stderr)
    not_run = unrun_exit(reports, asked, args.allow_skip)  # a backend asked for that did not run: exit 3
    return worst_exit(worst_status(reports), EXIT_INVALID if failed else 0, not_run)


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

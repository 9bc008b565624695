"""`refmla replay CAPTURE... [--backend NAME]... [--json]`: captures through the backends."""

from __future__ import annotations

import sys

from refmla.atomic import WriteError
from refmla.backends import ALL_NAMES
from refmla.batch import replay_many
from refmla.cli.common import (
    EXIT_INVALID,
    UsageError,
    expand_captures,
    need_matplotlib,
    nonneg_float,
    output_path,
    positive_int,
    print_json,
    report_invalid,
    single_file,
)
from refmla.compare import Tolerance
from refmla.context import ReplayOptions
from refmla.render.replay import render_or_say, summary_table
from refmla.replay import backend_names, worst_status
from refmla.series import attach_series
from refmla.util import first_line


def add_parser(sub) -> None:
    r = sub.add_parser("replay", help="replay captures through the backends, compare with the reference")
    r.add_argument("captures", nargs="+", metavar="CAPTURE", help="capture files or directories")
    r.add_argument("--backend", action="append", choices=ALL_NAMES,
                   help="run only these (repeatable); flex runs only when named")
    r.add_argument("--json", action="store_true", help="JSON report on stdout")
    r.add_argument("--k", type=nonneg_float, default=2.0, help="allowed multiple of the control's error (2)")
    r.add_argument("--ulps", type=nonneg_float, default=1.0, help="plus this many output-dtype ulps (1)")
    r.add_argument("--cos", type=nonneg_float, default=1e-5, help="cosine-difference ceiling (1e-5)")
    r.add_argument("--device", default=None, help="device for kernels (default: cuda if present, else cpu)")
    r.add_argument("--cu-count", type=int, default=256, help="CUs for computing num_kv_splits (MI355X: 256)")
    r.add_argument("--jobs", type=positive_int, default=1, help="replay captures in parallel processes")
    r.add_argument("--plot", metavar="DIR", default=None, type=output_path, help="write PNG plots to DIR")
    r.add_argument("--no-explain", action="store_true", help="skip the hypothesis search")
    r.set_defaults(func=run)


def run(args) -> int:
    opts = ReplayOptions(
        backends=args.backend or None,
        tol=Tolerance(k=args.k, ulps=args.ulps, cos=args.cos),
        device=args.device,
        cu_count=args.cu_count,
        explain=not args.no_explain,
    )
    try:
        backend_names(opts)
    except KeyError as e:
        raise UsageError(str(e.args[0])) from None
    if args.plot:
        need_matplotlib()
    paths = expand_captures(args.captures)
    reports = replay_many(paths, opts, jobs=args.jobs)
    for r in reports:  # each unusable capture: one line on stderr (exit 2); the others are still reported
        if r.verdict == "invalid":
            report_invalid(r.capture, r.error, r.metadata.errors)
    if len(reports) > 1:
        attach_series(reports)  # each report gets its findings against the previous step
    failed = _plots(reports, args.plot) if args.plot else []
    if args.json:
        print_json(reports[0] if len(reports) == 1 and single_file(args.captures) else reports)
    else:
        print("\n\n".join(render_or_say(r) for r in reports))
        if len(reports) > 1:
            print("\n" + summary_table(reports))
    for line in failed:  # after the reports: a plot that fails costs no report
        print(f"refmla: error: {line}", file=sys.stderr)
    return max(worst_status(reports), EXIT_INVALID if failed else 0)


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

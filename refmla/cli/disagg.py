"""`refmla disagg PREFILL... --decode DECODE...` (or `refmla disagg PREFILL DECODE`): one verdict per
(request, layer, rank) of a disaggregated run: transfer, metadata, compute path."""

from __future__ import annotations

import sys

from refmla.atomic import WriteError, make_dir
from refmla.backends import NAMES
from refmla.cli.common import (EXIT_INVALID, UsageError, drawable, expand_captures, need_matplotlib, print_json, unrun_exit,
                               worst_exit)
from refmla.cli.replay_flags import add_replay_flags, replay_options
from refmla.capture import CaptureError
from refmla.disagg import run_disagg
from refmla.disagg.plan import read_header
from refmla.render.disagg import render_disagg
from refmla.util import first_line


def add_parser(sub) -> None:
    d = sub.add_parser("disagg", help="prefill node's vs decode node's captures: transfer, metadata, compute")
    d.add_argument("paths", nargs="+", metavar="PREFILL",
                   help="prefill capture files or directories (exactly two paths without --decode: PREFILL DECODE)")
    d.add_argument("--decode", nargs="+", metavar="DECODE", default=None, help="decode capture files or directories")
    add_replay_flags(d, NAMES, "replay the decode captures in parallel processes")
    d.set_defaults(func=run)


def sides(args) -> tuple[list[str], list[str]]:
    if args.decode is None:
        if len(args.paths) != 2:
            raise UsageError(f"disagg: {len(args.paths)} paths given without --decode; "
                             "give PREFILL DECODE, or PREFILL... --decode DECODE...")  # fmt: skip
        return expand_captures(args.paths[:1]), expand_captures(args.paths[1:])
    return expand_captures(args.paths), expand_captures(args.decode)


def check_sides(prefill: list[str], decode: list[str]) -> None:
    """UsageError when a capture's meta disagg_mode names the other side (the arguments swapped)."""
    for side, paths in (("prefill", prefill), ("decode", decode)):
        for path in paths:
            try:
                mode = read_header(path).meta.disagg_mode
            except CaptureError:
                continue  # reported as invalid by the run, with the others still checked
            if mode in ("prefill", "decode") and mode != side:
                raise UsageError(f"{path}: meta disagg_mode is {mode!r} but it was given as the {side} side: "
                                 "the arguments are swapped? give PREFILL DECODE (or PREFILL... --decode DECODE...)")  # fmt: skip


def run(args) -> int:
    opts = replay_options(args)
    if args.plot:
        need_matplotlib()
    prefill, decode = sides(args)
    check_sides(prefill, decode)
    report = run_disagg(prefill, decode, opts, jobs=args.jobs)
    for path, error in report.invalid:  # each unusable capture: one line on stderr (exit 2)
        print(f"refmla: error: {error}", file=sys.stderr)
    failed: list[str] = []
    if args.plot:
        report.plots, failed = _plots(report, args.plot)
    if args.json:
        print_json(report)
    else:
        print(render_disagg(report))
    for line in failed:  # after the report: a plot that fails costs no report
        print(f"refmla: error: {line}", file=sys.stderr)
    return worst_exit(report.exit_code, EXIT_INVALID if failed else 0, unrun_exit(report.replays, args.backend, args.allow_skip))


def _plots(report, out_dir) -> tuple[list[str], list[str]]:
    """Draw what --plot draws (each diverged dense replay, each mismatching transfer); every row with a
    fault that gets no picture is said in one line, and a run with nothing to draw says so: the
    plots asked for are drawn or refused, never dropped. Returns (written, failure lines)."""
    from pathlib import Path

    from refmla.plots import plot_diff_kv, plot_replay  # matplotlib is optional: imported only when asked for

    try:
        make_dir(out_dir)
    except WriteError as e:  # the folder refused: one line, nothing else tried
        return [], [f"--plot {out_dir}: {first_line(e)}"]
    failed: list[str] = []
    diverged = [r for r in report.replays if r.verdict == "diverged"]
    drawn = drawable(diverged)  # the kinds it cannot draw refused, one line each
    said = {r.capture for r in diverged} - {r.capture for r in drawn}
    written: list[str] = []
    try:
        written += [str(p) for p in plot_replay(drawn, out_dir, failures=failed)]
        said |= {r.capture for r in drawn}
    except (WriteError, OSError) as e:
        failed.append(f"--plot {out_dir}: {first_line(e)}")
    for i, diff in enumerate(d for d in report.diffs if not d.ok):
        try:
            written += [str(p) for p in plot_diff_kv(diff, Path(out_dir) / f"diff-kv-{i}")]
            said.add(diff.decode)
        except (WriteError, OSError) as e:
            failed.append(f"--plot {out_dir}: {first_line(e)}")
    for path in written:
        print(f"wrote {path}", file=sys.stderr)
    unseen = [r for r in report.rows if r.fault != "none" and not said & set(r.decode_captures)]
    if unseen:
        where = ", ".join(r.where() for r in unseen[:3]) + (f" and {len(unseen) - 3} more" if len(unseen) > 3 else "")
        print(f"refmla: --plot {out_dir}: not drawn: {len(unseen)} row(s) with a fault ({where}): the plots draw a "
              "diverged dense replay or a mismatching transfer, and these rows have neither", file=sys.stderr)  # fmt: skip
    elif not written and not failed and not said:
        print(f"refmla: --plot {out_dir}: nothing drawn: every row is clean (the plots draw a diverged replay or "
              "a mismatching transfer)", file=sys.stderr)  # fmt: skip
    return written, failed

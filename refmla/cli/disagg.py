"""`refmla disagg PREFILL... --decode DECODE...` (or `refmla disagg PREFILL DECODE`): one verdict per
(request, layer, rank) of a disaggregated run: transfer, metadata, compute path."""

from __future__ import annotations

import sys

from refmla.backends import NAMES
from refmla.cli.common import (UsageError, drawable, expand_captures, need_matplotlib, print_json, unrun_exit,
                               worst_exit)
from refmla.cli.replay_flags import add_replay_flags, replay_options
from refmla.capture import CaptureError
from refmla.disagg import run_disagg
from refmla.disagg.plan import read_header
from refmla.render.disagg import render_disagg


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
    if args.plot:
        report.plots = _plots(report, args.plot)
    if args.json:
        print_json(report)
    else:
        print(render_disagg(report))
    return worst_exit(report.exit_code, unrun_exit(report.replays, args.backend, args.allow_skip))


def _plots(report, out_dir) -> list[str]:
    from pathlib import Path

    from refmla.plots import plot_diff_kv, plot_replay  # matplotlib is optional: imported only when asked for

    written = [str(p) for p in plot_replay(drawable([r for r in report.replays if r.verdict == "diverged"]), out_dir)]
    for i, diff in enumerate(d for d in report.diffs if not d.ok):
        written += [str(p) for p in plot_diff_kv(diff, Path(out_dir) / f"diff-kv-{i}")]
    for path in written:
        print(f"wrote {path}", file=sys.stderr)
    return written

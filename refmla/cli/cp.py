"""`refmla replay-cp FOLDER...`: each folder's rank captures under decode context parallelism,
grouped into steps by layer and step, each step replayed as one call (refmla.cp;
docs/context-parallel.md)."""

from __future__ import annotations

import sys

from refmla.cli.common import print_json
from refmla.cp.judge import replay_folder


def add_parser(sub) -> None:
    c = sub.add_parser("replay-cp", help="a context-parallel step (one folder of its ranks' captures) as one call")
    c.add_argument("folders", nargs="+", metavar="FOLDER", help="a folder of DCP rank captures (each layer and step replayed as one call)")
    c.add_argument("--json", action="store_true")
    c.set_defaults(func=run)


def run(args) -> int:
    reports = [r for f in args.folders for r in replay_folder(f)]
    for r in reports:
        if r.verdict == "invalid":
            print(f"refmla: error: {r.error}", file=sys.stderr)
    if args.json:
        print_json(reports[0] if len(reports) == 1 else reports)
    else:
        print("\n\n".join(r.text() for r in reports))
    return max(r.exit_code for r in reports)

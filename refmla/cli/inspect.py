"""`refmla inspect CAPTURE...`: shapes, dtypes, meta and metadata checks (several: also series checks)."""

from __future__ import annotations

from refmla.capture import read_capture
from refmla.cli.common import expand_captures, print_json, report_invalid, single_file
from refmla.capture.kinds import file_mode
from refmla.inspection import KINDS, inspect_captures, inspect_exit_code, inspect_sparse
from refmla.render.inspect import render_inspect
from refmla.series import no_series_note
from refmla.sparse.validation import is_sparse_file, read_sparse


def add_parser(sub) -> None:
    i = sub.add_parser("inspect", help="shapes, dtypes, meta and metadata checks (several: also series checks)")
    i.add_argument("captures", nargs="+", metavar="CAPTURE", help="capture files or directories")
    i.add_argument("--json", action="store_true")
    i.set_defaults(func=run)


def run(args) -> int:
    paths = expand_captures(args.captures)
    sparse = [p for p in paths if is_sparse_file(p)]
    dense = [p for p in paths if p not in sparse]
    if single_file(args.captures):
        kind = KINDS.get(file_mode(paths[0]))  # kv_write / merge: their own reader
        (read_sparse if sparse else kind[0] if kind else read_capture)(paths[0])  # one file: a bad one is exit 2 with one line
    by_path = dict(zip(dense, inspect_captures(dense)))  # several: also the series checks
    by_path.update((p, inspect_sparse(p)) for p in sparse)  # sparse decode captures (refmla.sparse)
    entries = [by_path[p] for p in paths]
    for e in entries:  # each unusable capture: one line on stderr (exit 2); the others are still reported
        if not e.metadata.ok:
            report_invalid(e.capture, e.error, e.metadata.errors)
    if args.json:
        print_json(entries[0] if len(entries) == 1 else entries)
    else:
        print("\n\n".join(render_inspect(e) for e in entries))
        note = no_series_note(sum(e.meta is not None and e.series is None for e in entries), len(entries))
        if len(entries) > 1 and note:
            print("\n" + note)
    return inspect_exit_code(entries)

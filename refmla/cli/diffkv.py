"""`refmla diff-kv PREFILL... DECODE [--json]`: transfer fidelity, prefill side vs decode side."""

from __future__ import annotations

import sys

from refmla.capture import CaptureError
from refmla.cli.common import EXIT_DIVERGED, EXIT_INVALID, EXIT_OK, need_matplotlib, output_path, print_json
from refmla.diffkv import diff_kv_files
from refmla.render.diffkv import render_diff
from refmla.util import error_text


def add_parser(sub) -> None:
    d = sub.add_parser("diff-kv", help="KV rows of the same request/position, prefill vs decode side")
    d.add_argument("prefill", nargs="+", metavar="PREFILL", help="prefill capture(s) (chunked prefill: several)")
    d.add_argument("decode", metavar="DECODE")
    d.add_argument("--json", action="store_true")
    d.add_argument("--plot", metavar="DIR", default=None, type=output_path, help="write a PNG of the mismatches to DIR")
    d.set_defaults(func=run)


def run(args) -> int:
    if args.plot:
        need_matplotlib()  # one line, exit 2, before anything is read
    try:
        result = diff_kv_files(args.prefill, args.decode)
    except Exception as e:  # --json: still one JSON document on stdout, then the one stderr line
        if args.json:
            why = str(e) if isinstance(e, CaptureError) else f"{args.decode}: {error_text(e)}"
            print_json({"ok": False, "error": why, "requests": [], "prefill": list(args.prefill),
                        "decode": args.decode})  # fmt: skip
        raise
    if args.plot:
        from refmla.plots import plot_diff_kv  # matplotlib is optional: imported only when asked for

        result.plots = [str(p) for p in plot_diff_kv(result, args.plot)]
        for path in result.plots:
            print(f"wrote {path}", file=sys.stderr)
    if args.json:
        print_json(result)
    else:
        print(render_diff(result))
    if result.error is not None:
        print(f"refmla: error: {args.decode}: {result.error}", file=sys.stderr)
        return EXIT_INVALID
    return EXIT_OK if result.ok else EXIT_DIVERGED

"""`refmla diff-kv PREFILL... DECODE [--json]`: transfer fidelity, prefill side vs decode side.

Files or folders: with a folder (or several decode captures) each decode capture is compared with
the prefill captures of its own layer and rank, one result each (the JSON an array)."""

from __future__ import annotations

import argparse
import sys

from refmla.atomic import WriteError
from refmla.capture import CaptureError
from refmla.cli.common import (EXIT_DIVERGED, EXIT_INVALID, EXIT_OK, UsageError, expand_captures, is_dir,
                               need_matplotlib, output_path, print_json, worst_exit)
from refmla.diffkv import diff_kv_files
from refmla.disagg.plan import layout_mismatch, read_header
from refmla.render.diffkv import render_diff
from refmla.util import error_text, first_line


def add_parser(sub) -> None:
    d = sub.add_parser("diff-kv", help="KV rows of the same request/position, prefill vs decode side")
    d.add_argument("prefill", nargs="+", metavar="PREFILL", help="prefill capture(s) or folders (chunked prefill: several)")
    d.add_argument("decode", metavar="DECODE", help="a decode capture, or a folder of them (each against its layer and rank)")
    d.add_argument("--json", action="store_true")
    d.add_argument("--plot", metavar="DIR", default=None, type=output_path, help="write a PNG of the mismatches to DIR")
    d.set_defaults(func=run)


def run(args) -> int:
    if args.plot:
        need_matplotlib()  # one line, exit 2, before anything is read
    if not any(is_dir(p) for p in [*args.prefill, args.decode]):
        return run_one(args)
    pairs = folder_pairs(expand_captures(args.prefill), expand_captures([args.decode]))
    codes, results = [], []
    for prefill, decode in pairs:
        one = argparse.Namespace(**{**vars(args), "prefill": prefill, "decode": decode, "json": False, "quiet": True,
                                    "_json": args.json})  # fmt: skip
        code, result = run_one(one)
        codes.append(code)
        results.append(result)
    if args.json:
        print_json(results)
    return worst_exit(*codes)


def folder_pairs(prefill: list[str], decode: list[str]) -> list[tuple[list[str], str]]:
    """Each decode capture with the prefill captures of its layer and rank (the headers' meta)."""
    headers = {p: read_header(p) for p in [*prefill, *decode]}  # a bad capture: CaptureError, one line naming it

    def key(path: str) -> tuple:
        return headers[path].layer, headers[path].rank

    by_key: dict[tuple, list[str]] = {}
    for p in prefill:
        by_key.setdefault(key(p), []).append(p)
    pairs = []
    for d in decode:
        mine = by_key.get(key(d))
        odd = layout_mismatch([headers[p] for p in prefill], [headers[d]])
        if not mine and odd:  # the layouts, not the layer, are what stops the comparison
            raise CaptureError(d, "meta key 'mode'", odd.removeprefix("meta key 'mode': "))
        if not mine:
            raise UsageError(f"{d}: no prefill capture of its layer and rank {key(d)} among {len(prefill)} given")
        pairs.append((mine, d))
    return pairs


def run_one(args):
    """One decode capture against its prefill captures; the exit code (and, for folders, the result)."""
    quiet = getattr(args, "quiet", False)
    try:
        result = diff_kv_files(args.prefill, args.decode)
    except Exception as e:  # --json: still one JSON document on stdout, then the one stderr line
        if args.json:
            why = str(e) if isinstance(e, CaptureError) else f"{args.decode}: {error_text(e)}"
            print_json({"ok": False, "error": why, "requests": [], "prefill": list(args.prefill),
                        "decode": args.decode})  # fmt: skip
        raise
    refused = None
    if args.plot:
        from refmla.plots import plot_diff_kv  # matplotlib is optional: imported only when asked for

        try:
            result.plots = [str(p) for p in plot_diff_kv(result, args.plot)]
        except (WriteError, OSError) as e:  # the target refused: said after the report, which it does not cost
            refused = f"--plot {args.plot}: {first_line(e)}"
        for path in result.plots or []:
            print(f"wrote {path}", file=sys.stderr)
    if args.json:
        print_json(result)
    elif not (quiet and getattr(args, "_json", False)):
        print(render_diff(result) + ("\n" if quiet else ""))
    code = EXIT_OK if result.ok else EXIT_DIVERGED
    if result.error is not None:
        print(f"refmla: error: {args.decode}: {result.error}", file=sys.stderr)
        code = EXIT_INVALID
    if refused is not None:
        print(f"refmla: error: {refused}", file=sys.stderr)
        code = EXIT_INVALID
    return (code, result) if quiet else code

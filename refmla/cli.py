"""The command line (CONTRACT section 2): it parses, calls plain functions, prints.

Exit codes for every command: 0 everything checked passed, 1 something diverged or
mismatched, 2 the input is invalid or unusable (one line naming the file and tensor or key).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Optional, Sequence

EXIT_OK, EXIT_DIVERGED, EXIT_INVALID = 0, 1, 2


class UsageError(Exception):
    """Bad input that is not a capture file (a path, an option): exit 2 with one line."""


def _select_interpreter() -> None:
    """Choose the Triton interpreter on a machine without a GPU, before triton compiles anything."""
    try:
        from refmla.backends.triton_interp import ensure_interpreter
    except ImportError:
        return
    ensure_interpreter()


def _print_json(obj) -> None:
    from refmla.replay import json_safe

    print(json.dumps(json_safe(obj), indent=2, allow_nan=False))


def expand_captures(paths: Sequence[str]) -> list[str]:
    """Files as given; directories -> every *.safetensors inside, sorted. Missing paths stay
    (they are reported as invalid captures)."""
    out: list[str] = []
    for p in paths:
        path = Path(p)
        if path.is_dir():
            found = sorted(str(f) for f in path.rglob("*.safetensors") if f.is_file())
            if not found:
                raise UsageError(f"{p}: directory holds no *.safetensors captures")
            out += found
        else:
            out.append(p)
    return out


# --------------------------------------------------------------------------------------------


def cmd_replay(args) -> int:
    from refmla.compare import Tolerance
    from refmla.context import ReplayOptions
    from refmla.replay import backend_names, replay_file, worst_status
    from refmla.report import Progress, render

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
        try:  # no matplotlib: say so before the replay, not after it
            import refmla.plots  # noqa: F401
        except ImportError as e:
            raise UsageError(str(e).splitlines()[0]) from None
    paths = expand_captures(args.captures)
    if getattr(args, "jobs", 1) > 1 and len(paths) > 1:
        from refmla.series import replay_parallel

        reports = replay_parallel(paths, opts, jobs=args.jobs)
    else:
        reports, progress = [], Progress(len(paths))
        for p in paths:
            reports.append(replay_file(p, opts))
            progress.step(p)
        progress.close()
    for r in reports:  # each unusable capture: one line on stderr (exit 2); the others are still reported
        if r.get("verdict") == "invalid":
            print(f"refmla: error: {r.get('error') or '; '.join(r['metadata']['errors'])}", file=sys.stderr)
    if len(reports) > 1:
        from refmla.series import attach_series

        attach_series(reports)  # each report gets "series": findings against the previous step
    if args.plot:
        _plot(reports, args.plot)
    if args.json:
        _print_json(reports[0] if len(reports) == 1 and len(args.captures) == 1 and not Path(args.captures[0]).is_dir() else reports)
    else:
        print("\n\n".join(render(r) for r in reports))
        if len(reports) > 1:
            from refmla.series import summary_table

            print("\n" + summary_table(reports))
    return worst_status(reports)


def _plot(reports, out_dir: str) -> None:
    try:
        from refmla.plots import plot_replay
    except ImportError as e:
        raise UsageError(f"--plot needs matplotlib (pip install 'refmla[plot]'): {e}") from None
    for path in plot_replay(reports, out_dir):
        print(f"wrote {path}", file=sys.stderr)


def cmd_inspect(args) -> int:
    from refmla.capture import read_capture
    from refmla.checks import inspect_captures, inspect_exit_code, render_inspect

    paths = expand_captures(args.captures)
    if len(paths) == 1 and not Path(args.captures[0]).is_dir():
        read_capture(paths[0])  # one file: a bad one is exit 2 with one line
    entries = inspect_captures(paths)  # several: also the series checks
    if args.json:
        _print_json(entries[0] if len(entries) == 1 else entries)
    else:
        print("\n\n".join(render_inspect(e) for e in entries))
    return inspect_exit_code(entries)


def cmd_synth(args) -> int:
    from refmla.synth import FAULTS, preset, synth_capture

    try:
        spec = preset(args.preset, seed=args.seed) if args.seed is not None else preset(args.preset)
    except KeyError as e:
        raise UsageError(str(e.args[0])) from None
    if args.fault not in FAULTS:
        raise UsageError(f"unknown fault {args.fault!r}; choose from {', '.join(FAULTS)}")
    try:
        planted = synth_capture(args.out, spec, args.fault)
    except ValueError as e:
        raise UsageError(f"{args.out}: {e}") from None
    print(f"wrote {args.out} (preset {spec.name}, planted {json.dumps(planted)})")
    return EXIT_OK


def cmd_doctor(args) -> int:
    from refmla.backends import NAMES, get_backend

    rows = []
    for name in NAMES:
        ok, why = get_backend(name).availability()
        rows.append({"backend": name, "usable": ok, "detail": why})
    if args.json:
        _print_json(rows)
    else:
        import platform

        import torch

        print(f"python {platform.python_version()}  torch {torch.__version__}  "
              f"gpu {'yes: ' + torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no'}  "
              f"TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '')}")  # fmt: skip
        for r in rows:
            print(f"  {r['backend']:<10} {'usable' if r['usable'] else 'unavailable':<12} {r['detail']}")
    return EXIT_OK


def cmd_diff_kv(args) -> int:
    from refmla.diffkv import diff_kv_files, render_diff

    if args.plot:
        try:  # no matplotlib: one line, exit 2, before anything is read
            from refmla.plots import plot_diff_kv
        except ImportError as e:
            raise UsageError(str(e).splitlines()[0]) from None
    result = diff_kv_files(args.prefill, args.decode)
    if args.plot:
        result.plots = [str(p) for p in plot_diff_kv(result, args.plot)]
        for path in result.plots:
            print(f"wrote {path}", file=sys.stderr)
    if args.json:
        _print_json(result.to_json())
    else:
        print(render_diff(result))
    return EXIT_OK if result.ok else EXIT_DIVERGED


def cmd_golden(args) -> int:
    from refmla.golden import generate

    manifest = generate(args.out, suite=args.suite)
    print(f"wrote {len(manifest['cases'])} golden cases to {args.out}")
    return EXIT_OK


# --------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    from refmla import __version__
    from refmla.backends import NAMES

    p = argparse.ArgumentParser(prog="refmla", description="Replay and check absorbed-MLA decode captures.")
    p.add_argument("--version", action="version", version=f"refmla {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    r = sub.add_parser("replay", help="replay captures through the backends, compare with the reference")
    r.add_argument("captures", nargs="+", metavar="CAPTURE", help="capture files or directories")
    r.add_argument("--backend", action="append", choices=NAMES, help="run only these (repeatable)")
    r.add_argument("--json", action="store_true", help="JSON report on stdout")
    r.add_argument("--k", type=float, default=2.0, help="allowed multiple of the control's error (2)")
    r.add_argument("--ulps", type=float, default=1.0, help="plus this many output-dtype ulps (1)")
    r.add_argument("--cos", type=float, default=1e-5, help="cosine-difference ceiling (1e-5)")
    r.add_argument("--device", default=None, help="device for kernels (default: cuda if present, else cpu)")
    r.add_argument("--cu-count", type=int, default=256, help="CUs for computing num_kv_splits (MI355X: 256)")
    r.add_argument("--jobs", type=int, default=1, help="replay captures in parallel processes")
    r.add_argument("--plot", metavar="DIR", default=None, help="write PNG plots to DIR")
    r.add_argument("--no-explain", action="store_true", help="skip the hypothesis search")
    r.set_defaults(func=cmd_replay)

    i = sub.add_parser("inspect", help="shapes, dtypes, meta and metadata checks (several: also series checks)")
    i.add_argument("captures", nargs="+", metavar="CAPTURE", help="capture files or directories")
    i.add_argument("--json", action="store_true")
    i.set_defaults(func=cmd_inspect)

    d = sub.add_parser("diff-kv", help="KV rows of the same request/position, prefill vs decode side")
    d.add_argument("prefill", nargs="+", metavar="PREFILL", help="prefill capture(s) (chunked prefill: several)")
    d.add_argument("decode", metavar="DECODE")
    d.add_argument("--json", action="store_true")
    d.add_argument("--plot", metavar="DIR", default=None, help="write a PNG of the mismatches to DIR")
    d.set_defaults(func=cmd_diff_kv)

    g = sub.add_parser("golden", help="golden files")
    gsub = g.add_subparsers(dest="golden_command", required=True)
    gg = gsub.add_parser("generate", help="write the golden suite")
    gg.add_argument("--out", required=True)
    gg.add_argument("--suite", choices=("quick", "full"), default="quick")
    gg.set_defaults(func=cmd_golden)

    s = sub.add_parser("synth", help="write a synthetic capture")
    s.add_argument("out")
    s.add_argument("--preset", default="kimi-k2-tp8")
    s.add_argument("--fault", default="none")
    s.add_argument("--seed", type=int, default=None)
    s.set_defaults(func=cmd_synth)

    dr = sub.add_parser("doctor", help="which backends are usable here, with versions and why not")
    dr.add_argument("--json", action="store_true")
    dr.set_defaults(func=cmd_doctor)

    try:
        from refmla.hook.cli import add_capture_parser
    except ImportError:
        pass
    else:
        add_capture_parser(sub)
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    _select_interpreter()
    from refmla.capture import CaptureError

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (CaptureError, UsageError) as e:
        print(f"refmla: error: {e}", file=sys.stderr)
        return EXIT_INVALID
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # never a traceback for the user; REFMLA_DEBUG=1 shows it
        if os.environ.get("REFMLA_DEBUG"):
            raise
        print(f"refmla: error: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''} "
              "(set REFMLA_DEBUG=1 for the traceback)", file=sys.stderr)  # fmt: skip
        return EXIT_INVALID


if __name__ == "__main__":
    sys.exit(main())

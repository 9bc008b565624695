"""`refmla sweep [--backend NAME]... [--budget S] [--seed N] [--out DIR] [--json] [--jobs N] [--repeat N]
[--layout L]... [--space AXIS=V1,V2]... [--check NAME]... [--max-shrink N] [--allow-skip]
[--sizes cpu|gpu|production] [--max-length N] [--max-batch N] [--max-rows N] ...`: every backend over
the production shape space (refmla.sweep); exit 0 nothing found, 1 a finding, 2 bad flags, 3 a
backend named with --backend did not run on a layout it reads."""

from __future__ import annotations

import argparse
import sys

from refmla.backends.named import Choices
from refmla.cli.common import EXIT_OK, UsageError, output_path, print_json
from refmla.util import first_line, printable
from refmla.render.sweep import render_sweep
from refmla.sweep import CHECKS, LAYOUTS, SweepConfig, run_sweep
from refmla.sweep.bounds import OVERRIDES, PROFILES_ORDER
from refmla.sweep.kernels import LAYOUT_BACKENDS, NAMES, default_backends, layout_backends

DEFAULT_BACKENDS = default_backends(LAYOUTS)  # each layout's own kernels (refmla.sweep.kernels)


def _positive(kind):
    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not v > 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return v

    return parse


def add_parser(sub) -> None:
    p = sub.add_parser("sweep", help="check backends over the production shape space (four checks, shrunk captures)")
    p.add_argument("--backend", action="append", choices=Choices(NAMES), metavar="NAME",
                   help="backend to sweep on every walked layout it reads (repeatable; default each layout's own: "
                        + "; ".join(f"{la} {' '.join(b)}" for la, b in LAYOUT_BACKENDS.items())
                        + "; or your kernel as module:function, docs/own-kernel.md)")
    p.add_argument("--budget", type=_positive(float), default=60.0, help="seconds of walking (default 60)")
    p.add_argument("--seed", type=int, default=0, help="the walk's seed: the same seed, the same cases")
    p.add_argument("--out", type=output_path, default="refmla-sweep", help="where shrunk captures go (default refmla-sweep)")
    p.add_argument("--json", action="store_true", help="the report as JSON on stdout")
    p.add_argument("--jobs", type=_positive(int), default=1, help="cases in this many worker processes")
    p.add_argument("--repeat", type=_positive(int), default=3, help="runs compared bit for bit (default 3, at least 2)")
    p.add_argument("--layout", action="append", choices=tuple(LAYOUTS), help="layout to walk (repeatable; default all)")
    p.add_argument("--space", action="append", default=[], metavar="AXIS=V1,V2",
                   help="keep only these values of an axis (repeatable), e.g. heads=32,16")
    p.add_argument("--check", action="append", choices=CHECKS, help="check to run (repeatable; default all four)")
    p.add_argument("--sizes", choices=PROFILES_ORDER,
                   help="the size bounds walked: cpu (the Triton interpreter's), gpu (production sizes within the "
                        "device's memory), production (whatever the device holds); default cpu under the "
                        "interpreter, gpu on a GPU")
    for bound in OVERRIDES:
        p.add_argument(f"--max-{bound.replace('_', '-')}", dest=f"max_{bound}", type=_positive(int), metavar="N",
                       help=f"override the profile's {bound.replace('_', ' ')} bound")
    p.add_argument("--allow-skip", action="store_true",
                   help="a backend named with --backend that does not run on a layout it reads is not a failure "
                        "(default: exit 3)")
    p.add_argument("--max-shrink", type=int, default=24, help="runs spent shrinking each finding (default 24)")
    p.set_defaults(func=sweep)


def sweep(args) -> int:
    layouts = tuple(dict.fromkeys(args.layout or LAYOUTS))
    cfg = SweepConfig(
        backends=args.backend or default_backends(layouts), budget=args.budget, seed=args.seed, out=args.out,
        jobs=args.jobs, repeat=args.repeat, layouts=layouts, space=args.space, checks=args.check or CHECKS,
        max_shrink=args.max_shrink, per_layout=None if args.backend else layout_backends(), allow_skip=args.allow_skip,
        sizes=args.sizes, limits={b: getattr(args, f"max_{b}") for b in OVERRIDES if getattr(args, f"max_{b}") is not None},
    )  # fmt: skip
    try:
        cfg.check()
    except ValueError as e:
        raise UsageError(str(e)) from None
    report = run_sweep(cfg)
    if args.json:
        print_json(report.to_json())
    else:
        print(render_sweep(report))
    for name, layout, why in [] if report.allow_skip else report.not_run:
        print(printable(f"refmla: error: sweep: backend {name} was asked for and did not run on {layout} "
                        f"({first_line(why)}); --allow-skip accepts that"), file=sys.stderr)  # fmt: skip
    return report.exit_code if report.exit_code else EXIT_OK

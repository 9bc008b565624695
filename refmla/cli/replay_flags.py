"""The flags of every command that replays (``replay``, ``disagg``), their validation, and the
:class:`~refmla.options.ReplayOptions` they make: one parser, so no command can lose a check.

Every numeric flag is bounded by refmla.options.BOUNDS (what the arithmetic supports); a value
outside them, NaN or Inf is a usage error: exit 2, one line naming the flag.
"""

from __future__ import annotations

import argparse
from typing import Callable, Sequence

from refmla.backends.named import Choices
from refmla.cli.common import UsageError, output_path
from refmla.compare import Tolerance
from refmla.options import ReplayOptions, bound_problem
from refmla.pipeline import backend_names


def bounded(name: str, kind: type) -> Callable[[str], float]:
    """argparse type: a ``kind`` (int or float) within refmla.options.BOUNDS[name]."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        problem = bound_problem(name, value)
        if problem:
            raise argparse.ArgumentTypeError(problem)
        return value

    parse.__name__ = name  # argparse names the type in its messages
    return parse


def add_replay_flags(p: argparse.ArgumentParser, backends: Sequence[str], jobs_help: str) -> None:
    """--backend, --json, --k, --ulps, --cos, --device, --cu-count, --jobs, --plot, --no-explain, --allow-skip,
    --repeat."""
    p.add_argument("--backend", action="append", choices=Choices(backends), metavar="NAME",
                   help=f"replay only these backends (repeatable; flex runs only when named): {', '.join(backends)}; "
                        "or your kernel as module:function or file.py:function (docs/own-kernel.md)")  # fmt: skip
    p.add_argument("--json", action="store_true", help="JSON report on stdout")
    p.add_argument("--k", type=bounded("k", float), default=2.0, help="allowed multiple of the control's error (2)")
    p.add_argument("--ulps", type=bounded("ulps", float), default=1.0, help="plus this many output-dtype ulps (1)")
    p.add_argument("--cos", type=bounded("cos", float), default=1e-5, help="cosine-difference ceiling (1e-5)")
    p.add_argument("--device", default=None, help="device for kernels (default: cuda if present, else cpu)")
    p.add_argument("--cu-count", type=bounded("cu_count", int), default=256,
                   help="CUs for computing num_kv_splits (MI355X: 256)")  # fmt: skip
    p.add_argument("--jobs", type=bounded("jobs", int), default=1, help=jobs_help)
    p.add_argument("--plot", metavar="DIR", default=None, type=output_path, help="write PNG plots to DIR")
    p.add_argument("--no-explain", action="store_true", help="skip the hypothesis search")
    p.add_argument("--allow-skip", action="store_true",
                   help="a backend named with --backend that does not run here is not a failure (default: exit 3)")  # fmt: skip
    p.add_argument("--repeat", type=bounded("repeat", int), default=1, metavar="N",
                   help="run each kernel backend N times on the same inputs, bitwise compared (1)")  # fmt: skip


def replay_options(args: argparse.Namespace) -> ReplayOptions:
    """The options the flags ask for; UsageError for a combination no single flag's check catches."""
    opts = ReplayOptions(
        backends=args.backend or None,
        tol=Tolerance(k=args.k, ulps=args.ulps, cos=args.cos),
        device=args.device,
        cu_count=args.cu_count,
        explain=not args.no_explain,
        repeat=args.repeat,
    )
    try:
        opts.check()
        backend_names(opts)
    except (KeyError, ValueError) as e:
        raise UsageError(str(e.args[0])) from None
    return opts


__all__ = ["add_replay_flags", "bounded", "replay_options"]

"""The small commands: `synth` (a synthetic capture), `doctor` (backends usable here), `golden generate`."""

from __future__ import annotations

import json
import os
import platform

import torch

from refmla.backends import ALL_NAMES, get_backend
from refmla.backends.engines import KERNELS, package_versions
from refmla.cli.common import EXIT_OK, UsageError, print_json
from refmla.golden import generate
from refmla.synth import FAULTS, preset, synth_capture
from refmla.synth.disagg import DISAGG_PRESETS, disagg_preset, synth_disagg
from refmla.synth.disagg_faults import DISAGG_FAULTS


def add_parsers(sub) -> None:
    s = sub.add_parser("synth", help="write a synthetic capture")
    s.add_argument("out")
    s.add_argument("--preset", default="kimi-k2-tp8")
    s.add_argument("--fault", default="none")
    s.add_argument("--seed", type=int, default=None)
    s.set_defaults(func=synth)

    sd = sub.add_parser("synth-disagg", help="write a synthetic prefill/decode pair (OUT/prefill, OUT/decode)")
    sd.add_argument("out")
    sd.add_argument("--preset", default="disagg", choices=list(DISAGG_PRESETS))
    sd.add_argument("--fault", default="none", choices=list(DISAGG_FAULTS))
    sd.add_argument("--seed", type=int, default=None)
    sd.set_defaults(func=synth_disagg_cmd)

    dr = sub.add_parser("doctor", help="which backends are usable here, with versions and why not")
    dr.add_argument("--json", action="store_true")
    dr.set_defaults(func=doctor)

    g = sub.add_parser("golden", help="golden files")
    gsub = g.add_subparsers(dest="golden_command", required=True)
    gg = gsub.add_parser("generate", help="write the golden suite")
    gg.add_argument("--out", required=True)
    gg.add_argument("--suite", choices=("quick", "full"), default="quick")
    gg.set_defaults(func=golden_generate)


def synth(args) -> int:
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


def synth_disagg_cmd(args) -> int:
    spec = disagg_preset(args.preset)
    if args.seed is not None:
        import dataclasses

        spec = dataclasses.replace(spec, base=dataclasses.replace(spec.base, seed=args.seed))
    planted = synth_disagg(args.out, spec, args.fault)
    print(f"wrote {args.out}/prefill and {args.out}/decode (preset {spec.name}, planted {json.dumps(planted)})")
    return EXIT_OK


def doctor(args) -> int:
    rows = []
    for name in ALL_NAMES:
        ok, why = get_backend(name).availability()
        of = KERNELS.get(name)
        rows.append({"backend": name, "usable": ok, "detail": why, "engine": of.engine if of else None,
                     "kernel": of.kernel if of else None})  # fmt: skip
    if args.json:
        print_json(rows)
        return EXIT_OK
    gpu = "yes: " + torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no"
    print(f"python {platform.python_version()}  torch {torch.__version__}  gpu {gpu}  "
          f"TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '')}")  # fmt: skip
    print("engines and kernel packages: " + ", ".join(f"{k} {v}" for k, v in package_versions().items()))
    width = max(len(r["backend"]) for r in rows)
    for r in rows:
        print(f"  {r['backend']:<{width}} {'usable' if r['usable'] else 'unavailable':<12} "
              f"[{r['engine']}: {r['kernel']}] {r['detail']}")  # fmt: skip
    return EXIT_OK


def golden_generate(args) -> int:
    manifest = generate(args.out, suite=args.suite)
    print(f"wrote {len(manifest['cases'])} golden cases to {args.out}")
    return EXIT_OK

"""`refmla synth OUT` (a synthetic capture) and `refmla synth-disagg OUT` (a synthetic prefill/decode pair)."""

from __future__ import annotations

import json

from refmla.cli.common import EXIT_OK, UsageError, output_path
from refmla.cli.sparse import synth_sparse_cmd
from refmla.kvwrite.synth import PRESETS as KV_WRITE_PRESETS
from refmla.kvwrite.synth import synth_kv_write
from refmla.merge.synth import PRESETS as MERGE_PRESETS
from refmla.merge.synth import synth_merge
from refmla.sparse.presets import PRESETS as SPARSE_PRESETS
from refmla.synth import FAULTS, preset, synth_capture
from refmla.synth.disagg import DISAGG_PRESETS, disagg_preset, synth_disagg
from refmla.synth.disagg_faults import DISAGG_FAULTS


def add_parser(sub) -> None:
    s = sub.add_parser("synth", help="write a synthetic capture")
    s.add_argument("out", type=output_path)
    s.add_argument("--preset", default="kimi-k2-tp8")
    s.add_argument("--fault", default="none")
    s.add_argument("--seed", type=int, default=None)
    s.add_argument("--layer", type=int, default=None, metavar="N",
                   help="DeepSeek-V4 presets: layer N of the model, its compress ratio from the model's per-layer list")
    s.set_defaults(func=synth)

    sd = sub.add_parser("synth-disagg", help="write a synthetic prefill/decode pair (OUT/prefill, OUT/decode)")
    sd.add_argument("out", type=output_path)
    sd.add_argument("--preset", default="disagg", choices=list(DISAGG_PRESETS))
    sd.add_argument("--fault", default="none", choices=list(DISAGG_FAULTS))
    sd.add_argument("--seed", type=int, default=None)
    sd.set_defaults(func=synth_disagg_cmd)


def synth(args) -> int:
    if args.preset in SPARSE_PRESETS:
        return synth_sparse_cmd(args)
    if args.preset in KV_WRITE_PRESETS or args.preset in MERGE_PRESETS:
        return synth_kind(args)
    if args.layer is not None:
        raise UsageError(f"--layer applies to the sparse presets ({', '.join(SPARSE_PRESETS)}), not {args.preset!r}")
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


def synth_kind(args) -> int:
    """A kv_write or merge preset (refmla.kvwrite.synth, refmla.merge.synth)."""
    make = synth_kv_write if args.preset in KV_WRITE_PRESETS else synth_merge
    if args.layer is not None:
        raise UsageError(f"--layer does not apply to {args.preset!r}")
    try:
        planted = make(args.out, args.preset, args.fault, seed=args.seed or 0)
    except ValueError as e:
        raise UsageError(f"{args.out}: {e}") from None
    print(f"wrote {args.out} (preset {args.preset}, planted {json.dumps(planted)})")
    return EXIT_OK


def synth_disagg_cmd(args) -> int:
    spec = disagg_preset(args.preset)
    if args.seed is not None:
        import dataclasses

        spec = dataclasses.replace(spec, base=dataclasses.replace(spec.base, seed=args.seed))
    planted = synth_disagg(args.out, spec, args.fault)
    print(f"wrote {args.out}/prefill and {args.out}/decode (preset {spec.name}, planted {json.dumps(planted)})")
    return EXIT_OK


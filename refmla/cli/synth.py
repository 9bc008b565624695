"""`refmla synth OUT` (a synthetic capture) and `refmla synth-disagg OUT` (a synthetic prefill/decode pair)."""

from __future__ import annotations

import json

import argparse

from refmla.api import ALL_PRESETS, synth as synth_api
from refmla.capture import CaptureError
from refmla.cli.common import EXIT_OK, UsageError, output_path
from refmla.sparse.faults import FAULTS as SPARSE_FAULTS
from refmla.kvwrite.synth import PRESETS as KV_WRITE_PRESETS
from refmla.kvwrite.synth import synth_kv_write
from refmla.merge.chunked_synth import PRESETS as CHUNKED_PRESETS
from refmla.merge.chunked_synth import synth_chunked
from refmla.merge.synth import PRESETS as MERGE_PRESETS
from refmla.merge.synth import synth_merge
from refmla.sparse.presets import PRESETS as SPARSE_PRESETS
from refmla.synth import FAULTS
from refmla.synth.disagg import DISAGG_PRESETS, disagg_preset, synth_disagg
from refmla.synth.disagg_faults import DISAGG_FAULTS
from refmla.synth.disagg_sparse import SPARSE_DISAGG_FAULTS, SPARSE_DISAGG_PRESETS, sparse_disagg_preset, synth_sparse_disagg


def add_parser(sub) -> None:
    s = sub.add_parser("synth", help="write a synthetic capture", formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog=f"presets: {', '.join(ALL_PRESETS)}\n\nfaults (dense presets): {', '.join(FAULTS)}\n\n"
                       f"faults (sparse presets {', '.join(SPARSE_PRESETS)}): none, {', '.join(SPARSE_FAULTS)}\n\n"
                       f"KV writer / merge / chunked-prefill presets: {', '.join([*KV_WRITE_PRESETS, *MERGE_PRESETS, *CHUNKED_PRESETS])}")  # fmt: skip
    s.add_argument("out", type=output_path)
    s.add_argument("--preset", default="kimi-k2-tp8", metavar="PRESET", help="one of the presets below (kimi-k2-tp8)")
    s.add_argument("--fault", default="none", metavar="FAULT", help="a fault to plant, listed below (none)")
    s.add_argument("--seed", type=int, default=None)
    s.add_argument("--layer", type=int, default=None, metavar="N",
                   help="DeepSeek-V4 presets: layer N of the model, its compress ratio from the model's per-layer list")
    s.set_defaults(func=synth)

    sd = sub.add_parser("synth-disagg", help="write a synthetic prefill/decode pair (OUT/prefill, OUT/decode)",
                        formatter_class=argparse.RawDescriptionHelpFormatter,
                        epilog=f"faults (dense presets {', '.join(DISAGG_PRESETS)}): {', '.join(DISAGG_FAULTS)}\n\n"
                        f"faults (sparse presets {', '.join(SPARSE_DISAGG_PRESETS)}: DeepSeek-V4 window + compressed "
                        f"caches, V3.2): {', '.join(SPARSE_DISAGG_FAULTS)}")  # fmt: skip
    sd.add_argument("out", type=output_path)
    sd.add_argument("--preset", default="disagg", choices=[*DISAGG_PRESETS, *SPARSE_DISAGG_PRESETS])
    sd.add_argument("--fault", default="none", choices=list(dict.fromkeys([*DISAGG_FAULTS, *SPARSE_DISAGG_FAULTS])))
    sd.add_argument("--seed", type=int, default=None)
    sd.set_defaults(func=synth_disagg_cmd)


def synth(args) -> int:
    """The CLI of refmla.api.synth (dense and sparse presets; the KV writer and merge kinds)."""
    if args.preset in KV_WRITE_PRESETS or args.preset in MERGE_PRESETS or args.preset in CHUNKED_PRESETS:
        return synth_kind(args)
    try:
        planted = synth_api(args.out, args.preset, args.fault, args.seed, layer=args.layer)
    except (ValueError, KeyError, CaptureError) as e:
        text = str(e.args[0]) if isinstance(e, KeyError) else str(e)
        raise UsageError(text if text.startswith(("unknown", "layer")) else f"{args.out}: {text}") from None
    layer = "" if args.layer is None else f" layer {args.layer}"
    print(f"wrote {args.out} (preset {args.preset}{layer}, planted {json.dumps(planted)})")
    return EXIT_OK


def synth_kind(args) -> int:
    """A kv_write, merge or chunked-prefill preset (refmla.kvwrite.synth, refmla.merge.synth, .chunked_synth)."""
    make = synth_kv_write if args.preset in KV_WRITE_PRESETS else synth_chunked if args.preset in CHUNKED_PRESETS else synth_merge
    if args.layer is not None:
        raise UsageError(f"--layer does not apply to {args.preset!r}")
    try:
        planted = make(args.out, args.preset, args.fault, seed=args.seed or 0)
    except ValueError as e:
        raise UsageError(f"{args.out}: {e}") from None
    print(f"wrote {args.out} (preset {args.preset}, planted {json.dumps(planted)})")
    return EXIT_OK


def synth_disagg_cmd(args) -> int:
    if args.preset in SPARSE_DISAGG_PRESETS:
        return _synth_sparse_disagg(args)
    if args.fault not in DISAGG_FAULTS:
        raise UsageError(f"fault {args.fault!r} is a sparse preset's ({', '.join(SPARSE_DISAGG_PRESETS)}); "
                         f"preset {args.preset} takes {', '.join(DISAGG_FAULTS)}")  # fmt: skip
    spec = disagg_preset(args.preset)
    if args.seed is not None:
        import dataclasses

        spec = dataclasses.replace(spec, base=dataclasses.replace(spec.base, seed=args.seed))
    planted = synth_disagg(args.out, spec, args.fault)
    print(f"wrote {args.out}/prefill and {args.out}/decode (preset {spec.name}, planted {json.dumps(planted)})")
    return EXIT_OK



def _synth_sparse_disagg(args) -> int:
    """A sparse pair (refmla.synth.disagg_sparse): DeepSeek-V4's window and compressed caches, or V3.2's."""
    if args.fault not in SPARSE_DISAGG_FAULTS:
        raise UsageError(f"fault {args.fault!r} is a dense preset's; preset {args.preset} takes "
                         f"{', '.join(SPARSE_DISAGG_FAULTS)}")  # fmt: skip
    spec = sparse_disagg_preset(args.preset, **({"seed": args.seed} if args.seed is not None else {}))
    try:
        planted = synth_sparse_disagg(args.out, spec, args.fault)
    except ValueError as e:
        raise UsageError(str(e)) from None
    print(f"wrote {args.out}/prefill and {args.out}/decode (preset {spec.name}, planted {json.dumps(planted)})")
    return EXIT_OK

"""`refmla synth OUT` (a synthetic capture) and `refmla synth-disagg OUT` (a synthetic prefill/decode pair)."""

from __future__ import annotations

import json

import argparse

from refmla.api import synth as synth_api
from refmla.capture import CaptureError
from refmla.cli.common import EXIT_OK, UsageError, output_path
from refmla.sparse.faults import FAULTS as SPARSE_FAULTS
from refmla.kvwrite.packed_synth import FAULTS as PACKED_FAULTS
from refmla.kvwrite.packed_synth import PRESETS as PACKED_PRESETS
from refmla.kvwrite.synth import FAULTS as KV_WRITE_FAULTS
from refmla.kvwrite.synth import ROW_PRESETS as KV_WRITE_PRESETS
from refmla.indexer.synth import FAULTS as INDEXER_FAULTS
from refmla.indexer.synth import PRESETS as INDEXER_PRESETS
from refmla.merge.chunked_synth import FAULTS as CHUNKED_FAULTS
from refmla.merge.chunked_synth import PRESETS as CHUNKED_PRESETS
from refmla.merge.synth import FAULTS as MERGE_FAULTS
from refmla.merge.synth import PRESETS as MERGE_PRESETS
from refmla.sparse.presets import PRESETS as SPARSE_PRESETS
from refmla.synthetic import FAULTS, PRESETS
from refmla.synthetic.dcp import FAULTS as DCP_FAULTS
from refmla.synthetic.dcp import PRESETS as DCP_PRESETS
from refmla.synthetic.disagg import DISAGG_PRESETS, disagg_preset, synth_disagg
from refmla.synthetic.disagg_faults import DISAGG_FAULTS
from refmla.synthetic.disagg_sparse import SPARSE_DISAGG_FAULTS, SPARSE_DISAGG_PRESETS, sparse_disagg_preset, synth_sparse_disagg
from refmla.synthetic.reload import RELOAD_FAULTS, RELOAD_PRESETS, reload_preset, synth_reload


def _kinds(*kinds: tuple[str, dict, tuple]) -> str:
    """The help's lines: per kind, its presets and the faults they take."""
    return "\n\n".join(f"{what} presets {', '.join(presets)}: faults {', '.join(f for f in faults if f != 'none')}"
                       for what, presets, faults in kinds)  # fmt: skip


def add_parser(sub) -> None:
    kinds = _kinds(("dense / verify", PRESETS, FAULTS), ("sparse decode", SPARSE_PRESETS, SPARSE_FAULTS),
                   ("KV writer", KV_WRITE_PRESETS, KV_WRITE_FAULTS),
                   ("packed KV writer", PACKED_PRESETS, PACKED_FAULTS), ("merge", MERGE_PRESETS, MERGE_FAULTS),
                   ("chunked-prefill", CHUNKED_PRESETS, CHUNKED_FAULTS), ("indexer", INDEXER_PRESETS, INDEXER_FAULTS),
                   ("decode-context-parallel step (OUT is a folder of rank captures)", DCP_PRESETS, DCP_FAULTS))  # fmt: skip
    s = sub.add_parser("synth", help="write a synthetic capture", formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog=f"{kinds}\n\n(every preset also takes --fault none)")  # fmt: skip
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
                        f"caches, V3.2): {', '.join(SPARSE_DISAGG_FAULTS)}\n\n"
                        f"faults (KV reloaded from a host tier, presets {', '.join(RELOAD_PRESETS)}; diff-kv "
                        f"OUT/prefill OUT/decode): {', '.join(RELOAD_FAULTS)}")  # fmt: skip
    sd.add_argument("out", type=output_path)
    sd.add_argument("--preset", default="disagg", choices=[*DISAGG_PRESETS, *SPARSE_DISAGG_PRESETS, *RELOAD_PRESETS])
    sd.add_argument("--fault", default="none", choices=list(dict.fromkeys([*DISAGG_FAULTS, *SPARSE_DISAGG_FAULTS, *RELOAD_FAULTS])))
    sd.add_argument("--seed", type=int, default=None)
    sd.set_defaults(func=synth_disagg_cmd)


def synth(args) -> int:
    """The CLI of refmla.api.synth (every kind: dense, verify, sparse, KV writer, merge, chunked prefill)."""
    try:
        planted = synth_api(args.out, args.preset, args.fault, args.seed, layer=args.layer)
    except (ValueError, KeyError, CaptureError) as e:
        text = str(e.args[0]) if isinstance(e, KeyError) else str(e)
        raise UsageError(text if text.startswith(("unknown", "layer")) else f"{args.out}: {text}") from None
    layer = "" if args.layer is None else f" layer {args.layer}"
    print(f"wrote {args.out} (preset {args.preset}{layer}, planted {json.dumps(planted)})")
    return EXIT_OK


def synth_disagg_cmd(args) -> int:
    if args.preset in SPARSE_DISAGG_PRESETS:
        return _synth_sparse_disagg(args)
    if args.preset in RELOAD_PRESETS:
        return _synth_reload(args)
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



def _synth_reload(args) -> int:
    """A prefix reloaded from a host tier under another rid (refmla.synthetic.reload): diff-kv pairs it by tokens."""
    if args.fault not in RELOAD_FAULTS:
        raise UsageError(f"fault {args.fault!r} is not a reload fault; preset {args.preset} takes {', '.join(RELOAD_FAULTS)}")
    spec = reload_preset(args.preset, **({"seed": args.seed} if args.seed is not None else {}))
    planted = synth_reload(args.out, spec, args.fault)
    print(f"wrote {args.out}/prefill and {args.out}/decode (preset {spec.name}, planted {json.dumps(planted)})")
    return EXIT_OK


def _synth_sparse_disagg(args) -> int:
    """A sparse pair (refmla.synthetic.disagg_sparse): DeepSeek-V4's window and compressed caches, or V3.2's."""
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

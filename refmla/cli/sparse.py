"""The sparse decode part of `refmla synth` (a sparse preset); `refmla replay` replays sparse
captures with every other kind (refmla.replay)."""

from __future__ import annotations

import json
import sys

from refmla.capture import CaptureError
from refmla.cli.common import EXIT_INVALID, EXIT_OK
from refmla.sparse.make import synth_sparse


def synth_sparse_cmd(args) -> int:
    try:
        planted = synth_sparse(args.out, args.preset, args.fault, args.seed, layer=args.layer)
    except (ValueError, CaptureError) as e:
        print(f"refmla: error: {args.out}: {e}", file=sys.stderr)
        return EXIT_INVALID
    layer = "" if args.layer is None else f" layer {args.layer}"
    print(f"wrote {args.out} (preset {args.preset}{layer}, planted {json.dumps(planted)})")
    return EXIT_OK


__all__ = ["synth_sparse_cmd"]

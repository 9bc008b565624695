"""`refmla regions [CAPTURE] | --model NAME | --config config.json --tokens N`: every registered KV
buffer's size and band (SGLang's clamp, MORI's measured sizes; refmla.api.regions)."""

from __future__ import annotations

from refmla.api import TRANSFER_BACKENDS, regions
from refmla.cli.common import EXIT_DIVERGED, EXIT_OK, UsageError, print_json
from refmla.poolplan import KV_DTYPES, MODELS
from refmla.render.regions import render_regions


def add_parser(sub) -> None:
    r = sub.add_parser("regions", help="will the KV pool's buffers register as RDMA regions (MORI)? before a server starts",
                       description="Every KV buffer the pool registers, its size, and per buffer: under SGLang's clamp "
                       "(SGLANG_MORI_MAX_MR_BYTES, default 2 GiB), over it but at most the largest size measured to "
                       "register, unmeasured, or at / past the smallest size measured to fail (exit 1).")  # fmt: skip
    r.add_argument("capture", nargs="?", metavar="CAPTURE", help="a capture whose meta records the pool")
    r.add_argument("--model", choices=list(MODELS), help="a model's pool geometry")
    r.add_argument("--config", metavar="config.json", help="a Hugging Face config.json (DeepSeek-V3/V3.2/V4, Kimi-K2)")
    r.add_argument("--tokens", type=int, metavar="N", help="max_total_num_tokens of the pool")
    r.add_argument("--page-size", type=int, default=None, help="SGLang's page size (default: the model's, V4 256, else 64)")
    r.add_argument("--kv-dtype", choices=list(KV_DTYPES), default="bf16", help="KV cache dtype (bf16)")
    r.add_argument("--tp", type=int, default=1, help="tensor parallel size (MLA's KV is replicated: sizes per rank)")
    r.add_argument("--transfer-backend", choices=list(TRANSFER_BACKENDS), default="mori",
                   help="the measured sizes are MORI's; another backend's buffers are unmeasured")  # fmt: skip
    r.add_argument("--clamp-bytes", type=int, default=None, metavar="N",
                   help="SGLang's clamp SGLANG_MORI_MAX_MR_BYTES (default: the environment's, else 2 GiB)")  # fmt: skip
    r.add_argument("--json", action="store_true")
    r.set_defaults(func=run)


def run(args) -> int:
    if args.clamp_bytes is not None and args.clamp_bytes < 1:
        raise UsageError(f"--clamp-bytes {args.clamp_bytes}: must be >= 1")
    try:
        check = regions(args.capture, model=args.model, config=args.config, tokens=args.tokens,
                        page_size=args.page_size, kv_dtype=args.kv_dtype, tp=args.tp,
                        transfer_backend=args.transfer_backend, clamp=args.clamp_bytes)  # fmt: skip
    except ValueError as e:  # a bad capture is a CaptureError: the CLI's one line naming the file
        raise UsageError(str(e)) from None
    if args.json:
        print_json(check)
    else:
        print(render_regions(check))
    return EXIT_DIVERGED if check.is_finding else EXIT_OK

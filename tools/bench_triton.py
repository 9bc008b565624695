"""Benchmark: the triton backend's trimmed run vs the kernel called with production-sized buffers.

    python tools/bench_triton.py [--requests 8] [--heads 8] [--seq-len 1300] [--max-kv-splits 256]
                                 [--cu-count 256] [--page-size 1] [--dtype bf16] [--repeat 1]

A realistic Kimi-K2 TP8 decode step (issue 3): 8 requests x 1300 tokens, 8 query heads per rank,
bf16, max_kv_splits 256 as on MI355X, num_kv_splits as SGLang's backend computes them for 256 CUs
(130 per request, of which ceil(1300 / 32) = 41 hold tokens). Both runs call SGLang's own
``decode_attention_fwd`` through ``refmla.backends.triton.run_triton_decode``; only the size of
the split buffers differs:

    production  attn_logits [B, H, 256, Dv]: stage-1 grid B x 1 x 256, stage 2 loops 256 splits
    trimmed     attn_logits [B, H,  41, Dv]: stage-1 grid B x 1 x 41,  stage 2 loops 41 splits

and the outputs must agree bit for bit. On CPU this runs in the Triton interpreter, where every
(empty) program costs Python time; on a GPU the same comparison times the compiled kernel.

Work per step, the same for both (the empty splits do none):
    FLOPs  = 2 * B * H * L * D (q.k) + 2 * B * H * L * Dv (p.v)
    bytes  = B * L * D * 2 (latent rows read once per head tile, bf16) + B * H * S * (Dv + 1) * 4
             (partials written and read back, fp32: this is the term trimming shrinks)
Time: best of --repeat runs each, alternating, in one process; wall clock and this process's CPU
time. On CPU the ratio is taken on CPU time, which other load on a shared machine does not skew.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from refmla.backends import triton_interp  # noqa: E402

triton_interp.ensure_interpreter()  # before triton is imported anywhere

import torch  # noqa: E402

from refmla import schedule  # noqa: E402
from refmla.backends import triton as tb  # noqa: E402
from refmla.scales import Scales  # noqa: E402
from refmla.synthetic import KIMI_K2_SCALE, SynthSpec, make_inputs  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=1300)
    ap.add_argument("--max-kv-splits", type=int, default=256)
    ap.add_argument("--cu-count", type=int, default=schedule.MI355X_CU_COUNT)
    ap.add_argument("--page-size", type=int, default=1)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--repeat", type=int, default=1)
    args = ap.parse_args()

    B, H, L = args.requests, args.heads, args.seq_len
    lens = torch.full((B,), L, dtype=torch.int32)
    splits = schedule.default_num_kv_splits(lens, max_kv_splits=args.max_kv_splits, num_heads=H, cu_count=args.cu_count)
    filled = int(schedule.nonempty_splits_batch(lens, splits).max())
    spec = SynthSpec(
        name="kimi-k2-tp8-bench", num_heads=H, seq_lens=(L,) * B, page_size=args.page_size,
        dtype=DTYPES[args.dtype], sm_scale=KIMI_K2_SCALE, num_kv_splits=tuple(splits.tolist()),
        max_kv_splits=args.max_kv_splits, free_pages=1,
    )  # fmt: skip
    t = make_inputs(spec)
    device = "cpu" if triton_interp.interpreter_active() else "cuda"

    def run(trim: bool):
        w0, c0 = time.perf_counter(), time.process_time()
        out, _, _, info = tb.run_triton_decode(
            t["q"].to(device), t["kv_buffer"].to(device), t["kv_indptr"], t["kv_indices"], t["num_kv_splits"],
            Scales(spec.kv_lora_rank, spec.sm_scale),
            tb.TritonLaunch(page_size=spec.page_size, max_kv_splits=spec.max_kv_splits, trim=trim),
        )  # fmt: skip
        return time.perf_counter() - w0, time.process_time() - c0, out, info

    names = ("production", "trimmed")
    wall, cpu = dict.fromkeys(names, float("inf")), dict.fromkeys(names, float("inf"))
    outs, infos = {}, {}
    for _ in range(max(args.repeat, 1)):
        for name, trim in (("production", False), ("trimmed", True)):
            w, c, outs[name], infos[name] = run(trim)
            wall[name], cpu[name] = min(wall[name], w), min(cpu[name], c)

    D, Dv = spec.head_dim, spec.kv_lora_rank
    flops = 2 * B * H * L * D + 2 * B * H * L * Dv
    info = infos["trimmed"]
    where = "Triton interpreter (CPU)" if info["interpreter"] else f"compiled on {info['device']}"
    print(f"sglang {info['sglang_version']} {info['kernel']}, triton {info['triton_version']}, {where}")
    print(f"step: {B} requests x {L} tokens, {H} heads, {args.dtype}, page_size {args.page_size}, num_kv_splits "
          f"{sorted(set(splits.tolist()))} (cu_count {args.cu_count}), {filled} non-empty splits")  # fmt: skip
    for name in names:
        S = infos[name]["splits_used"]
        partial_bytes = B * H * S * (Dv + 1) * 4
        print(f"  {name:<10}  S = {S:>3}  wall {wall[name]:8.3f} s  cpu {cpu[name]:8.3f} s  "
              f"({flops / wall[name] / 1e9:.3f} GFLOP/s, partials {partial_bytes / 2**20:.1f} MiB)")  # fmt: skip
    same = torch.equal(outs["production"].view(torch.int16), outs["trimmed"].view(torch.int16)) \
        if outs["trimmed"].element_size() == 2 else torch.equal(outs["production"], outs["trimmed"])  # fmt: skip
    # CPU time of this process is the ratio that other load on a shared machine does not skew
    # (on a GPU the kernel time is in wall; the CPU side only launches)
    key = cpu if device == "cpu" else wall
    ratio = key["trimmed"] / key["production"]
    print(f"  trimmed / production = {ratio:.3f} ({'cpu' if device == 'cpu' else 'wall'} time; target <= 0.333; "
          f"wall {wall['trimmed'] / wall['production']:.3f}); outputs bit-identical: {same}")  # fmt: skip
    sys.exit(0 if same else 1)


if __name__ == "__main__":
    main()

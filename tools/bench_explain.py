"""How long the hypothesis search (refmla.hypotheses.explain_failure) takes, per planted fault.

The issue's yardstick: a capture of 8 requests x 1300 tokens x 8 heads (Kimi-K2 TP8 decode),
searched within a few seconds on CPU. Each case plants one fault with refmla.synthetic, builds the
replay context (reference + control, not timed as search), then times the search alone.

    python tools/bench_explain.py                 # page sizes 1 and 64, every fault
    python tools/bench_explain.py --page-size 1 --repeat 5 --requests 8 --tokens 1300 --heads 8

Work per case, for orientation: the reference is 2 * B * H * L * D flops for the logits plus
2 * B * H * L * Dv for P.V (8 * 8 * 1300 * (576 + 512) * 2 = 181 Mflop); a range search scores
nb * (nb + 1) / 2 block ranges of H * Dv values each (nb = L / 32 + splits, about 41 here).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from refmla.capture import read_capture
from refmla.hypotheses import explain_failure
from refmla.context import ReplayContext, ReplayOptions
from refmla.synthetic import EXPECT, FAULT_MODES, FAULTS, preset, synth_capture


def bench_case(spec, fault: str, repeat: int, folder: Path) -> dict:
    path = folder / f"{fault}-p{spec.page_size}.safetensors"
    planted = synth_capture(path, spec, fault)
    cap = read_capture(path)
    t0 = time.perf_counter()
    ctx = ReplayContext(cap, ReplayOptions(backends=[]))
    cmp = ctx.compare("observed", cap.out, row_mask=~ctx.empty_rows())
    ctx_s = time.perf_counter() - t0
    times, cpu, expl = [], [], None
    for _ in range(repeat):
        t, c = time.perf_counter(), time.process_time()
        expl = explain_failure(ctx, cap.out, cmp) if not cmp.passed else None
        times.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    return {
        "fault": fault, "page_size": spec.page_size, "planted": planted, "context_s": ctx_s,
        "search_s": statistics.median(times), "search_max_s": max(times), "cpu_s": statistics.median(cpu),
        "failed": not cmp.passed,
        "hypothesis": expl and expl.hypothesis, "detail": expl and expl.detail,
        "request": expl and expl.request,
    }  # fmt: skip


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--tokens", type=int, default=1300)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--page-size", type=int, action="append", help="repeatable (default: 1 and 64)")
    p.add_argument("--fault", action="append", choices=[f for f in FAULTS if EXPECT[f] is not None])
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    faults = args.fault or [f for f in FAULTS if EXPECT[f] is not None and FAULT_MODES[f] is None]  # decode faults
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; capture {args.requests} requests x "
          f"{args.tokens} tokens x {args.heads} heads, bf16, fault on request 2", file=sys.stderr)  # fmt: skip
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for P in args.page_size or [1, 64]:
            lens = (args.tokens,) * args.requests
            spec = dataclasses.replace(preset("kimi-k2-tp8"), name=f"bench-p{P}", num_heads=args.heads, page_size=P,
                                       seq_lens=lens, num_kv_splits=None, fault_request=2)  # fmt: skip
            for fault in faults:
                try:
                    rows.append(bench_case(spec, fault, args.repeat, Path(tmp)))
                except ValueError as e:  # a fault that cannot exist on this spec (a page fault at page size 1)
                    print(f"P={P:<3} {fault:<22} not planted: {e}")
                    continue
                r = rows[-1]
                found = f"{r['hypothesis']} {r['detail']}" if r["failed"] else "observed passes: fault under tolerance"
                print(f"P={P:<3} {fault:<22} search {r['search_s']:6.3f}s wall (max {r['search_max_s']:.3f}s), "
                      f"{r['cpu_s']:.3f}s cpu  context {r['context_s']:.3f}s  -> {found}")  # fmt: skip
    total = sum(r["search_s"] for r in rows)
    worst = max(rows, key=lambda r: r["search_s"])
    import os

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"load average {load:.1f} on {os.cpu_count()} CPUs")
    print(f"total search {total:.2f}s over {len(rows)} cases; slowest {worst['fault']} (P={worst['page_size']}) "
          f"{worst['search_s']:.3f}s")  # fmt: skip
    missed = [r for r in rows if r["failed"] and r["hypothesis"] is None]
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())

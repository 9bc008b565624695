"""Peak memory of a sparse replay (issue 33): a clean DeepSeek-V3.2 decode batch replayed through
the reference and ``observed`` in a fresh process, its peak resident set (VmHWM) read from /proc.

    python tools/bench_sparse_memory.py [--requests 256] [--topk 2048] [--heads 16] [--pool 32768]

The capture (V3.2's 656-byte layout, page 64, no sink) is built here: a pool of ``--pool`` tokens
quantized by refmla.sparse.layouts, each request's top-k drawn from it, production's output from
refmla.sparse.faults' own plain loop (not the reference measured). Then ``refmla replay FILE
--backend reference --backend observed --json`` runs in a child whose VmHWM is the figure; the
budget is 2 GiB. For scale: the keys gathered at once would be requests x topk x 576 x 8 bytes
(256 x 2048: 2.4 GB); the reference gathers a block of rows at a time (refmla.sparse.reference).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

BUDGET = 2 << 30

CHILD = """
import json, sys, time
t0 = time.perf_counter()
from refmla.options import ReplayOptions
from refmla.pipeline import replay_file
r = replay_file(sys.argv[1], ReplayOptions(backends=["reference", "observed"]))
took = time.perf_counter() - t0
hwm = [l for l in open("/proc/self/status") if l.startswith("VmHWM")][0].split()[1]
print(json.dumps({"verdict": r.verdict, "seconds": round(took, 1), "vmhwm_kib": int(hwm),
                  "statuses": {n: b.status for n, b in r.backends.items()}}))
"""


def build(path: Path, requests: int, topk: int, heads: int, pool: int, seed: int = 0) -> None:
    from refmla.sparse.faults import planted_output
    from refmla.sparse.layouts import LAYOUTS, quantize_with_values
    from refmla.sparse.presets import sparse_preset
    from refmla.sparse.synth import Pool, SparseCase
    from refmla.sparse.validation import write_sparse

    p = dataclasses.replace(sparse_preset("deepseek-v3.2-tp8"), heads=heads, topk=topk, seq_lens=(pool,) * requests)
    g = torch.Generator().manual_seed(seed)
    L = LAYOUTS[p.kv_layout]
    k = torch.randn(pool, L.head_dim, generator=g, dtype=torch.float64)
    pages, values = quantize_with_values(k, L, p.page_size)
    idx = torch.stack([torch.randperm(pool, generator=g)[:topk] for _ in range(requests)]).to(torch.int32)[:, None]
    case = SparseCase(preset=p, q=torch.randn(requests, 1, heads, L.head_dim, generator=g).to(torch.bfloat16),
                      main=Pool(pages, values, p.page_size, p.kv_layout), indices=idx,
                      topk_length=torch.full((requests,), topk, dtype=torch.int32), sink=None)  # fmt: skip
    out, lse = planted_output(case)
    write_sparse(path, {**case.tensors(), "out": out, "lse": lse}, case.meta())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--pool", type=int, default=32768, help="tokens in the cache (a multiple of 64)")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "v32.safetensors"
        t0 = time.perf_counter()
        build(path, a.requests, a.topk, a.heads, a.pool)
        print(f"built {a.requests} requests x top-k {a.topk} x {a.heads} heads (pool {a.pool}) in "
              f"{time.perf_counter() - t0:.0f} s, {path.stat().st_size / 2**20:.0f} MiB", file=sys.stderr)
        res = json.loads(subprocess.run([sys.executable, "-c", CHILD, str(path)], check=True, capture_output=True,
                                        text=True).stdout.strip().splitlines()[-1])  # fmt: skip
    peak = res["vmhwm_kib"] * 1024
    res.update(peak_gib=round(peak / 2**30, 3), budget_gib=BUDGET / 2**30, within=peak <= BUDGET)
    print(json.dumps(res))
    return 0 if res["within"] and res["verdict"] == "agree" else 1


if __name__ == "__main__":
    sys.exit(main())

"""The golden suite's time per backend: every case through every backend, as the pytest suite runs it.

    python tools/bench_golden.py                          # golden/ (quick suite), every backend
    python tools/bench_golden.py --backend triton --golden-dir /tmp/golden-full --json

Per case and backend: wall seconds of :func:`refmla.golden.check` (read the file, run the backend,
recompute the control, compare) and the kernel's own seconds where the backend reports them. On a
CPU-only machine the Triton kernels run in the interpreter, so these are suite times, not kernel
performance. Per case the work a decode kernel does is spelled out:

    tokens = sum(seq_lens)                           KV rows read, once per head tile
    flops  = 2 * H * tokens * (D + Dv)               q.k over D = 576, p.v over Dv = 512
    bytes  = tokens * D * kv_bytes + B * H * D * q_bytes + B * H * Dv * out_bytes
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from refmla.backends.triton_interp import ensure_interpreter

ensure_interpreter()  # before anything imports triton

from refmla import golden  # noqa: E402 (after ensure_interpreter)

D, DV = 576, 512
BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1, "float8_e4m3fnuz": 1}


def work(params: dict) -> dict:
    """The decode kernel's work on one case (see the module docstring)."""
    B, H, tokens = len(params["seq_lens"]), params["num_heads"], sum(params["seq_lens"])
    q_bytes, kv_bytes = BYTES[params["dtype"]], BYTES[params["kv_dtype"]]
    return {
        "tokens": tokens,
        "flops": 2 * H * tokens * (D + DV),
        "bytes": tokens * D * kv_bytes + B * H * D * q_bytes + B * H * DV * q_bytes,
    }


def bench(golden_dir: Path, backends: list[str]) -> dict:
    manifest = golden.load_manifest(golden_dir)
    rows, totals = [], {b: 0.0 for b in backends}
    for case in manifest["cases"]:
        path = golden_dir / case["file"]
        isolate, no_room = golden.needs_isolation(path)
        row = {"case": case["name"], **work(case["params"]), "backends": {}}
        for b in backends:
            if no_room:
                row["backends"][b] = {"status": "skipped", "seconds": 0.0, "reason": no_room}
                continue
            t0 = time.perf_counter()
            r = golden.check_isolated(path, b) if isolate else golden.check(path, b)
            seconds = time.perf_counter() - t0
            info = r.entry.info or {}
            row["backends"][b] = {"status": r.status, "seconds": round(seconds, 3),
                                  "kernel_seconds": info.get("kernel_seconds"), "reason": r.reason}  # fmt: skip
            totals[b] += seconds if r.status != "skipped" else 0.0
            print(f"  {case['name']:<36} {b:<9} {r.status:<7} {seconds:7.2f} s", file=sys.stderr, flush=True)
        rows.append(row)
    return {"golden_dir": str(golden_dir), "suite": manifest.get("suite"), "generator": manifest.get("generator"),
            "cases": rows, "total_seconds": {b: round(t, 2) for b, t in totals.items()}}  # fmt: skip


def render(result: dict, backends: list[str]) -> str:
    head = f"{'case':<36} {'tokens':>7} {'MFLOP':>8} {'MB':>7}" + "".join(f" {b:>16}" for b in backends)
    lines = [head, "-" * len(head)]
    for row in result["cases"]:
        cells = []
        for b in backends:
            e = row["backends"][b]
            cell = "skip" if e["status"] == "skipped" else f"{e['seconds']:.2f} s {e['status']}"
            cells.append(f" {cell:>16}")
        lines.append(
            f"{row['case']:<36} {row['tokens']:>7} {row['flops'] / 1e6:>8.1f} {row['bytes'] / 1e6:>7.2f}"
            + "".join(cells)
        )
    lines.append("-" * len(head))
    lines.append(
        f"{'total (s, skips excluded)':<62}" + "".join(f" {result['total_seconds'][b]:>14.1f} s" for b in backends)
    )
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--golden-dir", type=Path, default=Path(__file__).resolve().parents[1] / "golden")
    p.add_argument("--backend", action="append", choices=golden.CHECK_BACKENDS, help="repeatable; default all")
    p.add_argument("--json", action="store_true", help="the result as JSON on stdout")
    a = p.parse_args(argv)
    backends = a.backend or list(golden.CHECK_BACKENDS)
    result = bench(a.golden_dir, backends)
    print(json.dumps(result, indent=1) if a.json else render(result, backends))
    return 0


if __name__ == "__main__":
    sys.exit(main())

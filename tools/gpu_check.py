"""One-shot GPU check: the golden suite through every kernel that imports here, and the reference on the GPU.

On a bare CUDA or ROCm machine (an H200, an MI355X), with the wheels it needs brought along:

    python tools/gpu_check.py [--wheels DIR] [--golden-dir golden] [--out gpu_check.json] [--budget-s 300]
                              [--sweep-s 150] [--sweep-backend NAME]...

1. ``--wheels DIR`` (optional): ``pip install --no-deps --no-index`` every wheel in DIR first
   (sglang, vllm, triton, flash-mla, flashinfer-python, sgl-kernel, amd-aiter: whichever you
   brought; torch must already be the machine's CUDA / ROCm build);
2. every golden (``golden/``) replayed through each kernel backend that is usable here: SGLang's
   Triton decode and extend kernels and vLLM's TRITON_MLA compiled for the GPU (triton,
   vllm_triton, extend), FlashMLA, FlashInfer's TRT-LLM-gen MLA, CUTLASS MLA, FA3 with qv
   (flashmla, flashinfer_mla, cutlass_mla, fa3_mla), flex_attention with its lse (flex), aiter on
   ROCm; each (golden, backend) is ran / passed / failed / skipped-with-why;
3. the fp64 reference on the GPU over a Kimi-K2 TP8 decode batch (64 requests x 4096 tokens x
   16 heads, bf16 pool), timed, against the HBM time of reading the attended KV once:
   bytes = B * L * 576 * 2, at the device's peak bandwidth (--hbm-tbps, default by device name:
   H200 4.8, H100 3.35, MI300X 5.3, MI355X 8.0 TB/s);
4. ``refmla sweep`` of every kernel backend usable here at GPU sizes (``--sizes gpu``: 16-128 heads,
   batches to 256, contexts to 128k, the largest point and the schedule boundaries first; every
   layout each reads) within ``--sweep-s`` seconds (default 150), and the figures to quote: cases,
   cases per minute per backend, findings (backend, check, layout, trigger, capture);
   ``--sweep-backend NAME`` (repeatable) names the backends instead (on a machine without a GPU
   too, at the CPU's sizes: how the test suite runs this step);
5. a table (stdout) and the whole result as JSON (``--out``). Exit 0 when nothing failed, 1 when a
   kernel failed a golden or the sweep found something, 2 on bad arguments.

Sized for a 10-minute slot: the goldens are small (about 1 s per kernel on a GPU; the first call of
a Triton kernel compiles, a few seconds each) and ``--budget-s`` (default 300) stops starting new
replays past it, reporting the rest as skipped; the sweep keeps to ``--sweep-s`` (within 10 %, its
last case allowed to finish). On a machine without a GPU (here, CI) it runs too:
the reference and the observed outputs are checked, every GPU kernel is reported skipped with
why, and the timing step is skipped ("no GPU").
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

KERNELS = ("triton", "vllm_triton", "extend", "flashmla", "flashinfer_mla", "cutlass_mla", "fa3_mla", "flex", "aiter")
GPU_ONLY = set(KERNELS)  # on CPU these run under the interpreter in the test suite, not here
HBM_TBPS = {"H200": 4.8, "H100": 3.35, "H20": 4.0, "B200": 8.0, "MI300X": 5.3, "MI325X": 6.0, "MI355X": 8.0}


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--wheels", help="install every wheel in this folder (--no-deps --no-index) first")
    ap.add_argument("--golden-dir", default=str(ROOT / "golden"))
    ap.add_argument("--out", help="write the result as JSON here")
    ap.add_argument("--budget-s", type=float, default=300.0, help="stop starting replays past this many seconds")
    ap.add_argument("--sweep-s", type=float, default=150.0, help="the sweep's budget in seconds (0: no sweep)")
    ap.add_argument("--sweep-backend", action="append", default=[], help="sweep these backends (default: every "
                    "kernel usable here, on a GPU only)")
    ap.add_argument("--sweep-out", default="gpu_check_sweep", help="where the sweep's shrunk captures go")
    ap.add_argument("--hbm-tbps", type=float, help="peak HBM bandwidth in TB/s (default: by device name)")
    ap.add_argument("--timing-shape", default="64,4096,16", help="B,L,H of the reference timing batch")
    return ap.parse_args(argv)


def install_wheels(folder: str) -> list[str]:
    wheels = sorted(str(p) for p in Path(folder).glob("*.whl"))
    if wheels:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", *wheels], check=True)
    return wheels


def gpu_name() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else ""


def check_goldens(folder: str, deadline: float) -> list[dict]:
    """One row per (golden, backend): status, reason, max_abs_err, seconds."""
    from refmla.backends import get_backend
    from refmla.capture import read_capture
    from refmla.context import ReplayOptions
    from refmla.pipeline import replay_capture

    gpu = bool(gpu_name())
    usable = {}
    for name in KERNELS:
        ok, why = get_backend(name).availability()
        if not gpu and name in GPU_ONLY:
            ok, why = False, f"no GPU here ({why if not ok else 'it runs on CPU too: the test suite covers it there'})"
        usable[name] = (ok, why)
    rows = []
    for path in sorted(Path(folder).glob("*.safetensors")):
        cap = read_capture(path)
        names = [n for n in KERNELS if usable[n][0]]
        if time.monotonic() > deadline:
            rows += [dict(golden=path.name, backend=n, status="skipped", reason="time budget spent") for n in KERNELS]
            continue
        report = replay_capture(cap, ReplayOptions(backends=names, explain=False))
        for n in ("reference", "observed", *KERNELS):
            e = report.backends.get(n)
            if e is None:
                rows.append(dict(golden=path.name, backend=n, status="skipped", reason=usable[n][1]))
            else:
                rows.append(dict(golden=path.name, backend=n, status=e.status, reason=e.reason,
                                 max_abs_err=e.max_abs_err, seconds=e.seconds))  # fmt: skip
    return rows


def time_reference(shape: str, tbps) -> dict:
    """The fp64 reference on the GPU vs the HBM time of reading the attended KV once."""
    import torch

    from refmla.attended import Attended
    from refmla.reference import mla_decode_ref
    from refmla.scales import Scales

    name = gpu_name()
    if not name:
        return {"status": "skipped", "reason": "no GPU"}
    B, L, H = (int(x) for x in shape.split(","))
    dev = torch.device("cuda")
    g = torch.Generator(device="cpu").manual_seed(0)
    q = torch.randn(B, H, 576, generator=g).to(dev, torch.bfloat16)
    pool = torch.randn(B * L, 1, 576, generator=g).to(dev, torch.bfloat16)
    indptr = torch.arange(B + 1) * L  # [B + 1]
    idx = torch.randperm(B * L, generator=g)  # [B * L]
    sc = Scales(kv_lora_rank=512, sm_scale=0.1352)
    mla_decode_ref(q[:1], pool, Attended.token_index(indptr[:2], idx[:L]), sc)  # warm-up
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    mla_decode_ref(q, pool, Attended.token_index(indptr, idx), sc)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    bw = tbps or next((v for k, v in HBM_TBPS.items() if k in name.upper()), None)
    kv_bytes = B * L * 576 * 2  # every attended row read once, bf16
    hbm = kv_bytes / (bw * 1e12) if bw else None
    return {"status": "ran", "device": name, "shape": {"B": B, "L": L, "H": H}, "reference_seconds": round(seconds, 4),
            "kv_bytes": kv_bytes, "hbm_tbps": bw, "hbm_seconds": hbm,
            "ratio": round(seconds / hbm, 1) if hbm else None}  # fmt: skip


def run_sweep_step(seconds: float, names: list[str], out: str) -> dict:
    """The sweep of ``names`` (default: every usable kernel, on a GPU) at the sizes where it runs,
    within ``seconds``: its figures (cases, cases per minute per backend, findings)."""
    from refmla.backends import get_backend
    from refmla.sweep import SweepConfig, run_sweep

    if seconds <= 0:
        return {"status": "skipped", "reason": "--sweep-s 0"}
    if not names:
        if not gpu_name():
            return {"status": "skipped", "reason": "no GPU (name --sweep-backend to sweep at the CPU's sizes)"}
        names = [n for n in KERNELS if get_backend(n).availability()[0]]
        if not names:
            return {"status": "skipped", "reason": "no kernel backend usable here"}
    rep = run_sweep(SweepConfig(backends=names, budget=seconds, out=out, allow_skip=True))
    per = {n: {"cases": b.cases, "cases_per_minute": round(60 * b.cases / rep.walk_seconds, 2) if rep.walk_seconds else None,
               "findings": len(b.findings), "not_run": b.not_run, "available": b.available}
           for n, b in rep.backends.items()}  # fmt: skip
    findings = [{"backend": f.backend, "check": f.check, "layout": f.layout, "cases": f.failing_cases,
                 "trigger": f.trigger.text() if f.trigger else None, "capture": f.capture} for f in rep.findings]  # fmt: skip
    return {"status": "ran", "budget_s": seconds, "bounds": rep.bounds, "cases": len(rep.cases),
            "walk_seconds": round(rep.walk_seconds, 1), "shrink_seconds": round(rep.shrink_seconds, 1),
            "cases_per_minute": rep.cases_per_minute, "pairs": rep.pairs, "backends": per, "findings": findings}  # fmt: skip


def sweep_lines(sweep: dict) -> list[str]:
    """The sweep's figures as the README quotes them."""
    if sweep["status"] != "ran":
        return [f"sweep: skipped ({sweep['reason']})"]
    b = sweep["bounds"]
    lines = [f"sweep: {sweep['cases']} cases in {sweep['walk_seconds']} s + shrinking {sweep['shrink_seconds']} s "
             f"(budget {sweep['budget_s']:g} s, {b['profile']} bounds: contexts to {b['length']}, batches to "
             f"{b['batch']}, {b['rows']} rows x heads), {len(sweep['findings'])} finding(s)"]  # fmt: skip
    for n, x in sweep["backends"].items():
        lines.append(f"  {n:<16} {x['cases']:>5} cases  {x['cases_per_minute'] or 0:>7.1f} cases/min  "
                     f"{x['findings']} finding(s)" + (f"  not run on {', '.join(x['not_run'])}" if x["not_run"] else ""))
    for f in sweep["findings"]:
        lines.append(f"  FINDING {f['backend']} {f['check']} ({f['layout']}, {f['cases']} cases): {f['trigger']}")
    return lines


def table(rows: list[dict]) -> str:
    by = {}
    for r in rows:
        c = by.setdefault(r["backend"], {"ran": 0, "pass": 0, "fail": 0, "error": 0, "skipped": 0, "why": set()})
        c[r["status"]] = c.get(r["status"], 0) + 1
        if r["status"] != "skipped":
            c["ran"] += 1
        elif r.get("reason"):
            c["why"].add(str(r["reason"])[:110])
    lines = [f"{'backend':<16} {'ran':>4} {'pass':>5} {'fail':>5} {'error':>6} {'skipped':>8}  why skipped"]
    for n, c in by.items():
        lines.append(f"{n:<16} {c['ran']:>4} {c['pass']:>5} {c['fail']:>5} {c['error']:>6} {c['skipped']:>8}  "
                     f"{'; '.join(sorted(c['why']))}")  # fmt: skip
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse(argv)
    start = time.monotonic()
    wheels = install_wheels(args.wheels) if args.wheels else []
    from refmla.backends.triton_interp import ensure_interpreter

    ensure_interpreter()
    rows = check_goldens(args.golden_dir, start + args.budget_s)
    timing = time_reference(args.timing_shape, args.hbm_tbps)
    sweep = run_sweep_step(args.sweep_s, args.sweep_backend, args.sweep_out)
    result = {"device": gpu_name() or "none (CPU)", "wheels": wheels, "goldens": rows, "reference_timing": timing,
              "sweep": sweep, "seconds": round(time.monotonic() - start, 1)}  # fmt: skip
    print(f"device: {result['device']}")
    print(table(rows))
    print("reference on the GPU: " + json.dumps(timing))
    print("\n".join(sweep_lines(sweep)))
    if args.out:
        from refmla.atomic import write_bytes

        write_bytes(Path(args.out), json.dumps(result, indent=1, default=str).encode())
    failed = any(r["status"] in ("fail", "error") for r in rows) or bool(sweep.get("findings"))
    return 1 if failed else 0


if __name__ == "__main__":
    os.environ.setdefault("REFMLA_GPU_CHECK", "1")
    sys.exit(main())

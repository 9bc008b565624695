"""Time and peak memory of sparse decode replays beside the dense reference, per attended entry.

    python tools/bench_sparse.py [--case NAME]... [--threads 2]

Cases (DeepSeek-V3.2's 656-byte layout, page 64, no sink; built here):

    clean         256 requests x top-k 2,048 x 16 heads, production's output correct
    faulty        128 requests x top-k 2,048 x 16 heads, one head of one request wrong (x 1.5 + 0.01)
    tokens        20,000 query tokens (requests) x top-1 x 16 heads
    heads         1 request x top-1 x 16,384 heads
    long          a dense decode capture of 1 request x 60,000 positions x 16 heads whose kv holds one
                  element the kernel did not read (x[30,017][5] = 100): the search and the localization
    dense         the dense reference (refmla.reference.mla_decode_ref) on 128 requests x 2,048
                  positions x 16 heads: its seconds per attended entry x head are the yardstick

Each sparse case runs ``refmla.pipeline.replay_file(FILE, backends reference + observed)`` (the whole
replay: read, validate, reference, control, judge, diagnosis, the hypothesis search when it fails)
in a fresh child process with ``--threads`` torch threads; the figures are its wall seconds, its
CPU seconds (both threads; what a loaded machine does not inflate) and peak resident set (VmHWM). Production's output is computed here by a plain fp64 softmax over the
quantizer's own values (refmla.sparse.layouts.quantize_with_values), not by the reference measured.
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

ROOT = Path(__file__).resolve().parents[1]
POOL = 32768  # tokens in the cache (a multiple of 64)

CASES = {  # name -> (requests, top-k, heads, wrong (request, head) or None)
    "clean": (256, 2048, 16, None),
    "faulty": (128, 2048, 16, (37, 5)),
    "tokens": (20000, 1, 16, None),
    "heads": (1, 1, 16384, None),
}

CHILD = """
import json, sys, time
import torch
torch.set_num_threads(int(sys.argv[2]))
t0, c0 = time.perf_counter(), time.process_time()
from refmla.options import ReplayOptions
from refmla.pipeline import replay_file
from refmla.util import steady_heap
steady_heap()  # as the refmla command's process does (refmla.cli.main)
r = replay_file(sys.argv[1], ReplayOptions(backends=["reference", "observed"]))
took, cpu = time.perf_counter() - t0, time.process_time() - c0
hwm = [l for l in open("/proc/self/status") if l.startswith("VmHWM")][0].split()[1]
print(json.dumps({"verdict": r.verdict, "diagnosis": r.diagnosis, "seconds": round(took, 2), "cpu_s": round(cpu, 2), "vmhwm_kib": int(hwm),
                  "explained": [str(getattr(b.explanation, "hypothesis", None)) for b in r.backends.values()
                                if b.status == "fail"],
                  "localized": [{"requests": b.localization.requests, "heads": {str(k): v for k, v in b.localization.heads.items()}}
                                for b in r.backends.values() if b.localization is not None],
                  "where": [b.localization.text() for b in r.backends.values() if b.localization is not None],
                  "search_skipped": [b.info.get("search_skipped") for b in r.backends.values() if b.info.get("search_skipped")]}))
"""

DENSE_CHILD = """
import json, sys, time
import torch
torch.set_num_threads(int(sys.argv[1]))
from refmla import reference as ref
from refmla.attended import Attended
from refmla.scales import Scales
B, L, H, D = 128, 2048, 16, 576
g = torch.Generator().manual_seed(0)
q = torch.randn(B, H, D, generator=g).bfloat16()
kv = torch.randn(B * L, 1, D, generator=g).bfloat16()
t = {"kv_indptr": torch.arange(B + 1, dtype=torch.int32) * L, "kv_indices": torch.randperm(B * L, generator=g).int(),
     "seq_lens": torch.full((B,), L, dtype=torch.int32)}
att = Attended.from_tensors(t)
sc = Scales(512, D ** -0.5, 0.0, 1.0, 1.0)
ref.mla_decode_ref(q[:1], kv, Attended.from_tensors({"kv_indptr": t["kv_indptr"][:2], "kv_indices": t["kv_indices"],
                                                    "seq_lens": t["seq_lens"][:1]}), sc)  # its one compile, not timed
t0, c0 = time.perf_counter(), time.process_time()
ref.mla_decode_ref(q, kv, att, sc)
took, cpu = time.perf_counter() - t0, time.process_time() - c0
hwm = [l for l in open("/proc/self/status") if l.startswith("VmHWM")][0].split()[1]
print(json.dumps({"seconds": round(took, 2), "cpu_s": round(cpu, 2), "vmhwm_kib": int(hwm), "entries": B * L, "heads": H}))
"""


def build(path: Path, requests: int, topk: int, heads: int, wrong=None, seed: int = 0) -> None:
    """A V3.2 sparse decode capture; ``out`` by a plain fp64 softmax here (``wrong``: that (request,
    head) of it off)."""
    from refmla.sparse.layouts import LAYOUTS, quantize_with_values
    from refmla.sparse.presets import sparse_preset
    from refmla.sparse.synth import Pool, SparseCase
    from refmla.sparse.validation import write_sparse

    p = dataclasses.replace(sparse_preset("deepseek-v3.2-tp8"), heads=heads, topk=topk, seq_lens=(POOL,) * requests)
    g = torch.Generator().manual_seed(seed)
    layout = LAYOUTS[p.kv_layout]
    pages, values = quantize_with_values(torch.randn(POOL, layout.head_dim, generator=g, dtype=torch.float64), layout,
                                         p.page_size)  # fmt: skip
    idx = torch.argsort(torch.rand(requests, POOL, generator=g), dim=1)[:, :topk] if topk > 1 else \
        torch.randint(POOL, (requests, 1), generator=g)  # fmt: skip
    q = torch.randn(requests, 1, heads, layout.head_dim, generator=g).to(torch.bfloat16)
    out = torch.empty(requests, 1, heads, p.head_dim_v, dtype=torch.float64)
    for b0 in range(0, requests, 64):  # plain softmax(q k^T * scale) v, 64 requests at a time
        k = values[idx[b0 : b0 + 64]]  # [b, K, D]
        s = torch.einsum("bhd,bkd->bhk", q[b0 : b0 + 64, 0].double(), k) * p.softmax_scale
        out[b0 : b0 + 64, 0] = torch.einsum("bhk,bkd->bhd", torch.softmax(s, dim=-1), k[..., : p.head_dim_v])
    if wrong is not None:
        out[wrong[0], 0, wrong[1]] = out[wrong[0], 0, wrong[1]] * 1.5 + 0.01
    case = SparseCase(preset=p, q=q, main=Pool(pages, values, p.page_size, p.kv_layout), indices=idx.to(torch.int32)[:, None],
                      topk_length=torch.full((requests,), topk, dtype=torch.int32), sink=None)  # fmt: skip
    write_sparse(path, {**case.tensors(), "out": out.to(torch.bfloat16)}, case.meta())


LONG = 60_000  # positions of the "long" case


def build_long(path: Path, positions: int = LONG) -> None:
    """The dense capture of one request over ``positions`` positions; ``out`` by refmla.synthetic's
    correct output, then one element of the captured kv changed here (the localizer never plants)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from helpers import raw_write
    from refmla.synthetic import SynthSpec, faulty_output, make_inputs, make_meta

    spec = SynthSpec(name="long", num_heads=16, seq_lens=(positions,), free_pages=1, pool_tokens=1 << 17)
    t = make_inputs(spec)
    t["out"], _ = faulty_output(spec, t, "none")
    t["kv_buffer"][int(t["kv_indices"][positions // 2 + 17]), 0, 5] = 100.0
    raw_write(path, t, make_meta(spec))


def child(code: str, *argv: str) -> dict:
    run = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, cwd=ROOT,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})  # fmt: skip
    if run.returncode != 0:
        raise SystemExit(run.stderr[-3000:])
    return json.loads(run.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", action="append", choices=[*CASES, "long", "dense"], help="(repeatable; default all)")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    names = a.case or [*CASES, "long", "dense"]
    rows = {}
    if "dense" in names:
        d = child(DENSE_CHILD, str(a.threads))
        d["us_per_entry_head"] = round(d["seconds"] / (d["entries"] * d["heads"]) * 1e6, 4)
        d["cpu_us_per_entry_head"] = round(d["cpu_s"] / (d["entries"] * d["heads"]) * 1e6, 4)
        rows["dense"] = d
        print(json.dumps({"case": "dense", **d}), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        if "long" in names:
            path = Path(tmp) / "long.safetensors"
            build_long(path)
            r = child(CHILD, str(path), str(a.threads))
            r.update(positions=LONG, peak_gib=round(r["vmhwm_kib"] / 2**20, 3))
            print(json.dumps({"case": "long", **r}), flush=True)
        for name in [n for n in names if n in CASES]:
            B, K, H, wrong = CASES[name]
            path = Path(tmp) / f"{name}.safetensors"
            t0 = time.perf_counter()
            build(path, B, K, H, wrong)
            built = time.perf_counter() - t0
            r = child(CHILD, str(path), str(a.threads))
            r.update(built_s=round(built, 1), entries=B * K, heads=H, peak_gib=round(r["vmhwm_kib"] / 2**20, 3),
                     us_per_entry_head=round(r["seconds"] / (B * K * H) * 1e6, 4),
                     cpu_us_per_entry_head=round(r["cpu_s"] / (B * K * H) * 1e6, 4))  # fmt: skip
            if "dense" in rows:
                r["x_dense_per_entry"] = round(r["us_per_entry_head"] / rows["dense"]["us_per_entry_head"], 2)
                r["x_dense_per_entry_cpu"] = round(r["cpu_us_per_entry_head"] / rows["dense"]["cpu_us_per_entry_head"], 2)
            rows[name] = r
            print(json.dumps({"case": name, **r}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

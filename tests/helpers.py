"""Small builders shared by the tests: hostile paged pools and raw (unvalidated) capture files."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import torch

from refmla import CAPTURE_FORMAT


def paged_case(seq_lens, heads, page_size=1, D=576, Dv=512, dtype=torch.float32, seed=0, free_pages=2):
    """q [B,H,D], a pool whose pages are shuffled and whose unattended rows are NaN, and metadata."""
    g = torch.Generator().manual_seed(seed)
    B, P = len(seq_lens), page_size
    pages_per = [-(-L // P) for L in seq_lens]
    n_pages = sum(pages_per) + free_pages
    perm = torch.randperm(n_pages, generator=g)
    pool = torch.full((n_pages * P, 1, D), math.nan)
    idx, used = [], 0
    for L, npg in zip(seq_lens, pages_per):
        pages = perm[used : used + npg]
        used += npg
        slots = (pages[:, None] * P + torch.arange(P)[None, :]).reshape(-1)[:L]
        pool[slots, 0] = torch.randn(L, D, generator=g)
        idx.append(slots)
    indptr = torch.zeros(B + 1, dtype=torch.int64)
    indptr[1:] = torch.cumsum(torch.tensor(seq_lens, dtype=torch.int64), 0)
    q = torch.randn(B, heads, D, generator=g)
    return q.to(dtype), pool.to(dtype), indptr, torch.cat(idx) if idx else torch.zeros(0, dtype=torch.int64)


def dense_reference(q, kv_buffer, kv_indptr, kv_indices, Dv, sm_scale, logit_cap=0.0, k_scale=1.0, v_scale=1.0):
    """Independent formulation: per request, per head, an explicit loop-free softmax over gathered rows."""
    B, H, _ = q.shape
    out = torch.zeros(B, H, Dv, dtype=torch.float64)
    lse = torch.full((B, H), -math.inf, dtype=torch.float64)
    for b in range(B):
        rows = kv_indices[int(kv_indptr[b]) : int(kv_indptr[b + 1])].long()
        if len(rows) == 0:
            continue
        K = kv_buffer[rows, 0].double() * k_scale  # [L, D]
        V = kv_buffer[rows, 0, :Dv].double() * v_scale  # [L, Dv]
        logits = torch.einsum("hd,ld->hl", q[b].double(), K) * sm_scale
        if logit_cap > 0:
            logits = logit_cap * torch.tanh(logits / logit_cap)
        m = logits.max(dim=1, keepdim=True).values
        w = torch.exp(logits - m)
        out[b] = torch.einsum("hl,lv->hv", w / w.sum(1, keepdim=True), V)
        lse[b] = (m + torch.log(w.sum(1, keepdim=True)))[:, 0]
    return out, lse


def raw_write(path, tensors, meta, fmt=CAPTURE_FORMAT):
    """Write a safetensors file with no validation at all (for bad-input tests)."""
    from safetensors.torch import save_file

    header = {}
    if fmt is not None:
        header["format"] = fmt
    if meta is not None:
        header["meta"] = meta if isinstance(meta, str) else json.dumps(meta)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata=header)


STANDINS = Path(__file__).parent / "standins"  # tests/standins: stand-ins for ROCm-only packages


def forget_aiter() -> None:
    """Drop every imported ``aiter`` module, so the next import finds whichever one is on sys.path."""
    for name in [k for k in sys.modules if k == "aiter" or k.startswith("aiter.")]:
        sys.modules.pop(name)


ROOT = Path(__file__).resolve().parents[1]
# The peak is read as resident memory in a fresh process. A fixed mmap threshold makes glibc serve
# every allocation over 128 KiB with its own mapping, returned on free, so the peak counts the bytes
# live at once (not what a dynamic threshold left cached in the heap).
MEASURE_ENV = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "MALLOC_MMAP_THRESHOLD_": "131072"}
# The control of one request of L indices that all point at the one row of a one-row pool, in a fresh
# process: argv L, H, splits (0: unsplit, refmla.control.mla_control; else mla_control_split). Prints
# the peak above the inputs, the control's stated budget and the output's error against v (every row
# equal: out = v to the output's rounding).
CONTROL_HOSTILE = """
import json, sys, torch
from refmla import control
from refmla.attended import Attended
from refmla.scales import Scales
L, H, n, D = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), 576
g = torch.Generator().manual_seed(0)
pool = torch.randn(1, 1, D, generator=g).to(torch.bfloat16)
q = torch.randn(1, H, D, generator=g).to(torch.bfloat16)
idx, indptr = torch.zeros(L, dtype=torch.int32), torch.tensor([0, L], dtype=torch.int32)
def kib(key):
    return int(next(l for l in open("/proc/self/status") if l.startswith(key + ":")).split()[1])
att, sc = Attended.token_index(indptr, idx), Scales(kv_lora_rank=512, sm_scale=0.1)  # the input
open("/proc/self/clear_refs", "w").write("5")
base = kib("VmRSS")
if n:
    out, lse = control.mla_control_split(q, pool, att, torch.tensor([n]), sc, torch.bfloat16)
else:
    out, lse = control.mla_control(q, pool, att, sc, torch.bfloat16)
v = pool[0, 0, :512].float()
print(json.dumps({"peak": (kib("VmHWM") - base) * 1024, "budget": control.control_budget(H, D, 512, 2),
                  "out_err": float(((out[0].float() - v).abs() / v.abs().clamp(min=1e-3)).max())}))
"""


def measure_control(L: int, H: int, splits: int = 0) -> dict:
    """Run CONTROL_HOSTILE in a fresh process; its JSON line."""
    import subprocess

    r = subprocess.run([sys.executable, "-c", CONTROL_HOSTILE, str(L), str(H), str(splits)], capture_output=True,
                       text=True, cwd=ROOT, env=MEASURE_ENV, timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def load_tool(name: str):
    """tools/<name>.py as module ``name``, loaded once per process (a second call returns the same
    module: dataclasses look their module up by name, so it must stay the one in sys.modules)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module

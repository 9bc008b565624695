"""Synthetic merges with a planted fault (``refmla synth OUT --preset merge-chunked-prefill --fault
lse_base``): two pieces of real attention (softmax over random keys, one piece empty for one row
as chunked prefill has it), merged by a plain loop of its own over (row, head) -- never refmla's
reference -- the documented way or with the fault.

Faults: none, lse_base (log2 lse merged as ln), empty_lse_zero (the empty piece merged with lse 0),
empty_lse_nan, piece_dropped (the second piece left out), lse_layout (lse read as [H, T]).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from refmla.merge.io import write_merge
from refmla.util import check_choice

FAULTS = ("none", "lse_base", "empty_lse_zero", "empty_lse_nan", "piece_dropped", "lse_layout")


@dataclass(frozen=True)
class MergeSpec:
    name: str
    merger: str
    lse_base: str  # the base the pieces' lse are in
    rows: int = 6
    heads: int = 4
    dim: int = 64
    keys: int = 24  # keys per piece
    seed: int = 0


PRESETS = {
    "merge-chunked-prefill": MergeSpec("merge-chunked-prefill", "sglang.merge_state", "e"),
    "merge-cp-log2": MergeSpec("merge-cp-log2", "flashinfer.merge_state", "2"),
}


def _piece(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, base: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q [T, H, D] over k, v [n, D] in fp64: (out [T, H, D], lse [T, H] in ``base``)."""
    s = torch.einsum("thd,nd->thn", q.double(), k.double()) / math.sqrt(q.shape[-1])
    lse = torch.logsumexp(s, dim=-1)
    out = torch.einsum("thn,nd->thd", torch.softmax(s, dim=-1), v.double())
    return out, (lse / math.log(2.0) if base == "2" else lse)


def plain_merge(oa, la, ob, lb, base: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The merge, one (row, head) at a time, in the base given (its own loop)."""
    T, H, D = oa.shape
    out, lse = torch.zeros(T, H, D, dtype=torch.float64), torch.zeros(T, H, dtype=torch.float64)
    exp = (lambda x: 2.0**x) if base == "2" else math.exp
    log = math.log2 if base == "2" else math.log
    for t in range(T):
        for h in range(H):
            a, b = float(la[t, h]), float(lb[t, h])
            m = max(a, b)
            if m == -math.inf or math.isnan(a) or math.isnan(b):
                out[t, h] = float("nan") if (math.isnan(a) or math.isnan(b)) else 0.0
                lse[t, h] = float("nan") if (math.isnan(a) or math.isnan(b)) else -math.inf
                continue
            wa, wb = exp(a - m), exp(b - m)
            out[t, h] = (wa * oa[t, h].double() + wb * ob[t, h].double()) / (wa + wb)
            lse[t, h] = m + log(wa + wb)
    return out, lse


def synth_merge(out: Any, preset: str, fault: str = "none", seed: int = 0) -> dict:
    """Write one merge capture; returns what was planted."""
    check_choice("merge preset", preset, PRESETS)
    check_choice("merge fault", fault, FAULTS)
    s = PRESETS[preset]
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(s.rows, s.heads, s.dim, generator=g)
    ka, va, kb, vb = (torch.randn(s.keys, s.dim, generator=g) for _ in range(4))
    oa, la = _piece(q, ka, va, s.lse_base)
    ob, lb = _piece(q, kb, vb, s.lse_base)
    empty_row = 0  # the first row has no prefix keys (chunked prefill's empty chunk)
    oa[empty_row], la[empty_row] = 0.0, -math.inf
    oa, ob = oa.to(torch.bfloat16), ob.to(torch.bfloat16)
    ma, mb = la.clone(), lb.clone()  # what the faulty merger reads
    base = s.lse_base
    if fault == "lse_base":
        base = "e" if s.lse_base == "2" else "2"
    elif fault in ("empty_lse_zero", "empty_lse_nan"):
        ma[empty_row] = 0.0 if fault == "empty_lse_zero" else float("nan")
    elif fault == "piece_dropped":
        mb[:] = -math.inf
    elif fault == "lse_layout":
        ma, mb = (x.reshape(-1).reshape(s.heads, s.rows).t() for x in (la, lb))
    merged, lse = plain_merge(oa, ma, ob, mb, base)
    recorded_a = ma if fault in ("empty_lse_zero", "empty_lse_nan") else la  # the lse the engine passed
    tensors = {"out_a": oa, "lse_a": recorded_a.float(), "out_b": ob, "lse_b": lb.float(),
               "out": merged.to(torch.bfloat16), "lse": lse.float()}  # fmt: skip
    meta = {"mode": "merge", "merger": s.merger, "lse_base": s.lse_base, "engine": "synth", "layer_id": 0,
            "tp_rank": 0, "step": 0}  # fmt: skip
    write_merge(out, tensors, meta)
    return {"fault": fault, "empty_row": empty_row}


__all__ = ["FAULTS", "PRESETS", "MergeSpec", "plain_merge", "synth_merge"]

"""Synthetic indexer captures with planted faults, by their own plain loop (never the reference).

The "kernel" here is the arithmetic of SGLang's torch path written out: keys quantized per token
to fp8 with a power-of-two scale (amax / 448, rounded up), q quantized per (request, head) with
its scale folded into the weights, dot products in fp32, relu, the weighted sum over heads, the
key's scale, then ``torch.topk`` over the entries before the causal bound (all of them, in order,
when there are no more than K). Pages are handed out shuffled; ``slots`` presets write the
page-translated indices SGLang's ``topk_transform`` writes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from refmla.indexer.io import write_indexer


@dataclass(frozen=True)
class Preset:
    heads: int
    dim: int
    topk: int
    ratio: int
    seq_lens: tuple
    fp8: bool = True
    indices_kind: str = "slots"
    page_size: int = 64


PRESETS = {
    "indexer-v32": Preset(64, 128, 256, 1, (200, 777, 1500, 2100)),  # V3.2: 64 index heads x 128, top-2048 cut to 256
    "indexer-v32-bf16": Preset(64, 128, 256, 1, (300, 1025, 1800), fp8=False, indices_kind="positions"),
    # V4 C4: entries = seq_len // 4, top-512 cut to 128
    "indexer-v4-c4": Preset(64, 128, 128, 4, (400, 2051, 4097, 6000), indices_kind="positions"),
}
FAULTS = ("none", "topk_stale", "topk_unwritten", "topk_future", "topk_off_by", "indexer_scale_not_applied",
          "indexer_relu_omitted", "indexer_weights_ignored", "compress_ratio_wrong", "topk_length_wrong")  # fmt: skip


def _quantize(x: torch.Tensor, dim: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 values, power-of-two scale) of x per row of ``dim``: scale = 2**ceil(log2(amax / 448))."""
    amax = x.abs().amax(dim=dim, keepdim=True).clamp_min(1e-4)
    scale = torch.pow(2.0, torch.ceil(torch.log2(amax / 448.0)))
    return (x / scale).to(torch.float8_e4m3fn), scale.squeeze(dim)


def _kernel(q, w, k, ks, L, K, relu=True, weights=True, kscale=True):
    """One request's produced top-k positions from q [H, D], weights [H], keys [n, D] and their
    scales [n] as stored: the plain loop of the module docstring."""
    dots = k[:L] @ q.T  # [L, H] fp32
    dots = dots.clamp_min(0) if relu else dots
    s = (dots * (w if weights else torch.ones_like(w))).sum(1) * (ks[:L] if kscale else 1.0)  # [L]
    if L <= K:
        return torch.arange(L)
    return torch.topk(s, K).indices


def synth_indexer(out: Any, preset_name: str, fault: str = "none", seed: int = 0) -> dict:
    """Write preset ``preset_name`` with ``fault`` planted to ``out``; returns what was planted."""
    if preset_name not in PRESETS:
        raise ValueError(f"unknown preset {preset_name!r}; choose from {', '.join(PRESETS)}")
    if fault not in FAULTS:
        raise ValueError(f"unknown fault {fault!r} for an indexer preset; choose from {', '.join(FAULTS)}")
    p = PRESETS[preset_name]
    if fault == "compress_ratio_wrong" and p.ratio == 1:
        raise ValueError(f"fault compress_ratio_wrong needs a compressed preset (indexer-v4-c4), not {preset_name!r}")
    if fault == "indexer_scale_not_applied" and not p.fp8:
        raise ValueError(f"fault indexer_scale_not_applied needs an fp8 preset, not {preset_name!r} (its keys have no scale)")
    tensors, meta = indexer_call(p, fault, seed, preset_name)
    write_indexer(out, tensors, meta)
    return {"fault": fault}


def indexer_call(p: Preset, fault: str = "none", seed: int = 0, model: str = "synth") -> tuple[dict, dict]:
    """(tensors, meta) of one indexer call of ``p`` with ``fault`` planted (the module docstring's loop)."""
    g = torch.Generator().manual_seed(seed)
    B, H, D, K, ps = len(p.seq_lens), p.heads, p.dim, p.topk, p.page_size
    seq = torch.tensor(p.seq_lens)
    L = seq // p.ratio
    npages = (L + ps - 1) // ps + 1  # one spare page each: the slots past the bound hold keys too
    P = int(npages.sum())
    perm = torch.randperm(P, generator=g)
    table = torch.full((B, int(npages.max())), -1, dtype=torch.int32)
    at = 0
    for b in range(B):
        table[b, : npages[b]] = perm[at : at + npages[b]].int()
        at += int(npages[b])
    keys = torch.randn(P * ps, D, generator=g) * (0.5 + torch.rand(P * ps, 1, generator=g) * 4)  # per-token magnitudes vary
    k8, kscale = _quantize(keys)
    qf = torch.randn(B, H, D, generator=g)
    q8, qs = _quantize(qf)  # [B, H, D], [B, H]
    w = torch.randn(B, H, generator=g)  # weights_proj(x) * H**-0.5 (signs vary)
    if p.fp8:  # as stored: fp8 q, its scale folded into the weights (SGLang); fp8 keys and their scales
        q, wt, kv, ks = q8.float(), w * qs, k8.float(), kscale
    else:  # bf16 q and keys, no scale
        q, wt, kv, ks = qf.to(torch.bfloat16), w, keys.to(torch.bfloat16), torch.ones(P * ps)
    rows_of = lambda b: torch.cat([torch.arange(r * ps, (r + 1) * ps) for r in table[b, : npages[b]].tolist()])  # noqa: E731
    prod, prev = torch.full((B, K), -1, dtype=torch.int64), torch.full((B, K), -1, dtype=torch.int64)
    for b in range(B):
        tok = rows_of(b)  # [npages * ps] cache rows of the request's entries, in position order
        Lb = int(L[b])
        args = (q[b].float(), wt[b], kv[tok].float(), ks[tok], Lb, K)
        flags = {"indexer_scale_not_applied": {"kscale": False}, "indexer_relu_omitted": {"relu": False},
                 "indexer_weights_ignored": {"weights": False}}.get(fault, {})  # fmt: skip
        pos = _kernel(*args, **flags)
        qp = torch.randn(H, D, generator=g)  # the previous step's query
        pos_prev = _kernel(qp, wt[b], kv[tok].float(), ks[tok], max(0, Lb - 1), K)
        if fault == "topk_stale":
            pos = pos_prev
        elif fault == "topk_unwritten":
            pos = torch.empty(0, dtype=torch.long)
        elif fault == "topk_future" and Lb > 8:
            pos = pos.clone()
            pos[:4] = torch.arange(Lb, Lb + 4)  # entries past the causal bound
        elif fault == "topk_off_by":
            pos = pos + 1
        elif fault == "compress_ratio_wrong":
            pos = pos * p.ratio  # the entries' positions given in tokens: mapped with ratio 1
        elif fault == "topk_length_wrong":
            pos = pos[torch.argsort(_scores(args)[pos], descending=True)][: len(pos) // 2]  # the best half only
        for dst, src in ((prod, pos), (prev, pos_prev)):
            vals = src.long()
            if p.indices_kind == "slots":  # page-translated through the request's own pages (past its pages: clamp)
                page = (vals // ps).clamp(max=int(npages[b]) - 1)
                vals = table[b, page].long() * ps + vals % ps
            dst[b, : len(vals)] = vals[:K]
    k_cache = _pages(k8, kscale, ps, D) if p.fp8 else kv.reshape(P, ps, D)
    tensors = {"q": q8 if p.fp8 else q, "weights": wt.float(), "k_cache": k_cache, "page_table": table, "seq_lens": seq.int(),
               "indices": prod.int()}  # fmt: skip
    if fault == "topk_stale":
        tensors["prev_indices"] = prev.int()
    meta = {"mode": "indexer", "page_size": ps, "topk": K, "compress_ratio": p.ratio, "indices_kind": p.indices_kind,
            "k_layout": "fp8" if p.fp8 else "bf16", "engine": "synth", "model": model, "layer_id": 3, "tp_rank": 0,
            "step": 7, "rids": [f"r{b}" for b in range(B)]}  # fmt: skip
    return tensors, meta


def _scores(args) -> torch.Tensor:
    q, w, k, ks, L, _ = args
    return ((k[:L] @ q.T).clamp_min(0) * w).sum(1) * ks[:L]


def _pages(k8: torch.Tensor, scale: torch.Tensor, ps: int, D: int) -> torch.Tensor:
    """[P, ps * (D + 4)] uint8: each page's ps x D fp8 values, then its ps fp32 scales."""
    P = k8.shape[0] // ps
    vals = k8.view(torch.uint8).reshape(P, ps * D)
    scales = scale.float().contiguous().view(torch.uint8).reshape(P, ps * 4)
    return torch.cat([vals, scales], dim=1)


__all__ = ["FAULTS", "PRESETS", "Preset", "indexer_call", "synth_indexer"]

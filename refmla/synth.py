"""Synthetic captures: real Kimi-K2 / DeepSeek-V3 shapes, hostile pools, planted faults.

The pool is paged: each request's pages are shuffled across the pool, every row no request
attends (unused pages and the tail of each last page) is NaN, so a kernel that reads past its
metadata shows at once. The capture's ``out`` is what a correct kernel produces (the
low-precision control) unless a fault is planted, in which case it is the reference computed
under that fault -- the kind of wrong a real kernel or a real transfer bug produces.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from refmla import reference as ref
from refmla.capture import write_capture
from refmla.control import mla_control
from refmla.schedule import MIN_BLOCK_KV



def yarn_sm_scale(qk_head_dim: int, factor: float, mscale_all_dim: float = 1.0) -> float:
    """DeepSeek-V3 / Kimi-K2 softmax scale: qk_head_dim**-0.5 * mscale**2 (yarn rope scaling)."""
    mscale = 0.1 * mscale_all_dim * math.log(factor) + 1.0 if factor > 1 else 1.0
    return qk_head_dim**-0.5 * mscale * mscale


# qk_head_dim = qk_nope_head_dim (128) + qk_rope_head_dim (64) for both models
KIMI_K2_SCALE = yarn_sm_scale(192, 32.0)  # rope_scaling factor 32
DEEPSEEK_V3_SCALE = yarn_sm_scale(192, 40.0)  # rope_scaling factor 40


@dataclass
class SynthSpec:
    name: str = "kimi-k2-tp8"
    num_heads: int = 8  # query heads on this rank (Kimi-K2: 64 / TP8)
    seq_lens: tuple = (611, 257, 1024, 33)  # tokens attended per request
    page_size: int = 1
    kv_lora_rank: int = 512
    qk_rope_head_dim: int = 64
    dtype: torch.dtype = torch.bfloat16  # q and out
    kv_dtype: Optional[torch.dtype] = None  # None: same as dtype
    sm_scale: float = KIMI_K2_SCALE
    logit_cap: float = 0.0
    k_scale: float = 1.0
    v_scale: float = 1.0
    num_kv_splits: Optional[tuple] = None  # per request; None: min(max_kv_splits, max(1, L // 128))
    max_kv_splits: int = 16
    new_tokens: int = 0  # > 0: an extend capture with this many new tokens per request
    free_pages: int = 3  # unused, poisoned pages in the pool
    fault_request: int = 2  # the request a per-request fault hits
    seed: int = 0
    extra_meta: dict = field(default_factory=dict)

    def __post_init__(self):
        self.kv_dtype = self.kv_dtype or self.dtype
        if self.num_kv_splits is None:
            self.num_kv_splits = tuple(min(self.max_kv_splits, max(1, L // 128)) for L in self.seq_lens)

    @property
    def head_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim


PRESETS: dict[str, SynthSpec] = {
    "kimi-k2-tp8": SynthSpec(),
    "kimi-k2-tp8-page256": SynthSpec(name="kimi-k2-tp8-page256", page_size=256, seq_lens=(611, 257, 1300, 33)),
    "deepseek-v3-tp8": SynthSpec(name="deepseek-v3-tp8", num_heads=16, sm_scale=DEEPSEEK_V3_SCALE, page_size=64,
                                 seq_lens=(700, 129, 1024, 1)),
    "hostile": SynthSpec(name="hostile", num_heads=4, seq_lens=(37, 1, 0, 300, 64), page_size=16,
                         fault_request=3, seed=7),
    "kimi-k2-tp8-extend": SynthSpec(name="kimi-k2-tp8-extend", seq_lens=(300, 129, 40), new_tokens=3,
                                    fault_request=0),
}  # fmt: skip

FAULTS = (
    "none",
    "seq_len_off_by",  # the kernel attended seq_len - 1 tokens of the fault request
    "kv_range_missing",  # a block of positions of the fault request contributed nothing (dropped)
    "kv_range_zero",  # the same block read as all-zero rows (a KV transfer that had not landed)
    "split_missing",  # one split's partial left out of the merge
    "wrong_sm_scale",  # sm_scale without yarn mscale squared
    "head_misaligned",  # the head-padding slice bug (repeat_interleave to 16, first H taken)
    "logit_cap_mismatch",  # a soft cap applied that the model does not use (or omitted)
)


def preset(name: str, **overrides: Any) -> SynthSpec:
    if name not in PRESETS:
        raise KeyError(f"unknown preset {name!r}; choose from {', '.join(PRESETS)}")
    return dataclasses.replace(PRESETS[name], **overrides)


def make_inputs(spec: SynthSpec) -> dict[str, torch.Tensor]:
    """q, a shuffled poisoned paged pool, and the SGLang metadata for ``spec``."""
    g = torch.Generator().manual_seed(spec.seed)
    B, H, D, P = len(spec.seq_lens), spec.num_heads, spec.head_dim, spec.page_size
    lens = torch.tensor(spec.seq_lens, dtype=torch.int64)  # [B]
    pages_per = (lens + P - 1) // P  # [B]
    n_pages = int(pages_per.sum()) + spec.free_pages
    perm = torch.randperm(n_pages, generator=g)  # page ids handed out in shuffled order
    pool = torch.full((n_pages * P, 1, D), math.nan)  # [N, 1, D] unattended rows stay NaN
    kv_indices, used = [], 0
    for L, npg in zip(lens.tolist(), pages_per.tolist()):
        pages = perm[used : used + npg]
        used += npg
        slots = (pages[:, None] * P + torch.arange(P)[None, :]).reshape(-1)[:L]  # [L]
        pool[slots, 0] = torch.randn(L, D, generator=g)
        kv_indices.append(slots)
    if spec.kv_dtype.itemsize == 1:  # fp8: store value / scale, so dequant recovers it
        pool = pool / spec.k_scale
    kv_buffer = pool.to(spec.kv_dtype)
    kv_indptr = torch.zeros(B + 1, dtype=torch.int32)
    kv_indptr[1:] = torch.cumsum(lens, 0)
    T = B if spec.new_tokens == 0 else spec.new_tokens * B
    q = (torch.randn(T, H, D, generator=g) * 1.0).to(spec.dtype)  # [T, H, D]
    t = {
        "q": q, "kv_buffer": kv_buffer, "kv_indptr": kv_indptr,
        "kv_indices": torch.cat(kv_indices).to(torch.int32), "seq_lens": lens.to(torch.int32),
    }  # fmt: skip
    if spec.new_tokens:
        t["qo_indptr"] = torch.arange(B + 1, dtype=torch.int32) * spec.new_tokens
    else:
        t["num_kv_splits"] = torch.tensor(spec.num_kv_splits, dtype=torch.int32)
    return t


def make_meta(spec: SynthSpec) -> dict[str, Any]:
    return {
        "mode": "extend" if spec.new_tokens else "decode", "backend": "triton",
        "kv_lora_rank": spec.kv_lora_rank, "qk_rope_head_dim": spec.qk_rope_head_dim,
        "sm_scale": spec.sm_scale, "logit_cap": spec.logit_cap, "page_size": spec.page_size,
        "k_scale": spec.k_scale, "v_scale": spec.v_scale, "max_kv_splits": spec.max_kv_splits,
        "layer_id": 0, "tp_rank": 0, "step": 0,
        "rids": [f"{spec.name}-{b}" for b in range(len(spec.seq_lens))],
        "synth": {"preset": spec.name, "seed": spec.seed}, **spec.extra_meta,
    }  # fmt: skip


def faulty_output(spec: SynthSpec, t: dict[str, torch.Tensor], fault: str) -> tuple[torch.Tensor, dict]:
    """The observed `out` under ``fault`` (rounded to spec.dtype) and what was planted."""
    sc = dict(kv_lora_rank=spec.kv_lora_rank, sm_scale=spec.sm_scale, logit_cap=spec.logit_cap,
              k_scale=spec.k_scale, v_scale=spec.v_scale)  # fmt: skip
    q, kvb, indptr, idx = t["q"], t["kv_buffer"], t["kv_indptr"], t["kv_indices"]
    qo = t.get("qo_indptr")
    if fault == "none":
        splits = t.get("num_kv_splits")  # a correct split kernel's rounding points
        out, _ = mla_control(q, kvb, indptr, idx, **sc, out_dtype=spec.dtype, qo_indptr=qo, num_kv_splits=splits)
        return out, {"fault": "none"}

    def run(q=q, kvb=kvb, indptr=indptr, idx=idx, **kw):
        args = {**sc, **kw}
        if qo is None:
            return ref.mla_decode_ref(q, kvb, indptr, idx, **args)[0]
        return ref.mla_extend_ref(q, kvb, indptr, idx, qo, **args)[0]

    r = spec.fault_request
    L = int(indptr[r + 1] - indptr[r])
    planted: dict[str, Any] = {"fault": fault}
    if fault == "seq_len_off_by":
        keep = torch.ones(len(idx), dtype=torch.bool)
        keep[int(indptr[r + 1]) - 1] = False  # the last token of request r
        new_indptr = indptr.clone()
        new_indptr[r + 1 :] -= 1
        out = run(indptr=new_indptr, idx=idx[keep])
        planted.update(request=r, delta=-1)
    elif fault in ("kv_range_missing", "kv_range_zero"):
        unit = spec.page_size if spec.page_size > 1 else MIN_BLOCK_KV
        start, end = unit, min(2 * unit, L - 1)
        if end <= start:
            raise ValueError(f"request {r} (length {L}) is too short for a missing block of {unit}")
        if fault == "kv_range_missing":
            keep = torch.ones(len(idx), dtype=torch.bool)
            keep[int(indptr[r]) + start : int(indptr[r]) + end] = False
            new_indptr = indptr.clone()
            new_indptr[r + 1 :] -= end - start
            out = run(indptr=new_indptr, idx=idx[keep])
        else:
            kvz = kvb.clone()
            kvz[idx[int(indptr[r]) + start : int(indptr[r]) + end].long()] = 0
            out = run(kvb=kvz)
        planted.update(request=r, start=start, end=end)
    elif fault == "split_missing":
        n = t["num_kv_splits"]
        parts, lses, valid = ref.mla_decode_split_ref(q, kvb, indptr, idx, n, **sc)
        if int(valid[r].sum()) < 2:
            raise ValueError(f"request {r} has fewer than 2 non-empty splits")
        valid = valid.clone()
        valid[r, 1] = False
        out, _ = ref.merge_splits(parts, lses, valid)
        planted.update(request=r, split=1)
    elif fault == "wrong_sm_scale":
        ratio = (192**-0.5) / spec.sm_scale  # the scale without yarn mscale squared
        out = run(sm_scale=spec.sm_scale * ratio)
        planted.update(ratio=ratio)
    elif fault == "head_misaligned":
        H = spec.num_heads
        if H < 16:
            mapping = torch.arange(H).repeat_interleave(16 // H)[:H]  # padded, then sliced [:H]
        else:
            mapping = torch.arange(H).roll(1)
        out = run()[:, mapping]
        planted.update(mapping=mapping.tolist())
    elif fault == "logit_cap_mismatch":
        cap = 0.0 if spec.logit_cap > 0 else 30.0
        out = run(logit_cap=cap)
        planted.update(logit_cap=cap)
    else:
        raise KeyError(f"unknown fault {fault!r}; choose from {', '.join(FAULTS)}")
    return out.to(spec.dtype), planted


def synth_capture(path: Any, spec: SynthSpec, fault: str = "none") -> dict:
    """Write a synthetic capture to ``path``; returns what was planted."""
    t = make_inputs(spec)
    out, planted = faulty_output(spec, t, fault)
    t["out"] = out
    meta = make_meta(spec)
    meta["synth"]["fault"] = planted
    write_capture(path, t, meta, compact=False)  # keep the poisoned rows: that is the point
    return planted

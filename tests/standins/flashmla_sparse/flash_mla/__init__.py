"""Stand-in for FlashMLA's sparse decode entry (``flash_mla`` / ``sgl_kernel.flash_mla`` /
vLLM's ``third_party.flashmla.flash_mla_interface``), written from the real interface: the same
``get_mla_metadata`` (an empty FlashMLASchedMeta, filled on the first call) and the same
``flash_mla_with_kvcache`` signature, asserting what the real one asserts (num_splits None, not
causal with indices, the sched meta's type), answering with a plain per-row loop over the V4
"MODEL1" bytes (584 per token, block-split pages: data rows, then scale rows of 7 UE8M0 bytes),
decoded here, not by refmla. Returns out [B, S, H, Dv] in q's dtype and lse [B, H, S] fp32."""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch

CALLS: list[dict] = []


@dataclasses.dataclass
class FlashMLASchedMeta:
    have_initialized: bool = False


def get_mla_metadata(*args, **kwargs):
    return FlashMLASchedMeta(), None


def _token(cache: torch.Tensor, t: int) -> torch.Tensor:
    """Token t of a V4 cache [P, page, 1, 584] viewed over its pages: 512 fp64 values."""
    pages = cache.reshape(cache.shape[0], -1)  # [P, page * 584] (the data rows, then the scale rows)
    page = cache.shape[1]
    p, s = divmod(int(t), page)
    data = pages[p, s * 576 : s * 576 + 576]
    nope = data[:448].view(torch.float8_e4m3fn).to(torch.float64)
    rope = data[448:].contiguous().view(torch.bfloat16).to(torch.float64)
    exps = pages[p, page * 576 + s * 8 : page * 576 + s * 8 + 7].to(torch.float64)
    nope = nope * torch.pow(2.0, exps - 127.0).repeat_interleave(64)
    return torch.cat([nope, rope])


def flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata,
                           num_splits=None, softmax_scale: Optional[float] = None, causal: bool = False,
                           is_fp8_kvcache: bool = False, indices=None, attn_sink=None, extra_k_cache=None,
                           extra_indices_in_kvcache=None, topk_length=None, extra_topk_length=None, out=None,
                           enable_batch_invariant: bool = False):
    assert isinstance(tile_scheduler_metadata, FlashMLASchedMeta), "tile_scheduler_metadata must be of type FlashMLASchedMeta"
    assert num_splits is None, "num_splits must be None"
    assert indices is None or not causal, "causal must be False when indices_in_kvcache is not None"
    assert k_cache.shape[-1] == 584 and k_cache.dtype == torch.uint8, "this stand-in reads the V4 layout only"
    tile_scheduler_metadata.have_initialized = True
    CALLS.append({"q": tuple(q.shape), "indices": indices.dtype, "extra": extra_k_cache is not None})
    B, S, H, D = q.shape
    scale = softmax_scale if softmax_scale is not None else D**-0.5
    o = torch.zeros(B, S, H, head_dim_v, dtype=torch.float64)
    lse = torch.zeros(B, H, S, dtype=torch.float64)
    for b in range(B):
        for s in range(S):
            keys = []
            for cache, idx, ln in ((k_cache, indices, topk_length), (extra_k_cache, extra_indices_in_kvcache, extra_topk_length)):
                if cache is None:
                    continue
                row = idx[b, s].tolist()
                n = len(row) if ln is None else int(ln[b])
                keys += [_token(cache, t) for t in row[:n] if t != -1]
            for h in range(H):
                if not keys:
                    lse[b, h, s] = math.inf
                    continue
                qv = q[b, s, h].double()
                logits = [scale * float(k @ qv) for k in keys]
                m = max(logits)
                w = [math.exp(x - m) for x in logits]
                z = sum(w)
                acc = sum(wi * k[:head_dim_v] for wi, k in zip(w, keys))
                denom = z + (math.exp(float(attn_sink[h]) - m) if attn_sink is not None else 0.0)
                o[b, s, h] = acc / denom
                lse[b, h, s] = m + math.log(z)
    return o.to(q.dtype), lse.float()

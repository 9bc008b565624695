"""Indexer calls made by code that is not refmla's, for the indexer's tests.

* fp8 (V3.2 and V4 C4 shapes): SGLang's own code, imported from the installed SGLang at run time:
  the cache built by ``fp8_mqa_logits_make_fused_kv`` (DeepGEMM's paged layout: a page's 64 x 128
  fp8 values, then its 64 fp32 scales) with scales from ``fp8_mqa_logits_ceil_to_ue8m0``, the
  logits by ``fp8_paged_mqa_logits_torch`` (the torch path ``SGLANG_FP8_PAGED_MQA_LOGITS_TORCH``
  selects), the indices by ``topk_transform_pytorch_vectorized`` (slots and raw positions);
* bf16 and the planted math mistakes: a small producer written from DeepSeek-V3.2-Exp's published
  ``inference/model.py`` Indexer.forward: ``index_score = relu(q . k) * weights`` summed over the
  index heads (``weights = weights_proj(x) * n_heads**-0.5 * softmax_scale``), then ``topk``.

Faults are planted here, on the produced positions, before they are written as slots or positions.
"""

from __future__ import annotations

import math

import torch

from helpers import raw_write

PS, D = 64, 128


def sglang():
    """(utils, indexer) modules of the installed SGLang (imported once; skip the test if they cannot be)."""
    import pytest

    from refmla.backends.cpu_compat import torchvision_cpu_shim

    torchvision_cpu_shim()
    try:
        from sglang.srt.layers.attention.dsa import utils
        from sglang.srt.layers.attention.dsv4 import indexer
    except Exception as e:  # pragma: no cover - the engine is installed in this project's venv
        pytest.skip(f"SGLang's indexer not importable here: {type(e).__name__}: {e}")
    return utils, indexer


def call(seq_lens, ratio=1, topk=256, heads=64, seed=0, bf16=False, kind="slots", fault="none", pages=None):
    """(tensors, meta) of one decode call of the indexer; ``fault`` planted (module docstring);
    ``pages``: (page table [B, M], page count) to use instead of shuffled pages of its own."""
    g = torch.Generator().manual_seed(seed)
    B = len(seq_lens)
    n = torch.tensor([s // ratio for s in seq_lens])  # entries the indexer scores
    npages = [math.ceil(int(x) / PS) + 1 for x in n]  # a spare page each: keys past the bound exist
    P = sum(npages)
    perm = torch.randperm(P, generator=g)
    table = torch.full((B, max(npages)), -1, dtype=torch.int32)
    at = 0
    for b, c in enumerate(npages):
        table[b, :c] = perm[at : at + c].int()
        at += c
    if pages is not None:
        table, P = pages
    kv = torch.randn(P, PS, D, generator=g) * (0.5 + 3 * torch.rand(P, PS, 1, generator=g))
    q = torch.randn(B, heads, D, generator=g)
    w_raw = torch.randn(B, heads, generator=g)
    w = w_raw * heads**-0.5 * D**-0.5
    if bf16:
        kb, qb = kv.to(torch.bfloat16), q.to(torch.bfloat16)
        logits = [_deepseek(qb[b].float(), w[b], _rows(kb.float(), table[b], int(n[b])), torch.ones(int(n[b])), fault)
                  for b in range(B)]  # fmt: skip
        tensors = {"q": qb, "weights": w.float(), "k_cache": kb}
    else:
        utils, ind = sglang()
        amax = kv.abs().amax(-1, keepdim=True).clamp(1e-4)
        ks = utils.fp8_mqa_logits_ceil_to_ue8m0(amax / 448.0).squeeze(-1)  # [P, PS]
        k8 = (kv / ks[..., None]).to(torch.float8_e4m3fn)
        fused = utils.fp8_mqa_logits_make_fused_kv(k8, ks, PS, D)  # [P, PS, 1, D + 4] uint8
        qs = utils.fp8_mqa_logits_ceil_to_ue8m0(q.abs().amax(-1).clamp(1e-4) / 448.0)  # [B, H]
        q8 = (q / qs[..., None]).to(torch.float8_e4m3fn)
        wf = (w * qs).float()  # q's scale folded into the weights, as SGLang's indexer does
        if fault in ("indexer_relu_omitted", "indexer_weights_ignored"):
            logits = [_deepseek(q8[b].float(), wf[b], _rows(k8.float(), table[b], int(n[b])),
                                _rows(ks[..., None], table[b], int(n[b]))[:, 0], fault) for b in range(B)]  # fmt: skip
        else:
            cache = fused.clone()
            if fault == "indexer_scale_not_applied":  # the scale bytes read as 1.0
                cache.view(P, -1)[:, PS * D :] = torch.ones(P, PS).view(torch.uint8)
            full = ind.fp8_paged_mqa_logits_torch(q8[:, None], cache, wf, n.int(), table.clamp(min=0), None,
                                                  table.shape[1] * PS, clean_logits=False)  # fmt: skip
            logits = [full[b, : int(n[b])] for b in range(B)]
        tensors = {"q": q8, "weights": wf, "k_cache": fused.reshape(P, -1)}
    pos = [_topk(s, topk) for s in logits]
    prev = None
    if fault == "topk_stale":  # the previous step's query over one entry fewer
        q2 = torch.randn(B, heads, D, generator=g)
        prev = [_topk(torch.einsum("hd,nd->n", q2[b], _rows(kv, table[b], int(n[b]) - 1)), topk) for b in range(B)]
        pos = prev
    pos = [_plant(p, fault, int(n[b]), ratio, logits[b]) for b, p in enumerate(pos)]
    tensors.update(page_table=table, seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
                   indices=_write(pos, table, topk, kind))  # fmt: skip
    if prev is not None:
        tensors["prev_indices"] = _write(prev, table, topk, kind)
    meta = {"mode": "indexer", "page_size": PS, "topk": topk, "compress_ratio": ratio, "indices_kind": kind,
            "k_layout": "bf16" if bf16 else "fp8", "engine": "sglang", "layer_id": 5, "tp_rank": 0, "step": 11,
            "rids": [f"req{b}" for b in range(B)]}  # fmt: skip
    return tensors, meta


def write(path, seq_lens, **kw):
    tensors, meta = call(seq_lens, **kw)
    raw_write(path, tensors, meta)
    return tensors, meta


def _rows(cache, pages, L):
    """The first L entries of a request whose pages are ``pages``: cache [P, PS, ...] -> [L, ...]."""
    return cache[pages[pages >= 0].long()].reshape(-1, *cache.shape[2:])[:L]


def _deepseek(q, w, k, ks, fault):
    """DeepSeek's Indexer: sum over heads of weight * relu(q . k), times the key's scale; [L]."""
    score = k @ q.T  # [L, H]
    if fault != "indexer_relu_omitted":
        score = score.relu()
    if fault != "indexer_weights_ignored":
        score = score * w
    return score.sum(-1) * ks


def _topk(s, k):
    """SGLang's rule: every entry in order when there are no more than k, else torch.topk's."""
    return torch.arange(s.numel()) if s.numel() <= k else torch.topk(s, k).indices


def _plant(p, fault, L, ratio, s):
    if fault == "topk_unwritten":
        return p[:0]
    if fault == "topk_future":
        p = p.clone()
        p[:3] = torch.arange(L, L + 3)
    if fault == "topk_off_by":
        return p + 1
    if fault == "compress_ratio_wrong":
        return p * ratio
    if fault == "topk_length_wrong":
        return p[torch.argsort(s[p], descending=True)][: len(p) // 2]
    return p


def _write(pos, table, topk, kind):
    out = torch.full((len(pos), topk), -1, dtype=torch.int32)
    for b, p in enumerate(pos):
        p = p.long()[:topk]
        if kind == "slots":  # SGLang's topk_transform: the page-translated slot
            p = table[b, (p // PS).clamp(max=table.shape[1] - 1)].long() * PS + p % PS
        out[b, : len(p)] = p.int()
    return out

"""The inputs of a synthetic capture: q, a shuffled paged pool poisoned with NaN, SGLang's metadata, the meta."""

from __future__ import annotations

import math
from typing import Any

import torch

from refmla.attended import tree_visibility
from refmla.synthetic.spec import SynthSpec


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
    per = spec.draft_token_num or spec.new_tokens  # query tokens per request (0: decode)
    T = B if per == 0 else per * B
    q = (torch.randn(T, H, D, generator=g) * 1.0).to(spec.dtype)  # [T, H, D]
    t = {
        "q": q, "kv_buffer": kv_buffer, "kv_indptr": kv_indptr,
        "kv_indices": torch.cat(kv_indices).to(torch.int32), "seq_lens": lens.to(torch.int32),
    }  # fmt: skip
    if per:
        t["qo_indptr"] = torch.arange(B + 1, dtype=torch.int32) * per
    else:
        t["num_kv_splits"] = torch.tensor(spec.num_kv_splits, dtype=torch.int32)
    if spec.draft_token_num and spec.topk > 1:
        t["custom_mask"], t["mask_indptr"] = tree_mask(spec, g)
    return t


def tree_parents(n: int, topk: int, g: torch.Generator) -> list[int]:
    """A draft tree of n tokens: token 0 the verified root, each later token a child of an earlier
    one with at most ``topk`` children per node (EAGLE's shape), drawn from ``g``."""
    parents, children = [-1], [0] * n
    for i in range(1, n):
        open_nodes = [j for j in range(i) if children[j] < topk]
        j = open_nodes[int(torch.randint(len(open_nodes), (1,), generator=g))]
        parents.append(j)
        children[j] += 1
    return parents


def tree_mask(spec: SynthSpec, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """SGLang's layout: request b's row-major [n, L_b] bool mask (prefix all True, draft i sees its
    ancestors and itself), flattened and concatenated; mask_indptr [B + 1] int32."""
    n, parts = spec.draft_token_num, []
    for L in spec.seq_lens:
        parts.append(tree_visibility(L, tree_parents(n, spec.topk, g)).reshape(-1))
    sizes = torch.tensor([n * L for L in spec.seq_lens], dtype=torch.int64)
    indptr = torch.zeros(len(sizes) + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(sizes, 0)
    return torch.cat(parts), indptr


def geometry_meta(spec: SynthSpec) -> dict[str, Any]:
    """The production pool's geometry as the hook records it (MLATokenToKVPool: one buffer per layer
    of max_total_num_tokens + page_size rows of head_dim elements)."""
    return {
        "kv_pool_rows": spec.pool_tokens + spec.page_size, "kv_pool_row_bytes": spec.head_dim * spec.kv_dtype.itemsize,
        "kv_pool_layers_per_buffer": 1, "kv_pool_layers": spec.pool_layers, "kv_pool_size": spec.pool_tokens,
    }  # fmt: skip


def make_meta(spec: SynthSpec) -> dict[str, Any]:
    verify = {"draft_token_num": spec.draft_token_num, "topk": spec.topk} if spec.draft_token_num else {}
    return {**geometry_meta(spec),
        "mode": "verify" if spec.draft_token_num else "extend" if spec.new_tokens else "decode", "backend": "triton",
        "kv_lora_rank": spec.kv_lora_rank, "qk_rope_head_dim": spec.qk_rope_head_dim,
        "sm_scale": spec.sm_scale, "logit_cap": spec.logit_cap, "page_size": spec.page_size,
        "k_scale": spec.k_scale, "v_scale": spec.v_scale, "max_kv_splits": spec.max_kv_splits,
        "layer_id": 0, "tp_rank": 0, "step": 0,
        "rids": [f"{spec.name}-{b}" for b in range(len(spec.seq_lens))],
        "synth": {"preset": spec.name, "seed": spec.seed}, **verify, **spec.extra_meta,
    }  # fmt: skip

"""A sparse top-k MLA decode in plain PyTorch (DeepSeek V3.2 DSA / V4), as one starts a new kernel.

For each query row (request b, query token s) it gathers the entries its top-k lists name in each
cache (the main one and, on a V4 compressed layer, the extra one): an entry is read when it is
not -1 and stands before the request's topk_length. Then one softmax pass over them:

    keys   the decoded cache rows (inputs.k_values) rounded to bf16 (exact: fp8 x a power of two)
    s      q . k in fp32, times softmax_scale                      [H, n]
    p      exp(s - max) in fp32; l = sum p (+ exp(sink - max) when the layer has a sink)
    out    (p rounded to bf16) . V in fp32, / l, stored bf16        [H, Dv]
    lse    max + ln(sum p)  (the sink not included; +inf on a row with no entry, whose out is 0)

Those are the rounding points SGLang's Triton sparse kernel has, so it declares that arithmetic
(refmla.sparse.arithmetic.SGLANG_TRITON_SPARSE).
"""

from __future__ import annotations

import torch

from refmla.kernel import KernelOutputs, SparseKernelInputs, declare
from refmla.sparse.arithmetic import SGLANG_TRITON_SPARSE


def entries(indices: torch.Tensor, lengths, b: int, s: int) -> torch.Tensor:
    """The flat token indices request b's query token s reads in one cache (its top-k list [K])."""
    listed = indices[b, s].long()  # [K], -1: no entry
    read = listed >= 0
    if lengths is not None:
        read &= torch.arange(listed.shape[0], device=listed.device) < lengths[b]  # entries past topk_length are stale
    return listed[read]


@declare(layout="sparse_topk", arithmetic=SGLANG_TRITON_SPARSE)
def sparse_decode(inp: SparseKernelInputs) -> KernelOutputs:
    """refmla.kernel's sparse interface: out [B, S, H, Dv] bf16 and lse [B, S, H] (natural log)."""
    B, S, H, D = inp.q.shape
    Dv = inp.head_dim_v
    out = torch.zeros(B, S, H, Dv, dtype=torch.float32, device=inp.device)
    lse = torch.full((B, S, H), float("inf"), dtype=torch.float32, device=inp.device)
    caches = [(inp.indices, inp.topk_length, inp.k_values)]
    if inp.extra_k_values is not None:
        caches.append((inp.extra_indices, inp.extra_topk_length, inp.extra_k_values))
    for b in range(B):
        for s in range(S):
            keys = torch.cat([values[entries(idx, lengths, b, s)] for idx, lengths, values in caches])  # [n, D]
            if keys.shape[0] == 0:
                continue  # a row with no entry: out 0, lse +inf
            keys = keys.to(torch.bfloat16).float()
            logits = inp.q[b, s].float() @ keys.T * inp.softmax_scale  # [H, n]
            m = logits.amax(dim=-1)  # [H]
            p = torch.exp(logits - m[:, None])
            l = p.sum(dim=-1)
            denom = l if inp.attn_sink is None else l + torch.exp(inp.attn_sink - m)
            out[b, s] = (p.to(torch.bfloat16).float() @ keys[:, :Dv]) / denom[:, None]
            lse[b, s] = m + torch.log(l)
    return KernelOutputs(out=out.to(torch.bfloat16), lse=lse)


__all__ = ["sparse_decode"]

"""The local extend in pure PyTorch, at the rounding points of SGLang's extend kernel."""

from __future__ import annotations

import math

import torch

from refmla import reference as ref
from refmla.backends.base import BackendUnavailable
from refmla.backends.extend.inputs import ExtendInputs
from refmla.scales import Scales

# The local extend holds one request's prefix whole (as stored, and twice in fp32) and its [n, H, Lp]
# logits and probabilities in fp32: past this many bytes it is skipped with the figure, so a capture
# whose indices all name one row (a long sequence from a tiny pool) cannot ask for gigabytes here.
LOCAL_EXTEND_BUDGET = 1 << 30


def working_set(inp: ExtendInputs, kv_buffer: torch.Tensor) -> tuple[int, int]:
    """(bytes, request) of the largest per-request working set of :func:`mla_extend_local`."""
    D, item, H = kv_buffer.shape[-1], kv_buffer.element_size(), inp.q_extend.shape[1]
    worst = (0, 0)
    for b in range(len(inp.qo_indptr) - 1):
        n, Lp = int(inp.qo_indptr[b + 1] - inp.qo_indptr[b]), int(inp.prefix_rows(b).shape[0])
        need = Lp * D * (item + 2 * 4) + 4 * n * H * Lp * 4  # prefix stored + 2 fp32 copies; s, p, p rounded, p fp32
        worst = max(worst, (need, b))
    return worst


def mla_extend_local(
    inp: ExtendInputs, kv_buffer: torch.Tensor, sc: Scales, out_dtype: torch.dtype = torch.bfloat16
) -> tuple[torch.Tensor, torch.Tensor]:
    """Extend attention as SGLang's extend kernel rounds it: out [T, H, Dv] out_dtype, lse [T, H] fp32.

    Prefix logits ``q.to(K dtype) . K_cache`` (fp32 accumulation) times sm_scale * k_scale; new-token
    logits ``q . k_extend`` times sm_scale (k_extend is already dequantized); soft cap; one softmax
    over both, causal for the new tokens; probabilities rounded to each V's dtype before P.V, fp32
    sums from the unrounded probabilities; prefix P.V times v_scale; output rounded to out_dtype.
    """
    need, b = working_set(inp, kv_buffer)
    if need > LOCAL_EXTEND_BUDGET:
        raise BackendUnavailable(
            f"the local torch extend would hold {need / 2**30:.1f} GiB for request {b}'s prefix "
            f"({int(inp.prefix_rows(b).shape[0]):,} rows), past its budget {LOCAL_EXTEND_BUDGET / 2**30:.0f} GiB; "
            "the reference and the decode kernels judge this capture"
        )
    f32, Dv = torch.float32, int(sc.kv_lora_rank)
    sm_scale, logit_cap, k_scale, v_scale = sc.sm_scale, sc.logit_cap, sc.k_scale, sc.v_scale
    T, H, _ = inp.q_extend.shape
    out = torch.zeros(T, H, Dv, dtype=out_dtype)  # [T, H, Dv]
    lse = torch.full((T, H), -math.inf, dtype=f32)  # [T, H]
    for b in range(len(inp.qo_indptr) - 1):
        t0, t1 = int(inp.qo_indptr[b]), int(inp.qo_indptr[b + 1])
        if t1 == t0:
            continue
        n = t1 - t0
        q = inp.q_extend[t0:t1]  # [n, H, D]
        pre = ref.gather(kv_buffer, inp.prefix_rows(b), kv_buffer.dtype)  # [Lp, D]
        k_new, v_new = inp.k_extend[t0:t1, 0], inp.v_extend[t0:t1, 0]  # [n, D], [n, Dv]
        s_pre = torch.einsum("thd,ld->thl", q.to(pre.dtype).to(f32), pre.to(f32)) * (sm_scale * k_scale)  # [n, H, Lp]
        s_new = torch.einsum("thd,ld->thl", q.to(f32), k_new.to(f32)) * sm_scale  # [n, H, n]
        if logit_cap > 0:
            s_pre = logit_cap * torch.tanh(s_pre / logit_cap)
            s_new = logit_cap * torch.tanh(s_new / logit_cap)
        # token i sees new tokens 0..i, or (verify) the tree mask's draft columns; prefix columns: all, as the kernel
        causal = inp.new_token_visibility(b)  # [n, n]
        s_new = s_new.masked_fill(~causal[:, None, :], -math.inf)
        m = torch.maximum(
            s_pre.amax(-1) if s_pre.shape[-1] else torch.full((n, H), -math.inf), s_new.amax(-1)
        )  # [n, H]
        p_pre, p_new = torch.exp(s_pre - m[..., None]), torch.exp(s_new - m[..., None])  # fp32
        denom = p_pre.sum(-1) + p_new.sum(-1)  # [n, H] from unrounded probabilities
        acc = torch.einsum("thl,lv->thv", p_pre.to(pre.dtype).to(f32), pre[:, :Dv].to(f32)) * v_scale
        acc = acc + torch.einsum("thl,lv->thv", p_new.to(v_new.dtype).to(f32), v_new.to(f32))  # [n, H, Dv]
        out[t0:t1] = (acc / denom[..., None]).to(out_dtype)
        lse[t0:t1] = m + torch.log(denom)
    return out, lse


__all__ = ["LOCAL_EXTEND_BUDGET", "mla_extend_local", "working_set"]

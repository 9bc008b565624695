"""Benign variants: correct kernels that are not the one the control imitates. Each must pass.

The capture's ``out`` is computed by a correct kernel that rounds its own way; replay must
answer ``agree`` (exit 0). Registered as faults with ``expect=None`` so ``refmla synth --fault``
can write them and tools/bench_diagnosis.py counts any divergence as a false alarm.

    benign_splits_N      SGLang's Triton rounding points (refmla.control) with N splits per
                         request instead of the production num_kv_splits (the capture keeps the
                         production count): a kernel build that picks another split count.
                         N = 1 .. 16 (SGLang's default max_kv_splits); n/a above the capture's.
    benign_fp32_einsum   aiter's own torch reference style (op_tests/test_mla.py, torch_mla_extend):
                         rows gathered as stored, per request an fp32 einsum, a causal bias,
                         logsumexp, softmax, fp32 einsum with V, one rounding to the output dtype.
    benign_flex          PyTorch's flex_attention compiled by Inductor (refmla.backends.flex):
                         an independent compiled kernel, bf16 in, fp32 softmax statistics.
"""

from __future__ import annotations

import torch

from refmla.backends.flex import FlexBackend, run_flex_mla
from refmla.control import control_output
from refmla.scales import Scales
from refmla.synthetic.faults import Planting, fault

MAX_SPLITS = 16  # SGLang's default max_kv_splits


def _splits(n: int):
    def plant(p: Planting):
        t = p.t
        if t.get("qo_indptr") is not None:
            raise ValueError("an extend capture has no split-KV schedule")
        if n > p.spec.max_kv_splits:
            raise ValueError(f"{n} splits > the capture's max_kv_splits {p.spec.max_kv_splits}")
        splits = torch.full_like(t["num_kv_splits"], n)  # [B]; the capture keeps its own
        out, _ = control_output(t["q"], t["kv_buffer"], p.att, p.scales, p.spec.dtype, splits)
        return out, {"num_kv_splits": n}

    return plant


for _n in range(1, MAX_SPLITS + 1):
    fault(f"benign_splits_{_n}", f"correct: the control's rounding with {_n} split(s) per request", expect=None)(
        _splits(_n)
    )


def fp32_einsum(q, kv_buffer, kv_indptr, kv_indices, qo_indptr, sc: Scales, out_dtype=torch.bfloat16) -> torch.Tensor:
    """aiter's torch reference, written its way: out [T, H, Dv] in out_dtype.

    Every request's rows gathered at once as stored, split per request; per request an fp32 einsum
    over all 576 dims, a causal bias (bottom-right: the n new tokens are the last n positions),
    logsumexp, softmax and an fp32 einsum with V (the first kv_lora_rank dims). A peer's own
    formulation: it reads kv_indptr / qo_indptr itself, on purpose (not refmla.attended).
    """
    kv_lora_rank, sm_scale, logit_cap, k_scale, v_scale = sc.kv_lora_rank, sc.sm_scale, sc.logit_cap, sc.k_scale, sc.v_scale
    T = q.shape[0]
    qo = torch.arange(T + 1) if qo_indptr is None else qo_indptr.long()
    rows = kv_buffer.index_select(0, kv_indices[: int(kv_indptr[-1])].long())  # [nnz, 1, D] as stored
    per_request = torch.tensor_split(rows, kv_indptr[1:-1].tolist())  # B x [L, 1, D]
    queries = torch.tensor_split(q, qo[1:-1].tolist())  # B x [n, H, D]
    outs = []
    for qb, kv in zip(queries, per_request):
        k = kv.float() * k_scale  # [L, 1, D]
        v = kv[..., :kv_lora_rank].float() * v_scale  # [L, 1, Dv]
        s = torch.einsum("qhd,khd->hqk", qb.float(), k) * sm_scale  # [H, n, L]
        if logit_cap > 0:
            s = logit_cap * torch.tanh(s / logit_cap)
        n_q, n_k = qb.shape[0], kv.shape[0]
        keep = torch.ones(n_q, n_k, dtype=torch.bool).tril(diagonal=n_k - n_q)  # [n, L] causal
        s = s + torch.zeros(n_q, n_k).masked_fill(~keep, float("-inf"))  # [H, n, L]
        p = torch.softmax(s, dim=-1)  # [H, n, L]
        outs.append(torch.einsum("hqk,khd->qhd", p, v).to(out_dtype))  # [n, H, Dv]
    return torch.cat(outs)  # [T, H, Dv]


@fault("benign_fp32_einsum", "correct: aiter's torch reference style (fp32 einsum per request)", expect=None)
def _fp32_einsum(p: Planting):
    t = p.t
    _causal_only(t, "aiter's torch reference")
    out = fp32_einsum(t["q"], t["kv_buffer"], t["kv_indptr"], t["kv_indices"], t.get("qo_indptr"), p.scales, p.spec.dtype)
    return out, {}


@fault("benign_flex", "correct: PyTorch flex_attention compiled by Inductor (bf16), refmla.backends.flex",
       expect=None)  # fmt: skip
def _flex(p: Planting):
    ok, why = FlexBackend().availability()
    if not ok:
        raise ValueError(f"flex_attention cannot run here: {why}")
    t = p.t
    _causal_only(t, "the flex backend")
    out, _, info = run_flex_mla(t["q"], t["kv_buffer"], p.att, p.scales, p.spec.dtype, "cpu")
    return out, {"torch_version": info["torch_version"]}


def _causal_only(t: dict, who: str) -> None:
    """A tree verify capture (custom_mask) is outside what a causal-only kernel computes."""
    if t.get("custom_mask") is not None:
        raise ValueError(f"{who} is causal only: it takes no tree custom_mask")

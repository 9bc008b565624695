"""A split-KV MLA decode in Triton over a vLLM-style block table, as one starts a new kernel.

    rows     query row r belongs to request b = row_req[r] and sees its first L = row_len[r]
             positions: decode, one row a request, L = seq_lens[b]; verify (qlen > 1, causal),
             query i of request b's n sees L = seq_lens[b] - n + i + 1
    stage 1  grid (R, head blocks, S): split s of row r attends positions
             [s * per, min((s + 1) * per, L)), per = ceil(ceil(L / n_b) / 32) * 32 (SGLang's
             schedule, n_b = num_kv_splits[b]); position j is pool row block_table[b, j // P] * P + j % P;
             the split's normalized partial -> attn_logits [R, H, S, Dv] and its lse (ln) -> attn_lse [R, H, S]
    stage 2  grid (R, head blocks): the non-empty splits merged -> out [R, H, Dv] (times v_scale)
             and lse [R, H] (ln)

Everything is computed in fp32 (q . k and p . v with IEEE fp32 dots, the softmax in base 2);
an fp8 pool is upcast, k_scale applied to the logits and v_scale to the output.
On a CPU it runs in the Triton interpreter (TRITON_INTERPRET=1).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from refmla.arithmetic import Arithmetic
from refmla.kernel import KernelInputs, KernelOutputs, declare

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
BLOCK_H = 16  # heads per program (tl.dot wants >= 16 rows)
BLOCK_N = 16  # positions per step


@triton.jit
def _split_len(L, n):
    return tl.cdiv(tl.cdiv(L, n), 32) * 32  # SGLang's split length: a multiple of 32 tokens


@triton.jit
def _stage1(Q, KV, BT, ROW_REQ, ROW_LEN, SPLITS, PART, PLSE, stride_qb, stride_qh, stride_kv, stride_bt, stride_pb, stride_ph,
            stride_ps, stride_lb, stride_lh, sm_scale, k_scale, logit_cap, H, M, P: tl.constexpr,
            DV: tl.constexpr, DR: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_DR: tl.constexpr,
            BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, CAP: tl.constexpr):  # fmt: skip
    r, hb, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, L = tl.load(ROW_REQ + r), tl.load(ROW_LEN + r)  # its request, the positions it sees
    per = _split_len(L, tl.load(SPLITS + b))
    start = s * per
    end = tl.minimum(start + per, L)
    if start < end:
        heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
        hmask = heads < H
        dv, dr = tl.arange(0, BLOCK_DV), tl.arange(0, BLOCK_DR)
        q_row = Q + r * stride_qb + heads[:, None] * stride_qh
        q_lat = tl.load(q_row + dv[None, :], mask=hmask[:, None] & (dv[None, :] < DV), other=0.0).to(tl.float32)
        q_pe = tl.load(q_row + DV + dr[None, :], mask=hmask[:, None] & (dr[None, :] < DR), other=0.0).to(tl.float32)
        m = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)
        for pos0 in range(start, end, BLOCK_N):
            pos = pos0 + tl.arange(0, BLOCK_N)
            pmask = pos < end
            entry = pos // P  # the block-table entry of each position
            page = tl.load(BT + b * stride_bt + entry, mask=pmask & (entry < M), other=0)
            row = page.to(tl.int64) * P + pos % P
            k_row = KV + row[:, None] * stride_kv
            k_lat = tl.load(k_row + dv[None, :], mask=pmask[:, None] & (dv[None, :] < DV), other=0.0).to(tl.float32)
            k_pe = tl.load(k_row + DV + dr[None, :], mask=pmask[:, None] & (dr[None, :] < DR), other=0.0).to(tl.float32)
            qk = tl.dot(q_lat, tl.trans(k_lat), input_precision="ieee")
            qk += tl.dot(q_pe, tl.trans(k_pe), input_precision="ieee")
            qk = qk * (sm_scale * k_scale)  # [BLOCK_H, BLOCK_N] scaled logits
            if CAP:
                qk = logit_cap * (2.0 * tl.sigmoid(2.0 * qk / logit_cap) - 1.0)  # cap * tanh(qk / cap)
            qk = tl.where(pmask[None, :], qk * LOG2E, float("-inf"))  # base 2 from here
            m_new = tl.maximum(m, tl.max(qk, 1))
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(qk - m_new[:, None])
            l = l * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p, k_lat, input_precision="ieee")  # V = the latent part
            m = m_new
        part = PART + r * stride_pb + heads[:, None] * stride_ph + s * stride_ps + dv[None, :]
        tl.store(part, acc / l[:, None], mask=hmask[:, None] & (dv[None, :] < DV))
        tl.store(PLSE + r * stride_lb + heads * stride_lh + s, (m + tl.log2(l)) * LN2, mask=hmask)


@triton.jit
def _stage2(PART, PLSE, ROW_REQ, ROW_LEN, SPLITS, OUT, LSE, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob,
            stride_oh, stride_eb, v_scale, H, DV: tl.constexpr, BLOCK_DV: tl.constexpr,
            BLOCK_H: tl.constexpr):  # fmt: skip
    r, hb = tl.program_id(0), tl.program_id(1)
    b, L = tl.load(ROW_REQ + r), tl.load(ROW_LEN + r)
    n = tl.load(SPLITS + b)
    per = _split_len(L, n)
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < H
    dv = tl.arange(0, BLOCK_DV)
    dmask = hmask[:, None] & (dv[None, :] < DV)
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)
    for s in range(0, n):
        if s * per < L:  # the split holds positions
            lse = tl.load(PLSE + r * stride_lb + heads * stride_lh + s, mask=hmask, other=0.0) * LOG2E
            part = tl.load(PART + r * stride_pb + heads[:, None] * stride_ph + s * stride_ps + dv[None, :],
                           mask=dmask, other=0.0)  # fmt: skip
            m_new = tl.maximum(m, lse)
            alpha = tl.exp2(m - m_new)
            w = tl.exp2(lse - m_new)
            acc = acc * alpha[:, None] + w[:, None] * part
            l = l * alpha + w
            m = m_new
    out = acc / l[:, None] * v_scale
    tl.store(OUT + r * stride_ob + heads[:, None] * stride_oh + dv[None, :], out.to(OUT.dtype.element_ty), mask=dmask)
    tl.store(LSE + r * stride_eb + heads, (m + tl.log2(l)) * LN2, mask=hmask)


def rows_of(inp: KernelInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """(row_req [R], row_len [R]) int32: each query row's request and the positions it sees."""
    B = inp.seq_lens.shape[0]
    if inp.mode == "decode":
        return torch.arange(B, dtype=torch.int32, device=inp.device), inp.seq_lens
    qo = inp.qo_indptr.long()
    n = qo[1:] - qo[:-1]  # [B] query tokens per request
    req = torch.repeat_interleave(torch.arange(B, device=inp.device), n)  # [R]
    i = torch.arange(req.shape[0], device=inp.device) - qo[req]  # the row's place among its request's queries
    return req.to(torch.int32), (inp.seq_lens.long()[req] - n[req] + i + 1).to(torch.int32)  # causal


# decode and a causal verify (qlen > 1); a tree verify (custom_mask) is not implemented: refmla skips it
@declare(layout="block_table", arithmetic=Arithmetic(split_schedule="sglang", q_round="keep", dequant="upcast"),
         modes=("decode", "verify"))  # fmt: skip
def decode(inp: KernelInputs) -> KernelOutputs:
    """refmla.kernel's interface: the decode of ``inp`` into its buffers (out, lse, split partials)."""
    R, H, D = inp.q.shape
    Dv, P = inp.kv_lora_rank, inp.page_size
    if R == 0:
        return KernelOutputs(inp.out, inp.lse, inp.attn_logits, inp.attn_lse)
    kv = inp.kv_buffer.reshape(inp.kv_buffer.shape[0], D)  # [N, D]
    table = inp.block_table  # [B, M]
    part, plse = inp.attn_logits, inp.attn_lse  # [B, H, S, Dv], [B, H, S]
    S = int(inp.num_kv_splits.max())
    row_req, row_len = rows_of(inp)
    BLOCK_DV, BLOCK_DR = triton.next_power_of_2(Dv), max(16, triton.next_power_of_2(max(D - Dv, 1)))
    heads = triton.cdiv(H, BLOCK_H)
    _stage1[(R, heads, S)](
        inp.q, kv, table, row_req, row_len, inp.num_kv_splits, part, plse, inp.q.stride(0), inp.q.stride(1), kv.stride(0),
        table.stride(0), part.stride(0), part.stride(1), part.stride(2), plse.stride(0), plse.stride(1),
        inp.sm_scale, inp.k_scale, inp.logit_cap or 1.0, H, table.shape[1], P=P, DV=Dv, DR=D - Dv,
        BLOCK_DV=BLOCK_DV, BLOCK_DR=BLOCK_DR, BLOCK_H=BLOCK_H, BLOCK_N=BLOCK_N, CAP=inp.logit_cap > 0,
    )  # fmt: skip
    _stage2[(R, heads)](
        part, plse, row_req, row_len, inp.num_kv_splits, inp.out, inp.lse, part.stride(0), part.stride(1),
        part.stride(2), plse.stride(0), plse.stride(1), inp.out.stride(0), inp.out.stride(1), inp.lse.stride(0),
        inp.v_scale, H, DV=Dv, BLOCK_DV=BLOCK_DV, BLOCK_H=BLOCK_H,
    )  # fmt: skip
    return KernelOutputs(out=inp.out, lse=inp.lse, attn_logits=part, attn_lse=plse, info={"triton": triton.__version__})


__all__ = ["decode"]

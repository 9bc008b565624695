"""The low-precision control (docs/contract.md, tolerance): the reference's math at a kernel's rounding points.

A backend passes a row when its error against the fp64 reference is at most k times this
control's error on that row (refmla.compare). The control reads q and the pool as stored, rounds
the latent part of q to a narrower pool's dtype (the Triton kernel's ``q.to(K dtype)``),
accumulates dots in fp32, rounds the probabilities to the value dtype before P.V, keeps the sums
in fp32 and rounds the output to the output dtype. With a split schedule, each split's partial is
fp32 and the merge is fp32, as the split kernels do (refmla.merging).

A kernel's declared arithmetic (refmla.arithmetic) moves the rounding of q and of the dequantized
K / V: ``keep`` / ``to_q_dtype`` (vLLM), ``whole_e4m3`` (FlashMLA), or SGLang's extend
(``whole_to_pool`` / ``new_to_q_dtype``): over the cached prefix all of q rounded to the pool
dtype; the call's new tokens, passed dequantized to q's dtype, met by q as stored.

:class:`Rounding` moves those rounding points (a kernel that stores toward zero, accumulates P.V
in bf16, merges its splits with the wrong base, ...): the numerics hypotheses recompute the
control under it (refmla.hypotheses.numerics) and refmla synth plants it (refmla.synthetic.rounding).
The default, STANDARD, is the control described above, bit for bit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Iterator, Optional

import torch
from refmla.arithmetic import Arithmetic, producer_arithmetic, quantize_q
from refmla.attended import Attended
from refmla.blocked import GROUP_BYTES, Spans, plan
from refmla.capture import Capture
from refmla.merging import MERGE_FANIN, Partials, StreamMerge
from refmla.reference import gather, mla_decode_split_ref, one_pool
from refmla.scales import Scales
from refmla.schedule import MIN_BLOCK_KV, split_bounds
from refmla.stores import STORES, store_as  # noqa: F401  (re-exported: the control's stores)

QK_CHUNK = 64  # dims summed in fp32 before a narrow q.k accumulator rounds (the rope part is one chunk)
CONTROL_BLOCK_ROWS = 16384  # rows the control gathers and upcasts at once; a longer span is merged in fp32
PV_BLOCK = 32  # positions summed in fp32 before a narrow P.V accumulator rounds (Triton's BLOCK_N)


@dataclass(frozen=True)
class Rounding:
    """Where a kernel rounds, and how it merges split partials; the defaults are the control's.

    qk_accum / pv_accum: q.k / P.V summed in this dtype, QK_CHUNK dims / PV_BLOCK positions at a
    time (None: fp32). p_dtype: probabilities rounded to it before P.V (None: the value dtype,
    fp32: kept). store: how the fp32 result becomes the output dtype (STORES). split_lse: the
    split partials' lse stored in this dtype before the merge. merge (MERGES): ``log2_as_ln`` lse
    stored in log2 units but merged with exp; ``ln_as_log2`` natural lse merged with exp2;
    ``unnormalized`` partials stored without their 1 / sum(p).
    """

    qk_accum: Optional[torch.dtype] = None
    p_dtype: Optional[torch.dtype] = None
    pv_accum: Optional[torch.dtype] = None
    store: str = "nearest_even"
    split_lse: Optional[torch.dtype] = None
    merge: str = "ln"
    q_round: str = "latent_to_pool"  # refmla.arithmetic.Q_ROUNDS: "keep" leaves q's latent part as stored
    dequant: str = "upcast"  # refmla.arithmetic.DEQUANTS: "to_q_dtype" rounds fp8 * scale to q's dtype (vLLM);
    # "new_to_q_dtype" does so for the call's new tokens only (the spans' fresh_from, an extend kernel's k_extend)
    p_block: Optional[int] = None  # refmla.arithmetic: P rounded relative to the running maximum of blocks of
    # this many positions (an online softmax's BLOCK_N), None: relative to the row's final maximum

    @property
    def standard_merge(self) -> bool:
        return self.merge == "ln" and self.split_lse is None


STANDARD = Rounding()


def dot_in(a: torch.Tensor, b: torch.Tensor, accum: Optional[torch.dtype], chunk: int) -> torch.Tensor:
    """a [.., M, K] @ b [.., K, N] in fp32, or summed in ``accum`` ``chunk`` of K at a time (rounded after each)."""
    if accum is None:
        return a @ b
    acc = torch.zeros(*a.shape[:-1], b.shape[-1], dtype=accum)
    for c in range(0, a.shape[-1], chunk):
        acc = (acc.float() + a[..., c : c + chunk] @ b[..., c : c + chunk, :]).to(accum)
    return acc.float()


def attend_control(
    q: torch.Tensor, kv: torch.Tensor, sc: Scales, out_dtype: torch.dtype, rnd: Rounding = STANDARD
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same math at the kernel's rounding points, for one request.

    q [H, D] and kv [L, D] in their stored dtypes. A pool narrower than q (fp8, or bf16 under an
    fp32 q) rounds the latent part of q to the pool dtype (the Triton kernel's
    ``q.to(K_Buffer.dtype)``; the rope part meets K upcast instead); dots accumulate in fp32; the
    probabilities are rounded to the value dtype before P.V; the sum stays fp32; the output is
    rounded to ``out_dtype``. Returns out [H, Dv] in out_dtype and lse [H] in fp32. ``rnd`` moves
    the rounding points (:class:`Rounding`).
    """
    o, lse, _ = _attend32(q, kv, sc, rnd)
    return store_as(o, out_dtype, rnd.store), lse


def _attend32(q: torch.Tensor, kv: torch.Tensor, sc: Scales, rnd: Rounding, fresh=None) -> tuple[torch.Tensor, ...]:
    """attend_control before the store: out [.., H, Dv] fp32, lse [.., H] and the softmax sum [.., H] fp32.

    q [H, D] and kv [L, D], or a batch of them (q [G, H, D], kv [G, L, D]: the same ops per entry).
    ``fresh`` [.., L] bool, under dequant ``new_to_q_dtype``: the call's new tokens, whose K / V are
    dequantized to q's dtype and met by q as stored, P rounded to q's dtype (an extend kernel's
    k_extend / v_extend); the other rows as ``upcast`` (its cached prefix)."""
    f32, Dv = torch.float32, sc.kv_lora_rank
    if kv.shape[-2] == 0:
        lead = q.shape[:-1]
        return q.new_zeros(*lead, Dv, dtype=f32), q.new_full(lead, -math.inf, dtype=f32), q.new_zeros(lead, dtype=f32)
    q_nope, q_pe = q[..., :Dv], q[..., Dv:]  # [H, Dv], [H, Dr]
    narrow, ks, vs, p_dtype = kv.dtype.itemsize < q.dtype.itemsize, sc.k_scale, sc.v_scale, kv.dtype
    if narrow and rnd.dequant == "to_q_dtype":  # vLLM: (fp8 * scale).to(q.dtype) on load, P in q's dtype
        (k32, v32), ks, vs, p_dtype = _dequant_to(q.dtype, kv, sc), 1.0, 1.0, q.dtype  # [L, D], [L, Dv]
    else:
        if narrow and rnd.q_round in ("latent_to_pool", "whole_to_pool"):  # the dot runs in the pool dtype
            q_nope = q_nope.to(kv.dtype)
            q_pe = q_pe.to(kv.dtype) if rnd.q_round == "whole_to_pool" else q_pe  # SGLang's extend: qpe too
        k32 = kv.to(f32)  # [L, D]
        v32 = k32[..., :Dv]  # [L, Dv]
    s = _logits(q_nope, q_pe, k32, rnd) * (sc.sm_scale * ks)
    fresh = fresh if narrow and rnd.dequant == "new_to_q_dtype" and fresh is not None and bool(fresh.any()) else None
    if fresh is not None:  # the new tokens: (fp8 * scale).to(q.dtype) met by q as stored
        kq, vq = _dequant_to(q.dtype, kv, sc)  # [L, D], [L, Dv]
        s = torch.where(fresh[..., None, :], _logits(q[..., :Dv], q[..., Dv:], kq, rnd) * sc.sm_scale, s)
    if sc.logit_cap > 0:
        s = sc.logit_cap * torch.tanh(s / sc.logit_cap)
    m = s.max(dim=-1, keepdim=True).values  # [H, 1]
    p = torch.exp(s - m)  # [H, L] fp32
    l = p.sum(dim=-1, keepdim=True)  # [H, 1] fp32, from the unrounded probabilities
    pr = rounded_p(s, m, rnd.p_dtype or p_dtype, rnd.p_block)  # P rounded to the value dtype
    if fresh is not None:  # P.V of the prefix (times v_scale) plus that of the new tokens (P in q's dtype)
        new, pq = fresh[..., None, :], rounded_p(s, m, rnd.p_dtype or q.dtype, rnd.p_block)
        acc = dot_in(pr.masked_fill(new, 0.0), v32, rnd.pv_accum, PV_BLOCK) * vs
        acc = acc + dot_in(pq.masked_fill(~new, 0.0), vq, rnd.pv_accum, PV_BLOCK)
        return acc / l, (m + torch.log(l))[..., 0], l[..., 0]
    acc = dot_in(pr, v32, rnd.pv_accum, PV_BLOCK)  # [H, Dv]
    return acc / l * vs, (m + torch.log(l))[..., 0], l[..., 0]


def rounded_p(s: torch.Tensor, m: torch.Tensor, dtype: torch.dtype, block: Optional[int] = None) -> torch.Tensor:
    """P [.., H, L] rounded to ``dtype``, as fp32 relative to the row maximum m [.., H, 1].

    One pass: exp(s - m) rounded. An online softmax over ``block`` positions at a time (Triton's
    BLOCK_N) rounds block i's P relative to the running maximum r_i of blocks 0..i, and its
    accumulator is rescaled to the final maximum later: round(exp(s - r_i)) * exp(r_i - m). With a
    narrow P (fp8: 3 mantissa bits) that is a different rounding of every block before the one
    holding the maximum."""
    f32 = torch.float32
    if block is None or s.shape[-1] <= block:  # one block: its running maximum is the row's
        return torch.exp(s - m).to(dtype).to(f32)
    L = s.shape[-1]
    nb = -(-L // block)
    pad = torch.full((*s.shape[:-1], nb * block - L), -math.inf, dtype=s.dtype, device=s.device)
    bmax = torch.cat([s, pad], -1).unflatten(-1, (nb, block)).amax(-1)  # [.., H, nb] each block's maximum
    run = torch.cummax(bmax, dim=-1).values.repeat_interleave(block, dim=-1)[..., :L]  # [.., H, L] r_i
    return torch.exp(s - run).to(dtype).to(f32) * torch.exp(run - m)


def _dequant_to(dtype: torch.dtype, kv: torch.Tensor, sc: Scales) -> tuple[torch.Tensor, torch.Tensor]:
    """K [.., L, D] and V [.., L, Dv] of a narrow kv dequantized on load, ``(kv * scale).to(dtype)``, as fp32."""
    k = (kv.float() * sc.k_scale).to(dtype).float()
    Dv = sc.kv_lora_rank
    return k, k[..., :Dv] if sc.v_scale == sc.k_scale else (kv[..., :Dv].float() * sc.v_scale).to(dtype).float()


def _logits(q_nope: torch.Tensor, q_pe: torch.Tensor, k32: torch.Tensor, rnd: Rounding) -> torch.Tensor:
    """q [.., H, D] (its latent and rope parts, any dtype) . k32 [.., L, D] fp32 -> [.., H, L] fp32, unscaled."""
    f32, Dv, kT = torch.float32, q_nope.shape[-1], k32.transpose(-1, -2)  # kT [D, L]
    if rnd.qk_accum is None and k32.shape[-2] == 1:  # one row: a dot (a GEMV's order depends on the batch)
        return ((q_nope.to(f32) * k32[..., :Dv]).sum(-1) + (q_pe.to(f32) * k32[..., Dv:]).sum(-1))[..., None]
    if rnd.qk_accum is None:
        return q_nope.to(f32) @ kT[..., :Dv, :] + q_pe.to(f32) @ kT[..., Dv:, :]  # [H, L]
    return dot_in(torch.cat([q_nope.to(f32), q_pe.to(f32)], -1), kT, rnd.qk_accum, QK_CHUNK)


def mla_control(
    q: torch.Tensor, kv_buffer: torch.Tensor, att: Attended, sc: Scales, out_dtype: torch.dtype,
    rounding: Rounding = STANDARD,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The control of every query row over what ``att`` says it sees (decode, extend, chain or
    tree verify), unsplit: out [R, H, Dv] in out_dtype, lse [R, H] fp32."""
    spans = Spans.of_attended(one_pool(att), fresh=rounding.dequant == "new_to_q_dtype")  # fresh: the new tokens
    return control_spans(q, kv_buffer, spans, sc, out_dtype, rounding)  # blocked, batched


def mla_control_split(
    q: torch.Tensor, kv_buffer: torch.Tensor, att: Attended, num_kv_splits: torch.Tensor, sc: Scales,
    out_dtype: torch.dtype, rounding: Rounding = STANDARD, split_block: int = MIN_BLOCK_KV,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The control of a decode call under its split schedule (granularity ``split_block``: 32
    SGLang, 1 vLLM's uniform ceil(L / n)): each request's fp32 partials merged in fp32, then
    rounded (the split kernels' rounding points). out [B, H, Dv], lse [B, H] fp32.

    Each split's rows are gathered on their own (CONTROL_BLOCK_ROWS at a time), never the whole
    request: memory follows the largest block, not the sequence."""
    B, H = q.shape[0], q.shape[1]
    out = torch.zeros(B, H, sc.kv_lora_rank, dtype=out_dtype, device=q.device)  # [B, H, Dv]
    lse = torch.full((B, H), -math.inf, dtype=torch.float32, device=q.device)  # [B, H]
    for b in range(B):
        rows = att.group_rows(b)  # [L] pool rows, position order
        out[b], lse[b] = attend_rows_split(q[b], kv_buffer, rows, sc, out_dtype, int(num_kv_splits[b]), rounding, split_block)
    return out, lse


def control_spans(
    q: torch.Tensor, kv_buffer: torch.Tensor, spans: Spans, sc: Scales, out_dtype: torch.dtype,
    rnd: Rounding = STANDARD,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """attend_control of every span (refmla.blocked.Spans): out [R, H, Dv] in out_dtype, lse [R, H] fp32.

    Spans of one length up to refmla.blocked.BLOCK_ROWS run as one batch (the same ops per entry,
    :func:`_attend32` on [G, L, D]); longer ones one at a time through :func:`attend_control_rows`."""
    R, H, D = spans.lens.shape[0], q.shape[1], q.shape[-1]
    out = torch.zeros(R, H, sc.kv_lora_rank, dtype=out_dtype, device=q.device)  # [R, H, Dv]
    lse = torch.full((R, H), -math.inf, dtype=torch.float32, device=q.device)  # [R, H]
    qrow = (lambda r: r) if spans.query is None else (lambda r: spans.query[r])
    for kind, rows in plan(spans.lens, H, D, sc.kv_lora_rank, kv_buffer.dtype.itemsize + 4):
        if kind == "long":
            r = int(rows[0])
            start, n = int(spans.starts[r]), int(spans.lens[r])
            fresh = None if spans.fresh_from is None else int(spans.fresh_from[r])
            out[r], lse[r] = attend_control_rows(q[qrow(r)], kv_buffer, spans.indices[start : start + n], sc, out_dtype,
                                                 rnd, fresh)  # fmt: skip
            continue
        L = int(spans.lens[rows[0]])
        flat = (spans.starts[rows][:, None] + torch.arange(L)[None, :]).reshape(-1)  # [G * L]
        kv = gather(kv_buffer, spans.indices[flat].long(), kv_buffer.dtype).view(len(rows), L, D)  # [G, L, D]
        fresh = None if spans.fresh_from is None else torch.arange(L)[None, :] >= spans.fresh_from[rows][:, None]
        o, l, _ = _attend32(q[qrow(rows)], kv, sc, rnd, fresh)  # [G, H, Dv], [G, H]
        out[rows], lse[rows] = store_as(o, out_dtype, rnd.store), l
    return out, lse


def control_budget(H: int, D: int, Dv: int, stored_itemsize: int) -> int:
    """Bytes :func:`control_spans` holds besides its outputs: one block of CONTROL_BLOCK_ROWS rows as
    stored and in fp32 with its fp32 logits, probabilities and rounded probabilities [H, n], or one
    batch of short spans (refmla.blocked.GROUP_BYTES); plus the fp32 partials of a span's blocks."""
    block = CONTROL_BLOCK_ROWS * (D * (stored_itemsize + 4) + 4 * H * 4)
    return max(block, GROUP_BYTES) + 2 * H * (Dv + 2) * 4 * 64  # partials: 64 blocks' worth of headroom


def attend_control_rows(
    q: torch.Tensor, kv_buffer: torch.Tensor, rows: torch.Tensor, sc: Scales, out_dtype: torch.dtype,
    rnd: Rounding = STANDARD, fresh_from: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """attend_control over pool ``rows``, gathered CONTROL_BLOCK_ROWS at a time: one block is
    :func:`attend_control` itself; a longer span's blocks are fp32 partials merged in fp32, as a
    split kernel merges its splits (so memory stays at one block whatever the length).
    ``fresh_from``: rows from this one on are the call's new tokens (:func:`_attend32`'s ``fresh``)."""
    o, lse, _ = _attend32_rows(q, kv_buffer, rows, sc, rnd, fresh_from)
    return store_as(o, out_dtype, rnd.store), lse


def _attend32_rows(
    q: torch.Tensor, kv_buffer: torch.Tensor, rows: torch.Tensor, sc: Scales, rnd: Rounding, fresh_from=None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """:func:`_attend32` over pool ``rows`` [n], gathered CONTROL_BLOCK_ROWS at a time: (o [H, Dv],
    lse [H], sum [H]) fp32. One block is _attend32 itself; longer, the blocks merge in fp32
    (:class:`Partials`), the sum taken relative to the largest block maximum."""
    def block(s: int) -> tuple[torch.Tensor, ...]:
        kv = gather(kv_buffer, rows[s : s + CONTROL_BLOCK_ROWS].long(), kv_buffer.dtype)  # [n, D]
        fresh = None if fresh_from is None else torch.arange(s, s + kv.shape[0]) >= fresh_from
        return _attend32(q, kv, sc, rnd, fresh)

    if rows.shape[0] <= CONTROL_BLOCK_ROWS:
        return block(0)
    parts = Partials()
    for s in range(0, rows.shape[0], CONTROL_BLOCK_ROWS):
        parts.add(*block(s))
    return parts.merged()


def attend_control_split(
    q: torch.Tensor, kv: torch.Tensor, sc: Scales, out_dtype: torch.dtype, num_splits: int,
    rnd: Rounding = STANDARD, split_block: int = MIN_BLOCK_KV,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """attend_control over the kernel's split schedule (granularity ``split_block``: 32 SGLang,
    1 vLLM), on one request's rows kv [L, D] as stored: fp32 partials [S, H, Dv], an fp32 merge."""
    def parts(bounds):
        return (_attend32(q, kv[s:e], sc, rnd) for s, e in bounds)

    return _split(kv.shape[0], parts, out_dtype, num_splits, rnd, split_block)


def attend_rows_split(
    q: torch.Tensor, kv_buffer: torch.Tensor, rows: torch.Tensor, sc: Scales, out_dtype: torch.dtype,
    num_splits: int, rnd: Rounding = STANDARD, split_block: int = MIN_BLOCK_KV,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """:func:`attend_control_split` over pool ``rows`` [L], each split gathered on its own (in
    blocks of CONTROL_BLOCK_ROWS; short splits of one length batched): the same numbers while a
    split fits one block."""
    def parts(bounds):
        return _split_parts(q, kv_buffer, rows, bounds, sc, rnd)

    def whole() -> tuple[torch.Tensor, torch.Tensor]:
        return attend_control_rows(q, kv_buffer, rows, sc, out_dtype, rnd)

    return _split(rows.shape[0], parts, out_dtype, num_splits, rnd, split_block, whole)


def _split_parts(q, kv_buffer, rows, bounds, sc: Scales, rnd: Rounding) -> Iterator[tuple[torch.Tensor, ...]]:
    """(o, lse, sum) fp32 of each split (start, end) of pool ``rows``, in order. Consecutive splits of
    one length run as one batch of at most CONTROL_BLOCK_ROWS rows (the same ops per entry); a split
    longer than a block is gathered a block at a time."""
    i = 0
    while i < len(bounds):
        s, e = bounds[i]
        L = e - s
        if L > CONTROL_BLOCK_ROWS:
            yield _attend32_rows(q, kv_buffer, rows[s:e], sc, rnd)
            i += 1
            continue
        j = i + 1
        while j < len(bounds) and j - i < CONTROL_BLOCK_ROWS // L and bounds[j][1] - bounds[j][0] == L:
            j += 1
        G = j - i  # splits [i, j): contiguous rows rows[s : s + G * L]
        kv = gather(kv_buffer, rows[s : s + G * L].long(), kv_buffer.dtype).view(G, L, -1)  # [G, L, D]
        o, lse, z = _attend32(q.expand(G, *q.shape), kv, sc, rnd)  # [G, H, Dv], [G, H], [G, H]
        yield from zip(o, lse, z)
        i = j


def _split(L: int, parts, out_dtype, num_splits: int, rnd: Rounding, split_block: int, whole=None):
    """The split merge over ``parts(bounds)``, the (o, lse, sum) fp32 of each non-empty split in
    order: the standard merge (:class:`Partials`), or :func:`merge_partials` under ``rnd`` (streamed
    MERGE_FANIN splits at a time). One split: the unsplit control (``whole()``, or its one part)."""
    bounds = [(s, e) for s, e in split_bounds(L, num_splits, split_block) if e > s]
    if len(bounds) <= 1:
        if whole is not None:
            return whole()
        o, lse, _ = next(parts([(0, L)]))
        return store_as(o, out_dtype, rnd.store), lse
    if rnd.standard_merge:
        merged = Partials()
        for part in parts(bounds):
            merged.add(*part)
        o, lse, _ = merged.merged()
        return store_as(o, out_dtype, rnd.store), lse
    stream, chunk = StreamMerge(rnd), []
    for part in parts(bounds):
        chunk.append(part)
        if len(chunk) == MERGE_FANIN:
            stream.add(chunk)
            chunk = []
    if chunk:
        stream.add(chunk)
    o, lse = stream.result()
    return store_as(o, out_dtype, rnd.store), lse


def mla_decode_split_control(
    q: torch.Tensor, kv_buffer: torch.Tensor, att: Attended, num_kv_splits: torch.Tensor, sc: Scales,
    max_kv_splits: int | None = None, split_block: int = MIN_BLOCK_KV, rounding: Rounding = STANDARD,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """:func:`refmla.reference.mla_decode_split_ref` at the control's rounding points: fp32 partials
    [B, H, S, Dv] and lse [B, H, S], as the Triton stage-1 kernel stores them, and valid [B, S]."""

    def split32(qb: torch.Tensor, kv_buffer: torch.Tensor, rows: torch.Tensor, sc: Scales):
        return attend_control_rows(qb, kv_buffer, rows, sc, torch.float32, rounding)  # this split's rows, in blocks

    return mla_decode_split_ref(
        q, kv_buffer, att, num_kv_splits, sc, max_kv_splits=max_kv_splits, attend_fn=split32, split_block=split_block,
    )  # fmt: skip


def control_output(
    q: torch.Tensor, kv_buffer: torch.Tensor, att: Attended, sc: Scales, out_dtype: torch.dtype,
    num_kv_splits: Optional[torch.Tensor] = None, rounding: Rounding = STANDARD, split_block: int = MIN_BLOCK_KV,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The control a replay judges against: under the split schedule when ``num_kv_splits`` is
    given (decode, :func:`mla_control_split`, granularity ``split_block``), else :func:`mla_control`."""
    if num_kv_splits is not None:
        return mla_control_split(q, kv_buffer, att, num_kv_splits, sc, out_dtype, rounding, split_block)
    return mla_control(q, kv_buffer, att, sc, out_dtype, rounding)


def declared_inputs(cap: Capture, arith: Arithmetic, sc: Scales, q: torch.Tensor) -> tuple[torch.Tensor, Scales, Rounding]:
    """(q, scales, rounding) of a kernel declaring ``arith``: q quantized whole to e4m3 (its scale
    folded into sm_scale) for ``whole_e4m3`` over an fp8 pool, the rounding points it declares."""
    if arith.q_round == "whole_e4m3" and cap.kv_buffer.dtype.itemsize == 1:
        q8, q_scale = quantize_q(q)
        q, sc = q8.float(), sc.but(sm_scale=sc.sm_scale * q_scale)
    return q, sc, Rounding(q_round=arith.q_round, dequant=arith.dequant, p_block=arith.p_block)


def capture_control(
    cap: Capture, out_dtype: torch.dtype, rounding: Optional[Rounding] = None, sc: Optional[Scales] = None,
    q: Optional[torch.Tensor] = None, arith: Optional[Arithmetic] = None, num_kv_splits: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """:func:`control_output` of a capture at the arithmetic a kernel declares (``arith``, default
    the capture producer's, refmla.arithmetic): its split schedule over ``num_kv_splits`` (default
    the capture's) in decode, its rounding of q and of the dequantized K / V. ``rounding``: other
    rounding points (a numerics variant); ``sc`` / ``q``: a hypothesis's candidate scales or q."""
    arith = producer_arithmetic(cap) if arith is None else arith
    q, sc, declared = declared_inputs(cap, arith, sc or cap.scales(), cap.q if q is None else q)
    rnd = declared if rounding is None else replace(rounding, q_round=arith.q_round, dequant=arith.dequant,
                                                    p_block=arith.p_block)  # fmt: skip
    splits = num_kv_splits if num_kv_splits is not None else cap.num_kv_splits
    splits = splits if cap.is_decode and arith.split_block is not None else None
    return control_output(q, cap.kv_buffer, cap.attended(), sc, out_dtype, splits, rnd, arith.split_block or MIN_BLOCK_KV)

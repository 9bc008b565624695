"""The sparse decode math in fp64 (DeepSeek V3.2 DSA, V4), and its control at the kernels' rounding
points. One function per step, in the order the math reads; shapes in comments (R = B * S query
rows, H heads, Kt = K + K2 entries of both caches, D head dim, Dv value width).

    s_j   = softmax_scale * q . k_j                 for the row's valid entries j (both caches)
    m     = max_j s_j,   l = sum_j exp(s_j - m)
    out   = sum_j exp(s_j - m) v_j / (l + exp(sink - m))      v_j = k_j[:Dv]; no sink: / l
    lse   = m + ln l                                natural log, the sink not included
    sink +inf: out = 0;  sink -inf: no sink         (FlashMLA's out * 1 / (1 + exp(sink - lse)))
    lonely row (no valid entry): out = 0, lse = +inf   (FlashMLA's convention; SGLang's Triton kernel too)
    inv_rope (when captured): out[..., -d_rope:] rotated by conj(freqs_cis[position]), pairs interleaved

Work and memory: each attended (cache, token) is decoded once into one table of the call (at most
TABLE_BYTES, else a table per block of rows, :func:`table_rows`), and the reference runs every row
over its entries' table rows with the dense reference's blocked work (refmla.blocked.attend_spans:
cache-sized blocks, short rows batched, a compiled loop on every thread), so its cost follows the
attended entries x heads; the control works in blocks of query rows (:func:`row_blocks`, its fp32
keys at most CONTROL_BLOCK_BYTES a block) on every thread. Besides the outputs [R, H, Dv] and the row
indices [R, Kt]; a row's result does not depend on its block.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from refmla.blocked import Spans, attend_spans, run_units
from refmla.compare import Comparison, Tolerance, Worst, compare
from refmla.compare import judge_lse as lse_rule
from refmla.control import PV_BLOCK, QK_CHUNK, STANDARD, Rounding, dot_in
from refmla.results import LseCheck
from refmla.scales import Scales
from refmla.stores import store_as
from refmla.sparse.arithmetic import SGLANG_TRITON_SPARSE, SparseArithmetic
from refmla.sparse.format import SparseCapture
from refmla.sparse.layouts import FP8_DTYPES, PackedLayout, TokenBytes, dequantize, tile_scales, token_bytes
from refmla.sparse.rows import SparseRows, sparse_rows


@dataclass
class SparseOutput:
    out: torch.Tensor  # [B, S, H, Dv]
    lse: torch.Tensor  # [B, S, H]


def rows_of(cap: SparseCapture) -> SparseRows:
    """The rows ``cap`` reads (refmla.sparse.rows), built once per capture while its index tensors are
    the same objects, unchanged (their version counters): the replay, control and search share them."""
    parts = (cap.indices, cap.topk_length, cap.extra_indices, cap.extra_topk_length)
    versions = tuple(t._version if t is not None else None for t in parts)
    cached = cap.__dict__.get("_rows_of")  # (the tensors themselves, their versions, the rows)
    if cached is None or cached[1] != versions or any(a is not b for a, b in zip(cached[0], parts)):
        cached = (parts, versions, sparse_rows(*parts))
        cap.__dict__["_rows_of"] = cached
    return cached[2]


@dataclass
class Keys:
    """The keys a set of query rows reads, each token decoded once: ``table`` [n, D] fp64 (one row
    per distinct (cache, token) read, and a zero row for the entries that are not valid) and
    ``slot`` [R, W], each entry's row of it. A block of rows' keys is one index_select."""

    table: torch.Tensor  # [n, D] fp64
    slot: torch.Tensor  # [R, W] int64
    pool: Optional[torch.Tensor] = None  # [n] int8: each table row's cache (0 main, 1 extra)

    def block(self, sl) -> torch.Tensor:
        """[n, W, D] the keys of rows ``sl`` (a slice or an index tensor), zero where not valid."""
        s = self.slot[sl]
        return self.table.index_select(0, s.reshape(-1)).view(*s.shape, self.table.shape[1])

    def rows(self, sl) -> "Keys":
        """The same table, for the query rows ``sl`` only."""
        return Keys(self.table, self.slot[sl], self.pool)


TABLE_BYTES = 256 << 20  # a whole call's decoded keys are kept once up to this size (else block by block)


def key_table(cap: SparseCapture, rows: SparseRows, decode=None, limit: Optional[int] = None,
              dtype: torch.dtype = torch.float64) -> Optional[Keys]:  # fmt: skip
    """Every valid entry's key, each distinct (cache, token) decoded once by ``decode`` (default
    :func:`dequantize`: exactly, only the tokens read), held in ``dtype``; None when the table would
    pass ``limit`` bytes."""
    m, decode = cap.meta, decode or dequantize
    pools = [(cap.k_cache, m.layout, m.page_size), (cap.extra_k_cache, m.extra_layout, m.extra_page_size)]
    key = torch.where(rows.valid, rows.token * 2 + rows.pool_id.long(), -1)  # [R, W] (cache, token) as one int
    distinct, slot = torch.unique(key, return_inverse=True)  # sorted: -1 (not valid) first, its row stays 0
    if limit is not None and distinct.numel() * m.layout.head_dim * dtype.itemsize > limit:
        return None
    table = torch.zeros(distinct.numel(), m.layout.head_dim, dtype=dtype)
    pool = (distinct % 2).to(torch.int8)  # [n] (the -1 row: 1, a zero row either way)
    for pid, (cache, layout, page) in enumerate(pools):
        sel = (distinct >= 0) & (pool == pid)  # this pool's tokens
        if cache is not None and bool(sel.any()):
            table[sel] = decode(cache, layout, page, m.kv_fp8_dtype, distinct[sel] // 2).to(dtype)
    return Keys(table, slot, pool)


def gather_keys(cap: SparseCapture, rows: SparseRows, decode=None) -> torch.Tensor:
    """[R, W, D] fp64: each valid entry's key from its own cache, decoded exactly (only the tokens read), 0 elsewhere."""
    return key_table(cap, rows, decode).block(slice(None))


def call_keys(cap: SparseCapture, rows: SparseRows, decode=None, dtype: torch.dtype = torch.float64):
    """The keys of block ``sl`` of ``rows``: from one table of the whole call when it fits TABLE_BYTES
    (each token decoded once for every block), else each block's own."""
    table = key_table(cap, rows, decode, limit=TABLE_BYTES, dtype=dtype)
    if table is not None:
        return table.block
    return lambda sl: key_table(cap, rows.part(sl), decode, dtype=dtype).block(slice(None))


def call_table(cap: SparseCapture, rows: SparseRows, exact: bool = True) -> Optional[Keys]:
    """The whole call's key table for ``rows``: exact (fp64, :func:`dequantize`) or as the kernels
    hold the keys (bf16 values in fp32, :func:`dequantize_bf16`); None past TABLE_BYTES. Kept on the
    capture for the last ``rows`` of each kind (the reference, the control, its variants and the
    search read the same table: each token decoded once a replay, two tables at most held)."""
    kept = cap.__dict__.setdefault("_call_tables", {})  # exact -> (rows, keys)
    hit = kept.get(exact)
    if hit is None or hit[0] is not rows:
        dtype = torch.float64 if exact else torch.float32
        hit = (rows, key_table(cap, rows, None if exact else dequantize_bf16, limit=TABLE_BYTES, dtype=dtype))
        kept[exact] = hit
    return hit[1]


def attend_table(q: torch.Tensor, keys: Keys, rows: SparseRows, sink: Optional[torch.Tensor], scale: float,
                 d_v: int, edit=None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """fp64 attention of q [R, H, D] over each row's valid entries' keys in ``keys`` (rows' own
    table): the dense reference's blocked work (refmla.blocked.attend_spans: cache-sized blocks of
    entries merged online, short rows batched, a compiled loop on every thread), so the cost follows
    attended entries x heads. ``edit(table, pool)`` -> the table a mistake reads. -> out [R, H, Dv],
    lse [R, H] (:func:`sparse_attention`'s conventions: the sink in the denominator, lonely 0 / +inf)."""
    table = keys.table if edit is None else edit(keys.table, keys.pool)
    lens = rows.valid.sum(dim=1)  # [R] valid entries (in list order: slot[valid] is row-major)
    spans = Spans(keys.slot[rows.valid], torch.cumsum(lens, 0) - lens, lens)  # row r: its entries' table rows
    out, lse = attend_spans(q, table.to(torch.float64)[:, None], spans, Scales(d_v, scale))  # [R, H, Dv], [R, H]
    lonely = (lens == 0)[:, None]  # [R, 1]
    if sink is not None:  # out * l / (l + exp(sink - m)) = out / (1 + exp(sink - lse)), in place
        w = 1.0 + torch.exp(sink.to(torch.float64)[None, :] - torch.where(lonely, 0.0, lse))  # [R, H]
        out.div_(w[..., None])
    return out.masked_fill_(lonely[..., None], 0.0), lse.masked_fill_(lonely, float("inf"))


def table_rows(rows: SparseRows, D: int) -> list[slice]:
    """Blocks of query rows whose keys' table [<= rows x W, D] fp64 stays within TABLE_BYTES (when
    the whole call's does not)."""
    R, W = rows.token.shape
    n = max(1, TABLE_BYTES // max(1, W * D * 8))
    return [slice(i, min(R, i + n)) for i in range(0, R, n)]


def attend_rows(cap: SparseCapture, q: torch.Tensor, rows: SparseRows, sink: Optional[torch.Tensor], scale: float,
                keys: Optional[Keys] = None, decode=None, edit=None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """:func:`attend_table` over ``keys`` (the rows' table), or over one table of the whole call when
    it fits TABLE_BYTES, else a table per block of rows (:func:`table_rows`). -> out [R, H, Dv], lse [R, H]."""
    Dv = cap.meta.head_dim_v
    if keys is None:
        keys = call_table(cap, rows) if decode is None else key_table(cap, rows, decode, limit=TABLE_BYTES)
    if keys is not None:
        return attend_table(q, keys, rows, sink, scale, Dv, edit)
    R, H = q.shape[:2]
    out = torch.zeros(R, H, Dv, dtype=torch.float64)  # [R, H, Dv]
    lse = torch.full((R, H), float("inf"), dtype=torch.float64)  # [R, H]
    for sl in table_rows(rows, q.shape[-1]):
        part = rows.part(sl)
        out[sl], lse[sl] = attend_table(q[sl], key_table(cap, part, decode), part, sink, scale, Dv, edit)
    return out, lse


def sparse_attention(q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, sink: Optional[torch.Tensor],
                     scale: float, d_v: int) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """fp64 attention of q [R, H, D] over keys [R, Kt, D] where valid [R, Kt]; -> out [R, H, Dv], lse [R, H]."""
    q, keys = q.to(torch.float64), keys.to(torch.float64)  # keys: 0 where not valid (key_table)
    s = torch.bmm(q, keys.transpose(1, 2)).mul_(scale)  # [R, H, Kt]
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    m = s.amax(dim=-1, keepdim=True)  # [R, H, 1]
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(s - m_safe)  # [R, H, Kt], 0 on invalid entries
    l = p.sum(dim=-1)  # [R, H]
    denom = l if sink is None else l + torch.exp(sink.to(torch.float64)[None, :] - m_safe[..., 0])
    out = torch.bmm(p, keys[..., :d_v]) / denom.clamp_min(1e-300)[..., None]  # [R, H, Dv]
    lonely = l == 0  # [R, H]
    lse = torch.where(lonely, float("inf"), m_safe[..., 0] + torch.log(l.clamp_min(1e-300)))
    return out.masked_fill(lonely[..., None], 0.0), lse


def inverse_rope(out: torch.Tensor, freqs: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """out [R, H, Dv] with its last d_rope dims rotated by conj(freqs_cis[positions]) (SGLang's inv_rope:
    freqs [M, d_rope] = view_as_real(freqs_cis).flatten(-2), pairs (2i, 2i + 1) interleaved)."""
    d_rope = freqs.shape[1]
    f = freqs.to(torch.float64)[positions.long()]  # [R, d_rope]
    cos, sin = f[:, 0::2][:, None, :], f[:, 1::2][:, None, :]  # [R, 1, d_rope / 2]
    x = out[..., -d_rope:]
    re, im = x[..., 0::2], x[..., 1::2]
    rot = torch.stack([re * cos + im * sin, im * cos - re * sin], dim=-1).flatten(-2)  # x * conj(f)
    return torch.cat([out[..., :-d_rope], rot], dim=-1)


ROW_BLOCK_BYTES = 64 << 20  # the fp64 keys one block of query rows gathers, at most (one row at least)
CONTROL_BLOCK_BYTES = 8 << 20  # the control's fp32 keys a block, at most (one row at least): cache-sized


def row_blocks(rows: SparseRows, D: int, budget: Optional[int] = None, itemsize: int = 8) -> list[slice]:
    """Blocks of query rows whose gathered keys [n, Kt, D] (``itemsize`` bytes each) stay within
    ``budget`` bytes (ROW_BLOCK_BYTES by default)."""
    R, W = rows.token.shape
    n = max(1, (ROW_BLOCK_BYTES if budget is None else budget) // max(1, W * D * itemsize))
    return [slice(i, min(R, i + n)) for i in range(0, R, n)]


def sparse_reference(cap: SparseCapture, rows: Optional[SparseRows] = None) -> SparseOutput:
    """The fp64 truth of one sparse decode capture, block of query rows by block."""
    rows = rows if rows is not None else rows_of(cap)
    B, S, H, D = cap.q.shape
    Dv = cap.meta.head_dim_v
    out, lse = attend_rows(cap, cap.q.reshape(B * S, H, D), rows, cap.attn_sink, cap.meta.softmax_scale)
    if cap.inv_rope_freqs is not None:
        out = inverse_rope(out, cap.inv_rope_freqs, cap.inv_rope_positions[: B * S])
    return SparseOutput(out.reshape(B, S, H, Dv), lse.reshape(B, S, H))


# --------------------------------------------------------------------------------------------
# The control: the same math at a kernel's declared rounding points (refmla.sparse.arithmetic)
# --------------------------------------------------------------------------------------------


def dequantize_bf16(cache: torch.Tensor, layout: PackedLayout, page_size: int, fp8: str = "float8_e4m3fn",
                    tokens: Optional[torch.Tensor] = None) -> torch.Tensor:  # fmt: skip
    """The keys as the kernels hold them: fp8 -> bf16, times the scale in bf16, rounded to bf16 (fp64 [n, D])."""
    b = token_bytes(cache.view(torch.uint8), layout, page_size)
    nope = b.nope[tokens].contiguous().view(FP8_DTYPES[fp8]).to(torch.bfloat16)  # [n, d_nope]
    sc = tile_scales(TokenBytes(b.nope[tokens], b.scales[tokens], b.rope[tokens]), layout).to(torch.bfloat16)
    nope = (nope * sc.repeat_interleave(layout.tile, dim=1)).to(torch.bfloat16)
    rope = b.rope[tokens].contiguous().view(torch.bfloat16)
    return torch.cat([nope, rope], dim=1).to(torch.float64)


def sparse_control(cap: SparseCapture, rows: Optional[SparseRows] = None, rnd: Rounding = STANDARD,
                   requests: slice = slice(None), arith: SparseArithmetic = SGLANG_TRITON_SPARSE) -> SparseOutput:  # fmt: skip
    """The same math at the rounding points ``arith`` declares (refmla.sparse.arithmetic; SGLang's
    Triton kernel's by default): q and keys in bf16, q.k in fp32, p = exp(s - m) in fp32 rounded to
    bf16 before P.V, l and the accumulator in fp32, a kernel's bf16 split partials merged in fp32,
    the output rounded once to its dtype: the noise floor. In the reference's blocks of query rows.
    ``rnd`` moves those rounding points as it moves the dense control's (refmla.control.Rounding:
    the store, P's dtype, q.k / P.V accumulated narrow; the numerics variants); ``requests``: only
    those requests' rows ([b, S, H, Dv])."""
    rows = rows if rows is not None else rows_of(cap)
    B, S, H, D = cap.q.shape
    Dv = cap.meta.head_dim_v
    a, e, _ = requests.indices(B)
    sel = slice(a * S, max(a, e) * S)  # the requests' query rows
    part, n = rows.part(sel), max(0, e - a) * S
    out = torch.zeros(n, H, Dv, dtype=torch.float32)  # [n, H, Dv]
    lse = torch.full((n, H), float("inf"), dtype=torch.float32)  # [n, H]
    q_all = cap.q.reshape(B * S, H, D)[sel].to(getattr(torch, arith.q_dtype)).to(torch.float32)
    whole = call_table(cap, rows, exact=False)  # bf16 values: exact in fp32
    keys = whole.rows(sel).block if whole is not None else call_keys(cap, part, dequantize_bf16, torch.float32)

    def block(sl: slice) -> None:  # one block of rows, single-threaded (refmla.blocked.run_units' workers)
        out[sl], lse[sl] = _control_block(cap, q_all[sl], part.part(sl), rnd, arith, keys(sl))

    run_units(block, row_blocks(part, D, CONTROL_BLOCK_BYTES, 4))  # cache-sized blocks, on every thread
    out_dtype = getattr(torch, arith.out_dtype)
    out = store_as(out, out_dtype, rnd.store)  # the kernel's store
    if cap.inv_rope_freqs is not None:
        out = inverse_rope(out.double(), cap.inv_rope_freqs.float(), cap.inv_rope_positions[: B * S][sel])
    out = out.to(out_dtype).to(torch.float64)
    b = max(0, e - a)  # requests in the selection (0 heads or 0 query tokens: an empty result, not -1)
    return SparseOutput(out.reshape(b, S, H, Dv), lse.to(torch.float64).reshape(b, S, H))


def _control_block(cap: SparseCapture, q: torch.Tensor, rows: SparseRows, rnd: Rounding,
                   arith: SparseArithmetic, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """One block of the control: q [n, H, D] fp32 (bf16 values), its keys [n, Kt, D] (bf16 values,
    0 where not valid) -> out [n, H, Dv], lse [n, H] fp32."""
    keys = keys.to(torch.float32)
    if rnd.qk_accum is None:
        s = torch.bmm(q, keys.transpose(1, 2))
    else:  # q.k summed in a narrow dtype, QK_CHUNK dims at a time (the dense control's)
        s = dot_in(q, keys.transpose(-1, -2), rnd.qk_accum, QK_CHUNK)
    s = s * torch.tensor(cap.meta.softmax_scale, dtype=torch.float32)
    values, p_dtype = keys[..., : cap.meta.head_dim_v], rnd.p_dtype or getattr(torch, arith.p_dtype)
    sink = None if cap.attn_sink is None else cap.attn_sink.float()[None, :]  # [1, H]
    if arith.one_pass:
        acc, l, m = _pass(s, rows.valid, values, p_dtype, rnd)
        denom = l if sink is None else l + torch.exp(sink - m)  # [n, H]
        out = acc / torch.where(denom == 0, 1.0, denom)[..., None]  # [n, H, Dv]
    else:  # each split's normalized output stored bf16, its lse fp32, merged in fp32
        out, l, m = _split_passes(s, rows, values, p_dtype, rnd, arith.group)
    lonely = l == 0
    lse = torch.where(lonely, float("inf"), m + torch.log(torch.where(lonely, 1.0, l)))  # [n, H]
    if sink is not None and not arith.one_pass:  # the combine's 1 / (1 + exp(sink - lse))
        out = out / (1.0 + torch.exp(sink - lse))[..., None]
    return torch.where(lonely[..., None], 0.0, out), lse


def _pass(s: torch.Tensor, valid: torch.Tensor, values: torch.Tensor, p_dtype: torch.dtype,
          rnd: Rounding) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """One online-softmax pass over the entries ``valid`` [n, Kt] of s [n, H, Kt]: the P.V
    accumulator [n, H, Dv], l [n, H] and m [n, H] (0 where the row attends nothing), fp32."""
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    m = s.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(s - m)  # fp32, 0 on entries not read
    pr = p.to(p_dtype).float()
    if rnd.pv_accum is None:
        acc = torch.bmm(pr, values)
    else:  # P.V summed in a narrow dtype, PV_BLOCK entries at a time
        acc = dot_in(pr, values, rnd.pv_accum, PV_BLOCK)
    return acc, p.sum(dim=-1), m[..., 0]


def _split_passes(s: torch.Tensor, rows: SparseRows, values: torch.Tensor, p_dtype: torch.dtype, rnd: Rounding,
                  group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Splits of ``group`` entries of each cache (a row's entries in list order): each split's output
    acc / l rounded to bf16, merged by its lse in fp32; -> out [n, H, Dv] (normalized), l, m [n, H]
    of the whole row (out the merged one, l / m as one pass would give them)."""
    rank = torch.zeros_like(rows.token)
    for pid in (0, 1):  # an entry's place among its own cache's entries
        mine = rows.valid & (rows.pool_id == pid)
        rank = torch.where(mine, torch.cumsum(mine.long(), dim=1) - 1, rank)
    split = torch.where(rows.valid, rows.pool_id.long() * (rows.token.shape[1] + 1) + rank // group, -1)  # [n, Kt]
    n, H, Dv = s.shape[0], s.shape[1], values.shape[-1]
    num, l_all = torch.zeros(n, H, Dv), torch.zeros(n, H)
    m_all = torch.full((n, H), float("-inf"))
    parts = []
    for g in torch.unique(split[split >= 0]).tolist():
        acc, l, m = _pass(s, split == g, values, p_dtype, rnd)
        o = (acc / torch.where(l == 0, 1.0, l)[..., None]).to(torch.bfloat16).float()  # Partial_O bf16
        parts.append((o, torch.where(l == 0, float("-inf"), m + torch.log(torch.where(l == 0, 1.0, l)))))
    if not parts:
        return num, l_all, torch.zeros(n, H)
    lse_max = torch.stack([p[1] for p in parts]).amax(dim=0)  # [n, H]
    safe = torch.where(torch.isfinite(lse_max), lse_max, torch.zeros_like(lse_max))
    for o, lse_g in parts:
        w = torch.exp(lse_g - safe)  # [n, H], 0 for an empty split
        num, l_all = num + w[..., None] * o, l_all + w
    return num / torch.where(l_all == 0, 1.0, l_all)[..., None], l_all, safe


# --------------------------------------------------------------------------------------------
# Judged with the one comparator (refmla.compare, docs/contract.md section 5): rows are query
# tokens (B * S), the tolerance from the control
# --------------------------------------------------------------------------------------------


def judge_out(name: str, cap: SparseCapture, out: torch.Tensor, ref: SparseOutput, ctrl: SparseOutput,
              tol: Tolerance, arith: SparseArithmetic = SGLANG_TRITON_SPARSE) -> Comparison:  # fmt: skip
    """A path's out [B, S, H, Dv] by the one comparator, ``ctrl`` its control at ``arith`` (whose
    output dtype sets the ulp)."""
    B, S, H, Dv = ref.out.shape
    flat = lambda t: t.reshape(B * S, H, Dv)  # noqa: E731 - [B, S, H, Dv] -> rows [R, H, Dv]
    return compare(name, flat(out), flat(ref.out), flat(ctrl.out), out_dtype=getattr(torch, arith.out_dtype), tol=tol,
                   request_of_row=cap.request_of_row())  # fmt: skip


def judge_lse(lse: torch.Tensor, ref: SparseOutput, ctrl: SparseOutput, tol: Tolerance) -> LseCheck:
    """A path's lse [B, S, H] by the one lse rule (refmla.compare.judge_lse, docs/contract.md section
    5): within k times the control's lse error plus 1e-5 * (1 + |lse|), as the dense lse is judged;
    +inf only on the reference's lonely rows (the dense LseCheck). (A floor of 4 fp32 ulps failed a
    correct fp32 kernel whose q . k summed in another order than the control's: 6.8e-7 off at |lse| ~ 1.)"""
    B, S, H = ref.lse.shape
    got, want, ctl = lse.double().reshape(B * S, H), ref.lse.reshape(B * S, H), ctrl.lse.reshape(B * S, H)
    if got.numel() == 0:
        return LseCheck("pass", compared_rows=0)
    judged = lse_rule(got, want, ctl, tol.k)
    bad = judged.bad
    r, h = judged.worst()
    req = torch.arange(B).repeat_interleave(S)
    check = LseCheck("fail" if bool(bad.any()) else "pass", compared_rows=B * S,
                     max_abs_err=float(judged.err.nan_to_num(float("inf")).max()),
                     worst=Worst.of(row=r, request=int(req[r]), head=h, actual=float(got[r, h]), expected=float(want[r, h])))  # fmt: skip
    if bool(bad.any()):
        check.failed_requests = sorted({int(req[i]) for i in torch.nonzero(bad.any(dim=1)).flatten()})
        check.reason = f"lse: {int(bad.sum())} (row, head)s exceed k*control + 1e-5 (1 + |lse|) (row {r} head {h}: {float(got[r, h]):.6g} vs {float(want[r, h]):.6g})"
    return check


__all__ = ["Keys", "SparseOutput", "attend_rows", "attend_table", "call_keys", "call_table", "dequantize_bf16", "gather_keys", "key_table", "inverse_rope", "judge_lse", "judge_out", "rows_of", "sparse_attention",
           "sparse_control", "sparse_reference"]  # fmt: skip

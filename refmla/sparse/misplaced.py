"""Misplaced reads and writes of a sparse decode (the dense search's ``output_rows_permuted`` and
``other_rows_read``, on sparse captures): whose output a row holds, which slot an entry read.

    output_rows_permuted {"rows": {b: b2}}   request b's output row holds request b2's output
    other_rows_read {"entry", "cache", "slot_read", "slot_meant"}
                                             one top-k entry of one row read at the neighbouring slot
                                             (slot_meant +- 1): ``entry`` its position in that cache's
                                             index list, ``cache`` main | extra

Each is found by a cheap ranking (distances between rows; a rank-one update of the row's softmax
per entry), then judged like every sparse mistake: the candidate's exact fp64 output, the capture's
own noise floor, the one comparator.
"""

from __future__ import annotations

from typing import Optional

import torch

from refmla.compare import Comparison, Tolerance
from refmla.sparse.format import SparseCapture
from refmla.sparse.layouts import dequantize
from refmla.sparse.reference import ROW_BLOCK_BYTES, SparseOutput, gather_keys, judge_out, rows_of, sparse_attention


def failing_rows(c: Comparison) -> list[int]:
    """The query rows (b * S + s) with a failing head."""
    return [] if c.row_failed is None else torch.nonzero(c.row_failed.any(dim=1)).flatten().tolist()


def rows_permuted(cap: SparseCapture, out: torch.Tensor, ref: SparseOutput, ctrl: SparseOutput, tol: Tolerance,
                  c: Comparison) -> Optional[tuple[dict, Comparison]]:  # fmt: skip
    """({"rows": {b: b2}}, its comparison) when every failing request's output is another request's."""
    B = ref.out.shape[0]
    bad = sorted({r // ref.out.shape[1] for r in failing_rows(c)})
    if len(bad) < 2:
        return None
    o, e = out.double().reshape(B, -1), ref.out.reshape(B, -1)  # [B, S * H * Dv]
    perm = torch.arange(B)
    for b in bad:
        b2 = int((o[b][None] - e).abs().nan_to_num(float("inf")).amax(dim=1).argmin())
        if b2 == b:
            return None
        perm[b] = b2
    noise = torch.nan_to_num(ctrl.out - ref.out)
    variant = SparseOutput(ref.out[perm], ref.lse[perm])
    judged = judge_out("output_rows_permuted", cap, out, variant, SparseOutput(variant.out + noise, variant.lse), tol)
    return ({"rows": {b: int(perm[b]) for b in bad}}, judged) if judged.passed else None


def neighbour_slot(cap: SparseCapture, out: torch.Tensor, ref: SparseOutput, ctrl: SparseOutput, tol: Tolerance,
                   c: Comparison) -> Optional[tuple[dict, int, Comparison]]:  # fmt: skip
    """(detail, request, comparison) when the one failing row's output is its attention with one
    entry read at slot +- 1 instead."""
    bad = failing_rows(c)
    if len(bad) != 1 or cap.inv_rope_freqs is not None:
        return None
    r = bad[0]
    B, S, H, D = cap.q.shape
    row = rows_of(cap).part(slice(r, r + 1))
    valid, tokens, pools = row.valid[0], row.token[0], row.pool_id[0]  # [W]
    keys = gather_keys(cap, row)[0]  # [W, D]
    q = cap.q.reshape(B * S, H, D)[r].double()  # [H, D]
    want = out.double().reshape(B * S, H, -1)[r]  # [H, Dv]
    best = None
    for shift in (1, -1):
        moved, ok = _moved_keys(cap, tokens, pools, valid, shift)  # [W, D], [W]
        err = one_entry_errors(cap, q, keys, valid, want, moved)  # [W]
        err = torch.where(ok, err, torch.full_like(err, float("inf")))
        j = int(err.argmin())
        if best is None or float(err[j]) < best[0]:
            best = (float(err[j]), j, shift, moved[j])
    if best is None or best[0] == float("inf"):
        return None
    _, j, shift, key = best
    keys2 = keys.clone()
    keys2[j] = key
    judged = judge_row_variant("other_rows_read", cap, out, ref, ctrl, tol, r, q, keys2, valid)
    if not judged.passed:
        return None
    pool = int(pools[j])
    meant = int(tokens[j])
    return ({"entry": entry_position(cap, r, j, pools, valid), "cache": "extra" if pool else "main",
             "slot_read": meant + shift, "slot_meant": meant}, r // S, judged)  # fmt: skip


def judge_row_variant(name: str, cap: SparseCapture, out: torch.Tensor, ref: SparseOutput, ctrl: SparseOutput,
                      tol: Tolerance, r: int, q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor) -> Comparison:  # fmt: skip
    """Query row r's output recomputed from ``keys`` [W, D] with ``valid`` [W] (a variant of what
    it read), spliced into the reference, and production's output judged against it at the
    reference's noise floor (the control's distance from it) by the one comparator."""
    B, S, H, _ = cap.q.shape
    o, lse = sparse_attention(q[None], keys[None], valid[None], cap.attn_sink, cap.meta.softmax_scale, cap.meta.head_dim_v)
    v_out, v_lse = ref.out.clone(), ref.lse.clone()
    v_out.view(B * S, H, -1)[r], v_lse.view(B * S, H)[r] = o[0], lse[0]
    noise = torch.nan_to_num(ctrl.out - ref.out)
    return judge_out(name, cap, out, SparseOutput(v_out, v_lse), SparseOutput(v_out + noise, v_lse), tol)


def entry_position(cap: SparseCapture, r: int, j: int, pools: torch.Tensor, valid: torch.Tensor) -> int:
    """Row r's entry j (of its gathered rows) as its position in its cache's index list."""
    pool = int(pools[j])
    return list_positions(cap, r, pool)[int(((pools == pool) & valid)[:j].sum())]


def _moved_keys(cap: SparseCapture, tokens: torch.Tensor, pools: torch.Tensor, valid: torch.Tensor,
                shift: int) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Each entry's key read at token + shift [W, D], and whether that token is in its cache [W]."""
    m = cap.meta
    moved = torch.zeros(tokens.shape[0], m.layout.head_dim, dtype=torch.float64)
    ok = torch.zeros(tokens.shape[0], dtype=torch.bool)
    for pid, (cache, layout, page) in enumerate(((cap.k_cache, m.layout, m.page_size),
                                                 (cap.extra_k_cache, m.extra_layout, m.extra_page_size))):  # fmt: skip
        if cache is None:
            continue
        t = tokens + shift
        sel = valid & (pools == pid) & (t >= 0) & (t < cache.shape[0] * page)
        if bool(sel.any()):
            moved[sel] = dequantize(cache, layout, page, m.kv_fp8_dtype, t[sel])
            ok |= sel & torch.isfinite(moved).all(dim=1)
    return moved, ok


def one_entry_errors(cap: SparseCapture, q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, want: torch.Tensor,
                     moved: Optional[torch.Tensor] = None) -> torch.Tensor:  # fmt: skip
    """[W]: the row's max abs error against ``want`` [H, Dv] when entry j alone reads ``moved[j]``
    (None: entry j is not read at all), by a rank-one update of the softmax's numerator and
    denominator per entry, in chunks of entries within the block budget."""
    Dv, scale = cap.meta.head_dim_v, cap.meta.softmax_scale
    keys = torch.where(valid[:, None], keys, 0.0)
    s = scale * keys @ q.T  # [W, H]
    s = s.masked_fill(~valid[:, None], float("-inf"))
    m = s.max(dim=0).values.clamp(min=-1e300)  # [H]
    w = torch.exp(s - m)  # [W, H]
    Z = w.sum(0)  # [H]
    if cap.attn_sink is not None:
        Z = Z + torch.exp(cap.attn_sink.double() - m)
    N = w.T @ keys[:, :Dv]  # [H, Dv]
    if moved is None:
        moved, w2 = keys, torch.zeros_like(w)
    else:
        w2 = torch.exp((scale * moved @ q.T - m).clamp(max=700.0)).masked_fill(~valid[:, None], 0.0)  # [W, H]
    err = torch.empty(keys.shape[0], dtype=torch.float64)  # [W]
    step = max(1, ROW_BLOCK_BYTES // (3 * 8 * q.shape[0] * Dv))  # entries a chunk updates: [n, H, Dv] within the block budget
    for j in range(0, keys.shape[0], step):
        c = slice(j, j + step)
        N2 = N[None] - w[c, :, None] * keys[c, None, :Dv] + w2[c, :, None] * moved[c, None, :Dv]  # [n, H, Dv]
        Z2 = Z[None] - w[c] + w2[c]  # [n, H]
        err[c] = (N2 / Z2[..., None] - want[None]).abs().nan_to_num(float("inf")).amax(dim=(1, 2))
    return err


def list_positions(cap: SparseCapture, r: int, pool: int) -> list[int]:
    """The positions in row r's index list (of ``pool``'s cache) of the entries it reads, in order."""
    B, S = cap.q.shape[:2]
    idx, ln = (cap.indices, cap.topk_length) if pool == 0 else (cap.extra_indices, cap.extra_topk_length)
    row = idx.reshape(B * S, -1)[r].long()
    n = row.shape[0] if ln is None else int(ln[r // S])
    return [k for k in range(min(n, row.shape[0])) if int(row[k]) != -1]


__all__ = ["entry_position", "judge_row_variant", "list_positions", "neighbour_slot", "one_entry_errors",
           "rows_permuted"]

"""The structural checks a replay depends on, as a list of small checks run in order.

Each check takes the capture and the list of warnings so far; it raises :class:`CaptureError`
naming the tensor, or appends a warning. Later checks rely on what earlier ones established (the
dtypes, then the shapes of the core tensors, then their contents), so a new bound goes after the
checks whose guarantees it uses, as one more function in :data:`CHECKS`.
"""

from __future__ import annotations

from typing import Callable

import torch

from refmla import blocktable
from refmla.capture.format import (
    FLOAT_DTYPES, INDEX_DTYPES, MASK_DTYPES, MAX_HEADS, MAX_KV_SPLITS, Capture, CaptureError,
)  # fmt: skip
from refmla.capture.rows import check_row_tokens
from refmla.util import dtype_name, request_label

AITER_BUFFERS = {  # aiter's persistent work buffers: name -> trailing shape (None: 1-D)
    "aiter_work_indptr": None, "aiter_work_info_set": 8, "aiter_reduce_indptr": None,
    "aiter_reduce_final_map": 2, "aiter_reduce_partial_map": None,
}  # fmt: skip
INDEX_TENSORS = ("kv_indptr", "kv_indices", "seq_lens", "num_kv_splits", "req_to_token", "orig_kv_indices",
                 "qo_indptr", "mask_indptr", *AITER_BUFFERS, "block_table", "query_start_loc",
                 "flashmla_tile_scheduler_metadata", "flashmla_num_splits")  # fmt: skip
FLOAT_TENSORS = ("q", "kv_buffer", "out", "lse", "attn_logits", "attn_lse", "dcp_out", "dcp_in_out", "dcp_in_lse")
KNOWN_BACKENDS = ("triton", "aiter", "unknown", "vllm_triton", "flashmla", "flashinfer_mla", "cutlass_mla", "fa3_mla",
                  "trtllm_mla")
# q and the pool in what a kernel reads (docs/contract.md section 1): no fp64, no integers
INPUT_DTYPES = FLOAT_DTYPES - {torch.float64}


def validate(cap: Capture) -> list[str]:
    """Structural checks a replay depends on. Raises CaptureError; returns warnings."""
    warnings: list[str] = []
    for check in CHECKS:
        check(cap, warnings)
    return warnings


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


def _err(cap: Capture, name: str, msg: str) -> CaptureError:
    return CaptureError(cap.path, f"tensor '{name}'", msg)


def _shape(cap: Capture, name: str, t: torch.Tensor, want: tuple) -> None:
    """``t`` has ``len(want)`` dims, each equal to its ``want`` entry (None: any size)."""
    if t.dim() != len(want) or any(w is not None and s != w for s, w in zip(t.shape, want)):
        pretty = "[" + ", ".join("?" if w is None else str(w) for w in want) + "]"
        raise _err(cap, name, f"shape {list(t.shape)}, expected {pretty}")


def _first(mask: torch.Tensor) -> int:
    """Index of the first True of a 1-D mask."""
    return int(torch.nonzero(mask)[0])


# --------------------------------------------------------------------------------------------
# The checks, in the order they run
# --------------------------------------------------------------------------------------------


def check_dtypes(cap: Capture, warnings: list[str]) -> None:
    """Index tensors int32 / int64, value tensors floating point; q and kv_buffer bf16 / fp16 / fp32 / fp8."""
    for names, allowed in ((INDEX_TENSORS, INDEX_DTYPES), (FLOAT_TENSORS, FLOAT_DTYPES)):
        for name in names:
            t = getattr(cap, name)
            if t is not None and t.dtype not in allowed:
                raise _err(cap, name, f"dtype {dtype_name(t.dtype)} not allowed here")
    for name in ("q", "kv_buffer"):
        t = getattr(cap, name)
        if t.dtype not in INPUT_DTYPES:
            raise _err(cap, name, f"dtype {dtype_name(t.dtype)} is not a kernel input dtype (bf16, fp16, fp32, fp8)")
    if cap.custom_mask is not None and cap.custom_mask.dtype not in MASK_DTYPES:
        raise _err(cap, "custom_mask", f"dtype {dtype_name(cap.custom_mask.dtype)} not allowed here (bool, uint8, int8)")


def check_core_shapes(cap: Capture, warnings: list[str]) -> None:
    """kv_indptr [B + 1], q [T, H, D] (T = B in decode), kv_buffer [N, 1, D], seq_lens [B], kv_indices [?]."""
    D = cap.meta.head_dim
    _shape(cap, "kv_indptr", cap.kv_indptr, (None,))
    B = cap.batch_size
    if B < 0:
        raise _err(cap, "kv_indptr", "empty; expected [B + 1] entries")
    _shape(cap, "q", cap.q, (None, None, D))
    T = cap.q.shape[0]
    if cap.q.shape[1] < 1:
        raise _err(cap, "q", f"shape {list(cap.q.shape)} has no heads; expected [T, H >= 1, {D}]")
    if cap.q.shape[1] > MAX_HEADS:
        raise _err(cap, "q", f"{cap.q.shape[1]} heads exceed the bound of {MAX_HEADS} (MLA models have <= 128)")
    if cap.is_decode and T != B:
        raise _err(cap, "q", f"has {T} requests but kv_indptr describes {B}")
    _shape(cap, "kv_buffer", cap.kv_buffer, (None, 1, D))
    _shape(cap, "seq_lens", cap.seq_lens, (B,))
    _shape(cap, "kv_indices", cap.kv_indices, (None,))


def check_kv_indptr(cap: Capture, warnings: list[str]) -> None:
    """Monotone, starts at a non-negative offset (warned when not 0), ends at len(kv_indices)."""
    indptr = cap.kv_indptr.long()
    if cap.batch_size > 0 and bool((indptr[1:] < indptr[:-1]).any()):
        b = _first(indptr[1:] < indptr[:-1])
        raise _err(cap, "kv_indptr", f"not monotone: kv_indptr[{b + 1}]={int(indptr[b + 1])} < kv_indptr[{b}]={int(indptr[b])}")
    start = int(indptr[0])
    if start < 0:
        raise _err(cap, "kv_indptr", f"kv_indptr[0]={start} is negative")
    if start != 0:
        warnings.append(f"kv_indptr[0]={start}: the first {start} kv_indices are unused")
    if int(indptr[-1]) != cap.kv_indices.shape[0]:
        raise _err(cap, "kv_indices", f"length {cap.kv_indices.shape[0]} != kv_indptr[-1]={int(indptr[-1])}")


def check_seq_lens(cap: Capture, warnings: list[str]) -> None:
    """Non-negative and equal to the kv_indptr differences."""
    seq = cap.seq_lens.long()
    if bool((seq < 0).any()):
        b = _first(seq < 0)
        raise _err(cap, "seq_lens", f"negative length seq_lens[{b}]={int(seq[b])}")
    indptr = cap.kv_indptr.long()
    lens = indptr[1:] - indptr[:-1]
    if not torch.equal(seq, lens):
        b = _first(seq != lens)
        raise _err(cap, "seq_lens", f"seq_lens[{b}]={int(seq[b])} but kv_indptr gives {int(lens[b])} tokens")


def check_kv_indices(cap: Capture, warnings: list[str]) -> None:
    """Every token slot is a row of kv_buffer."""
    N = cap.kv_buffer.shape[0]
    idx = cap.kv_indices.long()
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= N):
        j = _first((idx < 0) | (idx >= N))
        raise _err(cap, "kv_indices", f"kv_indices[{j}]={int(idx[j])} out of range for kv_buffer with {N} rows")


def check_num_kv_splits(cap: Capture, warnings: list[str]) -> None:
    """When captured: [B], every count in [1, max_kv_splits] (meta; else the ceiling MAX_KV_SPLITS).

    A count above ceil(seq_len / 32) is legal (its trailing splits are empty: SGLang's static
    schedule does it); work follows the splits that hold tokens, never the count itself."""
    splits, B = cap.num_kv_splits, cap.batch_size
    if splits is None:
        return
    _shape(cap, "num_kv_splits", splits, (B,))
    if B and int(splits.min()) < 1:
        b = _first(splits < 1)
        raise _err(cap, "num_kv_splits", f"num_kv_splits[{b}]={int(splits[b])} must be >= 1")
    ceiling = cap.meta.max_kv_splits or MAX_KV_SPLITS
    what = "meta max_kv_splits" if cap.meta.max_kv_splits else "the ceiling on max_kv_splits"
    if B and int(splits.max()) > ceiling:
        b = _first(splits > ceiling)
        raise _err(cap, "num_kv_splits", f"num_kv_splits[{b}]={int(splits[b])} exceeds {what} ({ceiling})")


def check_optional_shapes(cap: Capture, warnings: list[str]) -> None:
    """out / lse per row (requests in decode, tokens in extend), split partials per request."""
    B, Dv = cap.batch_size, cap.meta.kv_lora_rank
    rows, H = cap.q.shape[0], cap.q.shape[1]  # rows of out / lse: requests in decode, tokens in extend
    if cap.out is not None:
        _shape(cap, "out", cap.out, (rows, H, Dv))
    if cap.lse is not None:
        _shape(cap, "lse", cap.lse, (rows, H))
    if cap.attn_logits is not None:
        _shape(cap, "attn_logits", cap.attn_logits, (B, H, None, Dv))
        S, ceiling = cap.attn_logits.shape[2], cap.meta.max_kv_splits or MAX_KV_SPLITS
        if S > ceiling:
            raise _err(cap, "attn_logits", f"{S} splits exceed max_kv_splits ({ceiling})")
    if cap.attn_lse is not None:
        S = cap.attn_logits.shape[2] if cap.attn_logits is not None else None
        _shape(cap, "attn_lse", cap.attn_lse, (B, H, S))
    if cap.req_to_token is not None:
        _shape(cap, "req_to_token", cap.req_to_token, (B, None))
    if cap.orig_kv_indices is not None:
        _shape(cap, "orig_kv_indices", cap.orig_kv_indices, (cap.kv_indices.shape[0],))


def check_aiter_buffers(cap: Capture, warnings: list[str]) -> None:
    """aiter's persistent work buffers, when captured: 1-D, or [?, 8] / [?, 2] (their tails are
    whatever torch.empty held: only their shapes are checked here)."""
    for name, cols in AITER_BUFFERS.items():
        t = getattr(cap, name)
        if t is not None:
            _shape(cap, name, t, (None,) if cols is None else (None, cols))


def check_flashmla_plan(cap: Capture, warnings: list[str]) -> None:
    """FlashMLA's plan, when captured: both tensors, [P, 8] and [B + 1], and its layout named in meta
    (the plan's contents are refmla inspect's to judge: refmla.flashmla_plan)."""
    meta, num = cap.flashmla_tile_scheduler_metadata, cap.flashmla_num_splits
    if meta is None and num is None:
        return
    if meta is None or num is None:
        missing = "flashmla_tile_scheduler_metadata" if meta is None else "flashmla_num_splits"
        raise _err(cap, missing, "missing (FlashMLA's plan is both tensors)")
    _shape(cap, "flashmla_tile_scheduler_metadata", meta, (None, 8))
    _shape(cap, "flashmla_num_splits", num, (cap.batch_size + 1,))
    if cap.meta.extra.get("flashmla_sched_layout") not in ("block", "struct"):
        raise CaptureError(cap.path, "meta key 'flashmla_sched_layout'",
                           f"must be 'block' or 'struct' with a FlashMLA plan, got {cap.meta.extra.get('flashmla_sched_layout')!r}")


def check_qo_indptr(cap: Capture, warnings: list[str]) -> None:
    """Extend / verify: [B + 1] from 0, monotone, ending at q's token count, no request with more
    new tokens than its length. Decode: ignored (warned)."""
    if cap.is_decode:
        if cap.qo_indptr is not None:
            warnings.append("qo_indptr is ignored in decode mode")
        return
    if cap.qo_indptr is None:
        raise _err(cap, "qo_indptr", f"missing (required in {cap.meta.mode} mode)")
    B, T = cap.batch_size, cap.q.shape[0]
    _shape(cap, "qo_indptr", cap.qo_indptr, (B + 1,))
    qo = cap.qo_indptr.long()
    if int(qo[0]) != 0 or bool((qo[1:] < qo[:-1]).any()):
        raise _err(cap, "qo_indptr", "must start at 0 and be monotone")
    if int(qo[-1]) != T:
        raise _err(cap, "qo_indptr", f"qo_indptr[-1]={int(qo[-1])} but q has {T} tokens")
    seq, qlen = cap.seq_lens.long(), qo[1:] - qo[:-1]
    if bool((qlen > seq).any()):
        b = _first(qlen > seq)
        raise _err(cap, "qo_indptr", f"{request_label(b)} has {int(qlen[b])} new tokens but seq_len {int(seq[b])}")


def check_page_size(cap: Capture, warnings: list[str]) -> None:
    """meta page_size within the pool: a pool that is not compacted (no orig_kv_indices) holds
    whole pages, so at least one page of rows."""
    N, P = cap.kv_buffer.shape[0], cap.meta.page_size
    if cap.orig_kv_indices is None and N > 0 and P > N:
        raise CaptureError(cap.path, "meta key 'page_size'", f"{P} is larger than the pool (kv_buffer has {N} rows)")


def check_meta_lists(cap: Capture, warnings: list[str]) -> None:
    """Per-request lists in meta (rids) have one entry per request."""
    rids, B = cap.meta.rids, cap.batch_size
    if rids is not None and len(rids) != B:
        raise CaptureError(cap.path, "meta key 'rids'", f"has {len(rids)} entries for {B} requests")


def check_dcp(cap: Capture, warnings: list[str]) -> None:
    """Decode context parallelism's keys (docs/context-parallel.md): all three or none, the rank
    below the world, one whole length per request, dcp_out this rank's share of the heads."""
    m, B = cap.meta, cap.batch_size
    keys = ("dcp_world_size", "dcp_rank", "dcp_interleave_size")
    given = [k for k in keys if getattr(m, k) is not None]
    if given and len(given) < 3:
        missing = next(k for k in keys if getattr(m, k) is None)
        raise CaptureError(cap.path, f"meta key '{missing}'", f"missing (the capture has {given[0]})")
    if not given:
        if any(t is not None for t in (cap.dcp_out, cap.dcp_in_out, cap.dcp_in_lse)) or m.dcp_tot_seq_lens is not None:
            raise CaptureError(cap.path, "meta key 'dcp_world_size'", "missing (the capture has decode context parallelism's data)")
        return
    if m.dcp_rank >= m.dcp_world_size:
        raise CaptureError(cap.path, "meta key 'dcp_rank'", f"{m.dcp_rank} is not below dcp_world_size {m.dcp_world_size}")
    tot = m.dcp_tot_seq_lens
    if tot is not None and (len(tot) != B or any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in tot)):
        raise CaptureError(cap.path, "meta key 'dcp_tot_seq_lens'", f"expected {B} non-negative integers (one per request)")
    if cap.dcp_out is not None:
        H, W = cap.q.shape[1], m.dcp_world_size
        if H % W:
            raise _err(cap, "dcp_out", f"q's {H} heads do not divide among dcp_world_size {W} ranks")
        _shape(cap, "dcp_out", cap.dcp_out, (cap.q.shape[0], H // W, m.kv_lora_rank))
    if cap.dcp_in_out is not None:
        _shape(cap, "dcp_in_out", cap.dcp_in_out, (cap.q.shape[0], cap.q.shape[1], m.kv_lora_rank))
    if cap.dcp_in_lse is not None:
        _shape(cap, "dcp_in_lse", cap.dcp_in_lse, (cap.q.shape[0], cap.q.shape[1]))


def warn_q_values(cap: Capture, warnings: list[str]) -> None:
    """fp8 q (no q scale in the format) and NaN / Inf in q: replayed, with a warning."""
    if cap.q.dtype.itemsize == 1:
        warnings.append("q is fp8: the format carries no q scale, replayed as stored")
    bad_q = ~torch.isfinite(cap.q.float())
    if bool(bad_q.any()):
        r = int(torch.nonzero(bad_q)[0][0])
        warnings.append(f"q has {int(bad_q.sum())} NaN/Inf values (first in row {r}); replayed anyway")


def warn_backend_name(cap: Capture, warnings: list[str]) -> None:
    """meta backend outside triton / aiter / unknown."""
    if cap.meta.backend not in KNOWN_BACKENDS:
        warnings.append(f"meta backend {cap.meta.backend!r} is not one of {', '.join(KNOWN_BACKENDS)}")


def check_verify(cap: Capture, warnings: list[str]) -> None:
    """Verify: every request verifies at least one token; ``draft_token_num`` (when given) is every
    request's query count, as in SGLang's target_verify; ``topk`` > 1 (a tree) needs a custom_mask."""
    if not cap.is_verify:
        return
    qo = cap.qo_indptr.long()
    qlen = qo[1:] - qo[:-1]
    if bool((qlen < 1).any()):
        b = _first(qlen < 1)
        raise _err(cap, "qo_indptr", f"{request_label(b)} has no query token (verify needs at least one)")
    n = cap.meta.draft_token_num
    if n is not None and bool((qlen != n).any()):
        b = _first(qlen != n)
        raise _err(cap, "qo_indptr", f"{request_label(b)} has {int(qlen[b])} query tokens but meta draft_token_num is {n}")
    if (cap.meta.topk or 1) > 1 and cap.custom_mask is None:
        raise _err(cap, "custom_mask", f"missing: meta topk {cap.meta.topk} > 1 is a tree, which needs its mask")


def check_custom_mask(cap: Capture, warnings: list[str]) -> None:
    """Verify: custom_mask and mask_indptr together; mask_indptr [B + 1] from 0 in steps of
    n_b * L_b (request b's row-major [n_b, L_b] mask over its whole sequence), ending at the
    mask's length; each query sees itself. Other modes: ignored (warned)."""
    mask, mptr = cap.custom_mask, cap.mask_indptr
    if mask is None and mptr is None:
        return
    if not cap.is_verify:
        warnings.append(f"custom_mask / mask_indptr are ignored in {cap.meta.mode} mode")
        return
    if mask is None or mptr is None:
        missing = "custom_mask" if mask is None else "mask_indptr"
        raise _err(cap, missing, "missing: custom_mask and mask_indptr come together")
    B = cap.batch_size
    _shape(cap, "custom_mask", mask, (None,))
    _shape(cap, "mask_indptr", mptr, (B + 1,))
    qo, seq, m = cap.qo_indptr.long(), cap.seq_lens.long(), mptr.long()
    want = (qo[1:] - qo[:-1]) * seq  # [B] n_b * L_b
    if int(m[0]) != 0:
        raise _err(cap, "mask_indptr", f"mask_indptr[0]={int(m[0])}, expected 0")
    sizes = m[1:] - m[:-1]
    if not torch.equal(sizes, want):
        b = _first(sizes != want)
        raise _err(cap, "mask_indptr", f"{request_label(b)}: {int(sizes[b])} mask entries, expected n*L = "
                                       f"{int(qo[b + 1] - qo[b])}*{int(seq[b])} = {int(want[b])}")  # fmt: skip
    if int(m[-1]) != mask.shape[0]:
        raise _err(cap, "custom_mask", f"length {mask.shape[0]} != mask_indptr[-1]={int(m[-1])}")
    _check_mask_rows(cap, warnings, qo, seq, m)


def _check_mask_rows(cap: Capture, warnings: list[str], qo, seq, m) -> None:
    """Query i of request b must see itself (position L - n + i); prefix columns the kernels ignore
    (SGLang's skip_prefix_custom_mask) should be all True: warned, the reference uses them as given."""
    mask = cap.custom_mask != 0
    hidden_prefix = []
    for b in range(cap.batch_size):
        n, L = int(qo[b + 1] - qo[b]), int(seq[b])
        rows = mask[int(m[b]) : int(m[b + 1])].view(n, L)  # [n, L]
        diag = rows[torch.arange(n), torch.arange(L - n, L)]  # [n]
        if not bool(diag.all()):
            i = _first(~diag)
            raise _err(cap, "custom_mask", f"{request_label(b)}: query {i} does not see its own position {L - n + i}")
        if not bool(rows[:, : L - n].all()):
            hidden_prefix.append(b)
    if hidden_prefix:
        warnings.append(f"custom_mask hides prefix positions of requests {hidden_prefix[:8]}: SGLang's Triton "
                        "kernel ignores prefix columns (skip_prefix_custom_mask); the reference applies them")  # fmt: skip


def check_block_table(cap: Capture, warnings: list[str]) -> None:
    """block_table [B, M] consistent with seq_lens, the pool and kv_indices (one line per
    inconsistency; the null block inside a sequence is warned); query_start_loc [R + 1] from 0,
    monotone, ending at B (vLLM's multi-token decode: request r's rows of the call)."""
    table = cap.block_table
    if table is not None:
        _shape(cap, "block_table", table, (cap.batch_size, None))
        found = blocktable.problems(table, cap.seq_lens, cap.meta.page_size, cap.kv_buffer.shape[0])
        if found.errors:
            raise _err(cap, "block_table", found.text(found.errors))
        _, rows = blocktable.token_rows(table, cap.seq_lens, cap.meta.page_size)
        if not torch.equal(rows, cap.kv_indices.long()):
            j = _first(rows != cap.kv_indices.long())
            raise _err(cap, "kv_indices", f"kv_indices[{j}]={int(cap.kv_indices[j])} but block_table gives row {int(rows[j])}")
    if cap.meta.null_block is not None:
        physical = cap.orig_kv_indices if cap.orig_kv_indices is not None else cap.kv_indices
        warnings.extend(blocktable.null_block_reads(cap.kv_indptr, physical, cap.meta.page_size, cap.meta.null_block))
    qsl = cap.query_start_loc
    if qsl is not None:
        _shape(cap, "query_start_loc", qsl, (None,))
        q = qsl.long()
        if q.numel() < 1 or int(q[0]) != 0 or bool((q[1:] < q[:-1]).any()) or int(q[-1]) != cap.q.shape[0]:
            raise _err(cap, "query_start_loc", f"must start at 0, be monotone and end at q's {cap.q.shape[0]} rows")


Check = Callable[[Capture, list], None]

# run in this order: each relies on the ones before it
CHECKS: tuple[Check, ...] = (
    check_dtypes,
    check_core_shapes,
    check_kv_indptr,
    check_seq_lens,
    check_kv_indices,
    check_num_kv_splits,
    check_optional_shapes,
    check_aiter_buffers,
    check_flashmla_plan,
    check_qo_indptr,
    check_page_size,
    check_meta_lists,
    check_verify,
    check_custom_mask,
    check_block_table,
    check_dcp,
    check_row_tokens,
    warn_q_values,
    warn_backend_name,
)

__all__ = ["CHECKS", "validate"]

"""Hypotheses for a diverging output (docs/contract.md section 4): replay the reference under each,
report the first, in the table's order, that brings the backend's error back to rounding noise.

    numerics            {"variant": name}             the same attention with different rounding
                                                      (a store, P, the lse, accumulation, a merge)
    last_page_read_full {"page", "rows_read", ...}    page_size > 1: the last page read as full
    empty_split_merged  {"split", "num_kv_splits",    an empty split's NaN / zero-scratch partial merged in
                         "went_in"}
    seq_len_off_by      {"delta": k}                  attended seq_len + k tokens, k in -4..4, k != 0
                                                      (k > 0 through the block table: a read past it;
                                                      delta -1: newest_kv_unwritten listed as an
                                                      alternative when it fits too)
    newest_kv_unwritten {"how": "zero"}               the newest position's KV row read as zeros
                        {"how": "stale"}              ... or as other bytes, a row fitted to the output
                                                      (stale.py: tried last of all, after LATE numerics)
    offset_overflow     {"first_slot", "position",    a 32-bit row offset wrapped: positions past the
                         "offset", "reads"}           wrap read another slot's bytes, or zeros
    last_page_len_swapped {"from_request", ...}       the last page's length from another request
    pages_read_off      {"pages": k, "page_size"}     the request's positions read k pages on (k < 0: back)
    other_request_read  {"from_request": c}           the request attended request c's rows (both ways:
                                                      "swapped" in extra)
    other_rows_read     {"page", "from_request",      a page of the request holds another page of the
                         "from_page"}                 capture's pool (another request's, or its own)
    kv_range_missing    {"start", "end", "how"}       positions [start, end) dropped or read as zeros,
                                                      at page or split granularity
    null_block_read     {"page", "null_block"}        block_table captures: page j read from the null block
    pages_as_tokens     {"read"}                      block_table captures: page ids taken for token slots
                                                      (or the reverse)
    block_table_read_off {"entries": k}               block_table captures: page j read from table entry j + k
    other_table_row_read {"from_request": c}          block_table captures: the request's positions read
                                                      through table row c (its row pointer off)
    split_missing       {"split": s}                  split s's partial left out of the merge (its positions
                                                      dropped listed as kv_range_missing under other_causes)
    kv_range_repeated   {"split", "start", "end"}     split s done twice, both partials merged
    work_item_misrouted {"request", "split", "start", split s of a request merged into request
                         "end", "to_request"}         to_request's output instead of its own
    partials_misaddressed {"stride", "axis", "side"}  stage 2 read (or stage 1 wrote) the partials at
                                                      another split / head stride
    kv_fp8_encoding_mismatch {"written", "read"}      an fp8 pool read in another encoding (kv_bytes.py)
    kv_scale_misapplied {"scale", "applied"}          fp8 k_scale / v_scale applied twice, not at all, or
                                                      one in the other's place
    kv_scale_format     {"scale", "stored", "read",   the fp32 dequant scale read as bf16 / UE8M0 (kv_bytes.py)
                         "how", "value_read"}
    kv_page_stride      {"stride", "page_stride",     block_table captures: the pages read at another
                         "cache"}                     page stride (bytes; kv_bytes.py)
    wrong_sm_scale      {"ratio": r}                  used r * sm_scale
    heads_folded        {"fold": f, "how"}            a folded launch (H / f heads per pseudo-row) unfolded
                                                      wrongly: mixed / transposed / zero / duplicated
    head_misaligned     {"mapping": "...", "heads"}   output head h holds reference head heads[h]
    output_rows_permuted {"rows": {r: r2}}            output row r holds request r2's output
    rope_mishandled     {"how"}                       q . k without its rope part, or parts swapped
    logit_cap_mismatch  {"logit_cap": c}              soft cap c applied (0: omitted)
    padded_row_leak     {"padded_requests",           a zero-length request's NaN leaked into other rows
                         "nan_requests"}              (stated, not recomputed: tried last)

    verify captures only (verify.py, tried right after last_page_len_swapped):
    draft_kv_missing    {"how", "drafts"}             the drafts' KV rows zeroed / not attended
    causal_alignment    {"alignment"}                 top-left causal, or none among the drafts
    mask_wrong_request  {"mask_of": b2}               the drafts see each other through b2's tree mask
    qlen_pow2_padding   {"qlen", "padded_to", "reads"} qlen padded to a power of two: wrong queries / rows

Within a family, every candidate that confirms counts: the simplest is reported, the others are
listed as its ``alternatives`` (refmla.hypotheses.drivers). ``numerics`` comes first: its
rounding variants must also fit the kernel's noise row by row, which a data fault does not; its
accumulation variants, whose noise depends on the summation order and is judged by its size
alone, come last (LATE).

"Back to rounding noise" is the comparator itself (refmla.compare.compare, the replay's
tolerance) against the reference *and the low-precision control* recomputed under the
hypothesis, so a hypothesis is never judged against the noise of different math. Per-request
hypotheses change only the failing requests, each with its own detail, and must still pass every
other row; the report names the worst request and lists the others under ``requests``.

The package (imports go down this list):

    search.py    Search: the failing rows and requests, each request's fp64 pieces, attention
                 under a modified sequence, the comparator as judge; Candidate; SCREEN, CONFIRM_TOP
    drivers.py   per_request / global_hypothesis: candidates -> a confirmed Explanation; rescore
    ranges.py    block-sum algebra: every block-aligned range of a request scored at once
    scalars.py   screening a scalar on the worst request in fp32, the 1-D fit, whole-output recompute
    one module per family, each with NAME and ``search(s: Search) -> Optional[Explanation]``:
    seq_len.py, kv_range.py, split.py, sm_scale.py, heads_folded.py, head_misaligned.py, logit_cap.py,
    numerics.py, verify.py
    (the speculative verify families), and the faults of real
    MLA kernels (refmla/synthetic/zoo.py plants them): pages.py (two families), empty_split.py,
    overflow.py, kv_scale.py, kv_bytes.py, rope.py, partials.py (three families of the split partials' plan),
    misplaced.py (five families: KV read or output written in the
    wrong place), blocktable.py (three families of block-table kernels); stale.py (the newest row
    read as stale bytes, fitted: tried last)
    sparse.py    a sparse decode capture's search: numerics' variants that apply to it (the same
                 mechanism, numerics.Trials) around refmla.sparse.hypotheses' mistakes

A new family is a module like those (its candidates through ``per_request`` when each failing
request gets its own detail, ``global_hypothesis`` when one setting explains the whole output)
and one line in SEARCHES below, at its place in the order: simplest first, the first that
confirms is the answer. How it stays fast (8 requests x 1300 tokens x 8 heads:
tools/bench_explain.py): only failing requests are recomputed, worst first, and a per-request
hypothesis that cannot explain the worst request is abandoned at once; each family screens its
candidates cheaply (block sums, fp32 on the worst request's worst rows) and confirms only the
best few.
"""

from __future__ import annotations

import time
from typing import Any, Iterator, Optional

import torch

from refmla.compare import Comparison
from refmla.context import ReplayContext
from refmla.hypotheses import (
    blocktable, empty_split, head_misaligned, heads_folded, kv_bytes, kv_range, kv_scale, logit_cap, misplaced, numerics,
    overflow,
    pages, partials, rope, seq_len, sm_scale, split, stale, verify,
)
from refmla.hypotheses.search import Search, SearchFn
from refmla.results import Alternative, Explanation
from refmla.util import error_text, single_thread

# The families in the order they are tried: the contract's order, simplest first.
SEARCHES: dict[str, SearchFn] = {
    numerics.NAME: numerics.search,
    pages.FULL: pages.search_full,
    empty_split.NAME: empty_split.search,
    seq_len.NAME: lambda s: misplaced.newest_alternative(s, seq_len.search(s)),  # and the newest row unwritten
    misplaced.NEWEST: misplaced.search_newest,
    overflow.NAME: overflow.search,
    pages.SWAPPED: pages.search_swapped,
    # the speculative verify path (verify captures only; docs/contract.md section 4)
    "draft_kv_missing": verify.search_draft_kv,
    "causal_alignment": verify.search_causal,
    "mask_wrong_request": verify.search_mask,
    "qlen_pow2_padding": verify.search_pow2,
    blocktable.TABLE_OFF: blocktable.search_table_off,  # block tables: the page-level shift first
    blocktable.TABLE_ROW: blocktable.search_table_row,
    misplaced.PAGES_OFF: misplaced.search_pages_off,
    misplaced.OTHER_REQUEST: misplaced.search_other_request,
    misplaced.OTHER_ROWS: misplaced.search_other_rows,
    kv_range.NAME: kv_range.search,
    blocktable.NULL_BLOCK: blocktable.search_null_block,
    blocktable.PAGES_AS_TOKENS: blocktable.search_pages_as_tokens,
    split.NAME: lambda s: kv_range.dropped_alternative(s, split.search(s)),  # and its positions dropped
    # the split partials repeated, routed to another request, read at another stride (decode, >= 2 splits)
    partials.REPEATED: partials.search_repeated,
    partials.MISROUTED: partials.search_misrouted,
    partials.MISADDRESSED: partials.search_misaddressed,
    kv_bytes.ENCODING: kv_bytes.search_encoding,  # the bytes read in another fp8 encoding (K and V x 2 or / 2)
    kv_scale.NAME: kv_scale.search,
    kv_bytes.FORMAT: kv_bytes.search_format,  # the fp32 scale read as bf16 / UE8M0
    kv_bytes.STRIDE: kv_bytes.search_page_stride,  # a block table's pages read at another page stride
    sm_scale.NAME: sm_scale.search,
    heads_folded.NAME: heads_folded.search,  # a fold's patterns named before a bare head mapping
    head_misaligned.NAME: head_misaligned.search,
    misplaced.PERMUTED: misplaced.search_permuted,
    rope.NAME: rope.search,
    logit_cap.NAME: logit_cap.search,
    # stated, not recomputed: last, so any family that recomputes the NaN (a read past the end into
    # a NaN row, an empty split's 0 / 0) is preferred
    blocktable.PADDED_LEAK: blocktable.search_padded_leak,
}
HYPOTHESES = tuple(SEARCHES)
# Tried after all of SEARCHES: numerics' accumulation variants (judged by their noise's size only),
# then the newest row read as stale bytes (a row fitted to the output: the freest hypothesis)
LATE: tuple[SearchFn, ...] = (numerics.search_late, stale.search)


def explain_failure(
    ctx: ReplayContext, out: torch.Tensor, cmp: Comparison, notes: Optional[dict[str, Any]] = None
) -> Optional[Explanation]:
    """The simplest hypothesis that explains a failing output, or None.

    The first family, in SEARCHES order, that explains every failing request; when none does, the
    first that explains some of them (its ``unexplained_requests`` say which are left).

    out: the backend's output [R, H, Dv]; cmp: its comparison with the reference (ctx.compare).
    notes (optional): filled with what the search learnt besides the answer: ``numerics_tried``,
    the numerics variants and their residuals (whatever explains the output); ``search_skipped``,
    the failing requests past the search's budget (ReplayContext.too_large_to_search), which are
    never reported as explained.
    """
    t0 = time.perf_counter()
    if cmp.row_err is None or tuple(out.shape) != tuple(ctx.ref_out.shape):
        return None
    with single_thread(), torch.no_grad():
        s = Search(ctx, out, cmp)
        if notes is not None and s.too_large:
            notes["search_skipped"] = "; ".join(s.too_large.values())
        if not s.failing:
            return None
        partial = None
        for found in explanations(s):
            if found.complete:
                break
            partial = partial or found  # a family that explains only some requests: kept in reserve
        else:
            found = partial
        if notes is not None and s.memo(numerics.TRIED, list):
            notes["numerics_tried"] = s.memo(numerics.TRIED, list)
        if notes is not None and s.memo(ERRORS, dict):
            notes[ERRORS] = dict(s.memo(ERRORS, dict))
        if found is not None:
            cross_alternatives(s, found)
            if s.too_large:  # not searched: never reported as explained
                found.unexplained_requests = sorted({*(found.unexplained_requests or []), *s.too_large})
            found.seconds = round(time.perf_counter() - t0, 3)
    return found


# Families whose outputs can lie within noise of each other's (a position more or less, a row read
# as zeros, a page table read one entry off): when one explains, the others that also do are
# listed as its alternatives, so the engineer checks both causes.
CROSS = (seq_len.NAME, misplaced.NEWEST, misplaced.PAGES_OFF)


def cross_alternatives(s: Search, found: Explanation) -> None:
    """Add to ``found.other_causes`` every CROSS family that explains the same output completely."""
    if found.hypothesis not in CROSS or not found.complete:
        return
    have = {(a.hypothesis, repr(sorted(a.detail.items()))) for a in found.other_causes}
    for name in CROSS:
        try:
            other = SEARCHES[name](s) if name != found.hypothesis else None
        except Exception as e:  # that family's error, never the explanation's
            s.memo(ERRORS, dict)[name] = error_text(e)
            continue
        if other is not None and other.complete and (name, repr(sorted(other.detail.items()))) not in have:
            found.other_causes.append(Alternative(name, other.detail, other.request, other.residual_ratio))


ERRORS = "hypothesis_errors"  # Search.memo key: family -> the error it raised


def explanations(s: Search) -> Iterator[Explanation]:
    """Each family's confirmed explanation, in SEARCHES order; lazily, so the first costs only
    the families before it. A family that raises is that family's error (kept under ERRORS, the
    replay's ``info.hypothesis_errors``) and the others go on."""
    late = ((f"{f.__module__.rsplit('.', 1)[-1]}.{f.__name__}", f) for f in LATE)
    for name, search in (*SEARCHES.items(), *late):
        try:
            found = search(s)
        except Exception as e:  # never a bare localization: the rest of the search goes on
            s.memo(ERRORS, dict)[name] = error_text(e)
            continue
        if found is not None:
            yield found


__all__ = ["HYPOTHESES", "SEARCHES", "Search", "explain_failure", "explanations"]

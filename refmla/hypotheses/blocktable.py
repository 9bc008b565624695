"""The block-table families (docs/contract.md section 4), for captures with a ``block_table``:

    null_block_read   {"page", "null_block"}   page j of the request read from the null block
                                               (vLLM #39444: block 0 written with garbage, then read)
    pages_as_tokens   {"read"}                 the kernel took page ids for token slots (or token
                                               slots for page ids: SGLang #11985, FlashMLA at page 32)
    padded_row_leak   {"padded_requests",      a zero-length (padded) request's NaN spread into other
                       "nan_requests"}         rows (vLLM #37442, FlashInfer #2883: fp8 amax)
    block_table_read_off {"entries": k}        page j of request b read from the table's entry j + k
                                               (the row-major table: past the row's end its padding,
                                               the null block, then the next row; before its start
                                               the previous row's tail); the last page partial, so
                                               not a token shift by k pages
    other_table_row_read {"from_request": c}   request b read its seq_len positions through table
                                               row c (a row pointer off by c - b; c's padding, the
                                               null block, where c has fewer pages)

The null block is the capture's meta ``null_block`` when it has one (the id in the capture's own
page numbering), else the page the table pads with past every sequence (vLLM pads with it).
"""

from __future__ import annotations

from typing import Iterator, Optional

import torch

from refmla.hypotheses.drivers import per_request, rescore
from refmla.hypotheses.search import SCREEN, Candidate, Search
from refmla.results import Explanation

NULL_BLOCK = "null_block_read"
TABLE_OFF = "block_table_read_off"
TABLE_ROW = "other_table_row_read"
TABLE_OFFSETS = (1, -1, 2, -2)  # entries on / back, simplest first
TABLE_ROWS = 8  # other table rows tried per request, nearest first
PAGES_AS_TOKENS = "pages_as_tokens"
PADDED_LEAK = "padded_row_leak"


def null_page(s: Search) -> Optional[int]:
    """The null block in the capture's page numbering, or None (no block table, no padding)."""
    cap = s.cap
    if cap.block_table is None:
        return None
    if cap.meta.null_block is not None and cap.orig_kv_indices is None:
        return int(cap.meta.null_block)
    P, table = cap.meta.page_size, cap.block_table.long()
    need = (cap.seq_lens.long() + P - 1) // P  # [B]
    pad = table[torch.arange(table.shape[1])[None, :] >= need[:, None]]
    pad = pad[(pad >= 0) & (pad < cap.kv_buffer.shape[0] // P)]
    return int(torch.mode(pad).values) if pad.numel() else None


def search_null_block(s: Search) -> Optional[Explanation]:
    null = null_page(s)
    if null is None:
        return None
    return per_request(s, NULL_BLOCK, lambda s_, b: find_null_block(s_, b, null))


def find_null_block(s: Search, b: int, null: int) -> Iterator[Candidate]:
    r, P = s.req(b), s.cap.meta.page_size
    cands = []
    for j in range((r.L + P - 1) // P):
        rows = r.pool_rows.clone()
        pos = torch.arange(j * P, min((j + 1) * P, r.L))
        rows[pos] = null * P + pos % P  # page j read from the null block
        exp, ctl = s.attend_rows(b, rows, r.vis)
        if bool(torch.isfinite(exp).all()):  # a NaN row read explains any NaN output: no evidence
            cands.append(Candidate({"page": j, "null_block": null}, exp, ctl, rescore(s, b, exp)))
    yield from sorted((c for c in cands if c.score < SCREEN), key=lambda c: c.score)


def search_pages_as_tokens(s: Search) -> Optional[Explanation]:
    if s.cap.block_table is None or s.cap.meta.page_size == 1:
        return None
    return per_request(s, PAGES_AS_TOKENS, find_pages_as_tokens)


def find_pages_as_tokens(s: Search, b: int) -> Iterator[Candidate]:
    r, P, N = s.req(b), s.cap.meta.page_size, s.cap.kv_buffer.shape[0]
    pos = torch.arange(r.L)
    page = s.cap.block_table[b].long()[pos // P]  # [L] the page of each position
    readings = {
        "page ids as token slots": page,  # a token-level kernel given the block table
        "token slots as page ids": (page * P) * P + pos % P,  # a paged kernel given token slots
    }
    for what, rows in readings.items():
        if bool(((rows >= 0) & (rows < N)).all()):
            exp, ctl = s.attend_rows(b, rows, r.vis)
            if not bool(torch.isfinite(exp).all()):  # reading a NaN row explains any NaN: no evidence
                continue
            score = rescore(s, b, exp)
            if score < SCREEN:
                yield Candidate({"read": what}, exp, ctl, score)


def search_padded_leak(s: Search) -> Optional[Explanation]:
    """NaN in rows of requests that attend tokens, while a zero-length request is in the batch."""
    cap = s.cap
    padded = torch.nonzero(cap.seq_lens == 0).flatten().tolist()
    if not padded or not s.cap.is_decode:
        return None
    got = s.o64  # [R, H, Dv] the backend's output
    nan_rows = [b for b in range(cap.batch_size) if b not in padded and bool(torch.isnan(got[b]).all())]
    finite_ref = [b for b in nan_rows if bool(torch.isfinite(s.ref[b]).all())]
    if not finite_ref:
        return None
    return Explanation(PADDED_LEAK, finite_ref[0], {"padded_requests": padded, "nan_requests": finite_ref},
                       max_abs_err=float("nan"), explained_requests=finite_ref,
                       extra={"why": "a zero-length (padded) request is in the batch and every value of these "
                                     "requests is NaN where the reference is finite: the padded rows' NaN leaked "
                                     "(a padded row left undefined, then an amax or a merge across rows)"})  # fmt: skip


def table_rows(s: Search, b: int, row: int, shift: int) -> Optional[torch.Tensor]:
    """Request b's positions read through the row-major table from row ``row``, ``shift`` entries
    on: pool rows [L], or None when an entry falls outside the table or its page outside the pool."""
    cap, P = s.cap, s.cap.meta.page_size
    flat, M = cap.block_table.long().flatten(), cap.block_table.shape[1]
    pos = torch.arange(s.req(b).L)
    e = row * M + pos // P + shift  # [L] flat entries read
    if len(e) == 0 or int(e.min()) < 0 or int(e.max()) >= flat.numel():
        return None
    pages = flat[e]
    if int(pages.min()) < 0 or int(pages.max()) >= cap.kv_buffer.shape[0] // P:
        return None
    return pages * P + pos % P


def _read_as(s: Search, b: int, rows: Optional[torch.Tensor], detail: dict, extra: dict) -> Optional[Candidate]:
    """The candidate of request b reading pool ``rows``; None where it reads a NaN row (no evidence) or its own rows."""
    r = s.req(b)
    if rows is None or torch.equal(rows, r.pool_rows):
        return None
    exp, ctl = s.attend_rows(b, rows, r.vis)
    if not bool(torch.isfinite(exp).all()):  # a NaN row read explains any NaN output: no evidence
        return None
    return Candidate(detail, exp, ctl, rescore(s, b, exp), extra=extra)


def search_table_off(s: Search) -> Optional[Explanation]:
    if s.cap.block_table is None or not s.cap.is_decode:
        return None
    return per_request(s, TABLE_OFF, find_table_off)


def find_table_off(s: Search, b: int) -> Iterator[Candidate]:
    null, P = null_page(s), s.cap.meta.page_size
    for k in TABLE_OFFSETS:
        rows = table_rows(s, b, b, k)
        extra = {"last_page_tokens": s.req(b).L - (s.req(b).L - 1) // P * P if s.req(b).L else 0}
        if rows is not None and null is not None:
            extra["null_block_pages"] = int((rows[::P] // P == null).sum()) if P > 1 else int((rows == null).sum())
        cand = _read_as(s, b, rows, {"entries": k}, extra)
        if cand is not None and cand.score < SCREEN:
            yield cand


def search_table_row(s: Search) -> Optional[Explanation]:
    if s.cap.block_table is None or not s.cap.is_decode or s.cap.batch_size < 2:
        return None
    return per_request(s, TABLE_ROW, find_table_row)


def find_table_row(s: Search, b: int) -> Iterator[Candidate]:
    B = s.cap.batch_size
    others = sorted((c for c in range(B) if c != b), key=lambda c: (abs(c - b), c < b))[:TABLE_ROWS]  # b + 1 first
    cands = []
    for c in others:
        cand = _read_as(s, b, table_rows(s, b, c, 0), {"from_request": c}, {"row_offset": c - b})
        if cand is not None and cand.score < SCREEN:
            cands.append(cand)
    yield from sorted(cands, key=lambda x: x.score)


__all__ = ["NULL_BLOCK", "PADDED_LEAK", "PAGES_AS_TOKENS", "TABLE_OFF", "TABLE_ROW", "null_page", "search_null_block",
           "search_padded_leak", "search_pages_as_tokens", "search_table_off", "search_table_row"]  # fmt: skip

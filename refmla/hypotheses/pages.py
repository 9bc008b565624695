"""Page size > 1 mishandled (aiter #2996, #3095), decode only, per request:

    last_page_read_full    {"page", "rows_read", "rows_expected"}
        the kernel attended page_size * ceil(L / page_size) rows: the last page read as full, its
        tail slots (after the request's last token) included.
    last_page_len_swapped  {"from_request", "last_page_len", "rows_read", "rows_expected"}
        the last page's length taken from another request's kv_last_page_len: the kernel attended
        (pages - 1) * page_size + kv_last_page_len[from_request] rows.

Reading past the last token needs those pool rows: the capture must hold the pool by physical
slot (written uncompacted, or with kv_indices equal to orig_kv_indices). A compacted capture does
not hold rows no request attends, so a tail read cannot be recomputed there (a shorter read can).
A tail holding NaN/Inf rows is not tried: the output is then NaN however many rows were read,
and reading one row too many (seq_len_off_by +1) is the simpler account.

last_page_read_full has no free parameter and is tried before seq_len_off_by: when the tail is
at most 4 rows it is also seq_len + k, and the page names the mechanism. last_page_len_swapped
is tried after it: a length that is off by at most 4 and happens to be another request's is
more simply an off-by-k.
"""

from __future__ import annotations

from typing import Iterator, Optional

import torch

from refmla.hypotheses.drivers import per_request, rescore
from refmla.hypotheses.search import CONFIRM_TOP, SCREEN, Candidate, Search
from refmla.results import Explanation

FULL = "last_page_read_full"
SWAPPED = "last_page_len_swapped"


def search_full(s: Search) -> Optional[Explanation]:
    if not applies(s):
        return None
    return per_request(s, FULL, find_full)


def search_swapped(s: Search) -> Optional[Explanation]:
    if not applies(s):
        return None
    return per_request(s, SWAPPED, find_swapped)


def applies(s: Search) -> bool:
    return s.cap.is_decode and s.cap.meta.page_size > 1


def physical_pool(s: Search) -> bool:
    """Pool row i is physical slot i (uncompacted), so rows no request attends can be read."""
    o = s.cap.orig_kv_indices
    return o is None or torch.equal(o.long(), s.cap.kv_indices.long())


def last_page(s: Search, b: int) -> Optional[tuple[int, int, int]]:
    """Request b's (index of its last page, first slot of that page, tokens in it), or None when
    its slots are not page-aligned."""
    P, rows = s.cap.meta.page_size, s.req(b).pool_rows
    L = len(rows)
    if L == 0:
        return None
    k = (L - 1) // P
    first = int(rows[k * P])
    if first % P or not torch.equal(rows[k * P :], torch.arange(first, first + L - k * P)):
        return None
    return k, first, L - k * P


def read(s: Search, b: int, n: int) -> Optional[Candidate]:
    """Request b attending its first n positions, past its end into the rest of its last page."""
    r, P = s.req(b), s.cap.meta.page_size
    lp = last_page(s, b)
    if lp is None or n < 1 or n == r.L:
        return None
    k, first, used = lp
    seq = r.pool_rows[:n]
    if n > r.L:
        if n - k * P > P or not physical_pool(s) or first + n - k * P > s.cap.kv_buffer.shape[0]:
            return None
        seq = torch.cat([r.pool_rows, torch.arange(first + used, first + n - k * P)])
        if not bool(torch.isfinite(s.cap.kv_buffer[seq[r.L :], 0].float()).all()):
            return None  # a non-finite row past the end makes any longer read NaN: seq_len + 1 is simpler
    exp, ctl = s.attend_rows(b, seq, r.vis + (n - r.L))
    detail = {"page": k, "rows_read": n, "rows_expected": r.L}
    extra = {"tail_slots": [int(seq[r.L]), int(seq[-1])]} if n > r.L else {}
    return Candidate(detail, exp, ctl, rescore(s, b, exp), extra=extra)


def find_full(s: Search, b: int) -> Iterator[Candidate]:
    r, P = s.req(b), s.cap.meta.page_size
    cand = read(s, b, -(-r.L // P) * P) if r.L % P else None
    if cand is not None and cand.score < SCREEN:
        cand.extra["note"] = f"also seq_len + {cand.detail['rows_read'] - r.L}: the rest of the last page"
        yield cand


def find_swapped(s: Search, b: int) -> Iterator[Candidate]:
    """Each other request's last page length in request b's last page, best first."""
    P, lens = s.cap.meta.page_size, s.att.lengths().tolist()
    lp = last_page(s, b)
    if lp is None:
        return
    k, _, used = lp
    by_len: dict[int, list[int]] = {}
    for o in [(b + i) % len(lens) for i in range(1, len(lens))]:  # the next request first: an off-by-one index
        L = lens[o]
        n = L - ((L - 1) // P) * P if L else 0
        if n and n != used:
            by_len.setdefault(n, []).append(o)
    cands = []
    for n, others in by_len.items():
        cand = read(s, b, k * P + n)
        if cand is not None and cand.score < SCREEN:
            cand.detail = {"from_request": others[0], "last_page_len": n, **cand.detail}
            cand.extra["expected_last_page_len"] = used
            if len(others) > 1:
                cand.extra["requests_with_that_len"] = others
            cands.append(cand)
    yield from sorted(cands, key=lambda c: c.score)[:CONFIRM_TOP]

"""Real fault classes where the kernel read or wrote the right math in the wrong place (issue 21):

    newest_kv_unwritten   {"how": "zero"}                  the newest position's KV row read as zeros
                                                           (the decode step's own KV write not landed);
                                                           offered with seq_len_off_by(-1) when both fit
    pages_read_off        {"pages": k, "page_size": P}     request b's positions read k pages on
                                                           (k < 0: back) in the flat page table
    other_request_read    {"from_request": c}              request b attended request c's rows instead
                                                           of its own (both ways: their KV swapped)
    other_rows_read       {"page", "from_request",         page `page` of request b holds page
                           "from_page"}                    `from_page` of request `from_request`
                                                           (searched in the capture's own pool)
    output_rows_permuted  {"rows": {r: r2}}                output row r holds request r2's output

Per request each, but output_rows_permuted (whole output). Candidates are screened with per-page
block sums of exp(logit) and exp(logit) * v over the whole pool (one q . k per request), so
every (page, source page) pair costs O(H * Dv) (page_size 1: a page is one row, and the pairs are
ranked with the value axis projected to RANK_WIDTH; past NEAREST_KEEP of them, every pair is ranked
by one GEMM, a nearest-neighbour search, and the nearest kept); the best few are confirmed by the
comparator.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch

from refmla import reference as ref
from refmla.hypotheses.drivers import global_hypothesis, per_request, rescore
from refmla.hypotheses.search import SCREEN, Candidate, Search
from refmla.nearest import nearest_pairs, projection
from refmla.results import Alternative, Explanation

NEWEST = "newest_kv_unwritten"
PAGES_OFF = "pages_read_off"
OTHER_ROWS = "other_rows_read"
OTHER_REQUEST = "other_request_read"
OTHER_REQUEST_SOURCES = 64  # requests (nearest by index) whose rows a request is tried over
PERMUTED = "output_rows_permuted"
OFFSETS = (1, -1, 2, -2, 3, -3)  # pages read on / back, simplest first
SUMS_BUDGET = 2**26  # values (fp64) of the pool's rows [N, D] or page sums [pages, H, Dv] a search may hold
PAIR_LIMIT = 2**19  # (own page, source page) pairs screened per request, at most
NEAREST_KEEP = 512  # past this many pairs, every pair ranked by one GEMM and this many nearest screened
NEAREST_PAIRS = 2**27  # past this many, only the pairs with a heavy side (PAIR_LIMIT of them)
RANK_CHUNK = 2**15  # pairs ranked at a time
RANK_WIDTH = 8  # the value axis projected to this many dimensions to rank the pairs
PAIR_BUDGET = 2**26  # values scored exactly; past it the pairs are ranked with the value axis projected


# --------------------------------------------------------------------------------------------
# The newest position's row not written
# --------------------------------------------------------------------------------------------


def newest_candidate(s: Search, b: int) -> Optional[Candidate]:
    r = s.req(b)
    if r.L < 2 or r.T != 1:
        return None
    zero = torch.zeros(r.L, dtype=torch.bool)
    zero[-1] = True
    exp, ctl = s.attend_rows(b, r.pool_rows, r.vis, zero=zero)
    return Candidate({"how": "zero"}, exp, ctl, rescore(s, b, exp), extra={"position": r.L - 1})


def screened(candidate: Callable[[Search, int], Optional[Candidate]]) -> Callable[[Search, int], Iterator[Candidate]]:
    """A finder of the one candidate ``candidate(s, b)`` gives, when it passes the screen."""
    return lambda s, b: iter([c] if (c := candidate(s, b)) is not None and c.score < SCREEN else [])


def search_newest(s: Search) -> Optional[Explanation]:
    if not s.cap.is_decode:
        return None
    return per_request(s, NEWEST, screened(newest_candidate))


def newest_alternative(s: Search, e: Optional[Explanation]) -> Optional[Explanation]:
    """seq_len_off_by(-1) and the newest row read as zeros give outputs within noise of each
    other when the newest token weighs little: list the other cause when it fits too."""
    if e is None or e.detail.get("delta") != -1 or not s.cap.is_decode:
        return e
    for b in e.explained_requests or [e.request]:
        c = newest_candidate(s, b)
        if c is not None and s.confirm(c.expected, c.control, s.rows_of(b)).passed:
            e.other_causes.append(Alternative(NEWEST, c.detail, b, None))
    return e


# --------------------------------------------------------------------------------------------
# Pages read k pages off
# --------------------------------------------------------------------------------------------


def _shifted_rows(s: Search, b: int, k: int) -> Optional[torch.Tensor]:
    """Request b's positions read k pages on in the flat index list; None past its ends."""
    cap, P = s.cap, max(1, s.cap.meta.page_size)
    lo, hi = int(cap.kv_indptr[b]), int(cap.kv_indptr[b + 1])
    a, e = lo + k * P, hi + k * P
    if a < 0 or e > cap.kv_indices.shape[0] or hi == lo:
        return None
    return cap.kv_indices[a:e].long()


def find_pages_off(s: Search, b: int) -> Iterator[Candidate]:
    r, P = s.req(b), max(1, s.cap.meta.page_size)
    cands = []
    for k in OFFSETS:
        rows = _shifted_rows(s, b, k)
        if rows is None:
            continue
        exp, ctl = s.attend_rows(b, rows, r.vis)
        cands.append(Candidate({"pages": k, "page_size": P}, exp, ctl, rescore(s, b, exp), simplicity=(abs(k), k < 0)))
    yield from sorted((c for c in cands if c.score < SCREEN), key=lambda c: c.score)


def search_pages_off(s: Search) -> Optional[Explanation]:
    return per_request(s, PAGES_OFF, find_pages_off) if s.cap.is_decode else None


# --------------------------------------------------------------------------------------------
# Another request's rows read whole
# --------------------------------------------------------------------------------------------


def find_other_request(s: Search, b: int) -> Iterator[Candidate]:
    """Request b's query over each other request's rows (its page table or indptr pointed at them),
    the nearest OTHER_REQUEST_SOURCES requests by index; screened in fp64, the best few with their
    control."""
    r, cap = s.req(b), s.cap
    if r.T != 1 or not cap.is_decode:
        return
    att, scored = cap.attended(), []
    sources = sorted((c for c in range(cap.batch_size) if c != b), key=lambda c: (abs(c - b), c))
    for c in sources[:OTHER_REQUEST_SOURCES]:
        rows = att.group_rows(c)
        if len(rows) == 0 or s.ctx.too_large_to_search(c):  # a source is held in fp64 as a searched request is
            continue
        exp = ref.attend(r.q64[0], ref.gather(cap.kv_buffer, rows, torch.float64), s.sc)[0][None]  # [1, H, Dv]
        scored.append((rescore(s, b, exp), c, rows))
    for score, c, rows in sorted(scored, key=lambda x: x[0])[:3]:
        if score >= SCREEN:
            break
        exp, ctl = s.attend_rows(b, rows, torch.tensor([len(rows)]))
        yield Candidate({"from_request": c}, exp, ctl, score, simplicity=(abs(c - b), c))


def search_other_request(s: Search) -> Optional[Explanation]:
    e = per_request(s, OTHER_REQUEST, find_other_request) if s.cap.is_decode else None
    if e is not None:  # two requests that read each other's rows: their KV swapped
        src = {x["request"]: x["detail"]["from_request"] for x in e.extra.get("requests", [])}
        pairs = sorted({tuple(sorted((b, c))) for b, c in src.items() if src.get(c) == b})
        if pairs:
            e.extra["swapped"] = [list(p) for p in pairs]
    return e


# --------------------------------------------------------------------------------------------
# A page holding another request's page
# --------------------------------------------------------------------------------------------


@dataclass
class PoolPages:
    """Every page the capture's requests read, in request order (page_size 1: a row each)."""

    rows: torch.Tensor  # [N] the pool rows of every request, concatenated
    request: torch.Tensor  # [pages] the request reading each page
    page: torch.Tensor  # [pages] its page number in that request
    start: torch.Tensor  # [pages] its first row in ``rows``
    length: torch.Tensor  # [pages] its rows (the last page of a request may be partial)

    def rows_of(self, k: int) -> torch.Tensor:
        a = int(self.start[k])
        return self.rows[a : a + int(self.length[k])]


def _pool_pages(s: Search) -> PoolPages:
    cap, P = s.cap, max(1, s.cap.meta.page_size)
    att = cap.attended()
    lens = torch.tensor([len(att.group_rows(b)) for b in range(cap.batch_size)], dtype=torch.int64)  # [B]
    n = (lens + P - 1) // P  # [B] pages per request
    request = torch.repeat_interleave(torch.arange(cap.batch_size), n)  # [pages]
    first = torch.cumsum(n, 0) - n  # [B] each request's first page
    page = torch.arange(int(n.sum())) - first[request]
    offset = torch.cumsum(lens, 0) - lens  # [B] each request's first row
    start = offset[request] + page * P
    length = torch.minimum(lens[request] - page * P, torch.tensor(P))
    rows = torch.cat([att.group_rows(b) for b in range(cap.batch_size)]) if cap.batch_size else torch.empty(0, dtype=torch.int64)
    return PoolPages(rows.long(), request, page, start, length)


def find_other_rows(s: Search, b: int) -> Iterator[Candidate]:
    """Each (own page, source page) by block sums; the best few recomputed exactly. At page_size 1
    a page is one row: every (position, pool row) pair, ranked with the value axis projected and,
    past NEAREST_KEEP pairs, first by one GEMM (:func:`_nearest_pairs`; past NEAREST_PAIRS, only the
    pairs where one side holds the most attention mass)."""
    r, cap, P = s.req(b), s.cap, max(1, s.cap.meta.page_size)
    if r.T != 1 or r.L == 0:
        return
    ip = cap.attended().indptr[: cap.batch_size + 1]  # the requests' rows, as _pool_pages reads them
    rows, n_pages = int(ip[-1] - ip[0]), int(((ip[1:] - ip[:-1]) + P - 1).div(P, rounding_mode="floor").sum())
    if max(n_pages * r.q64.shape[1] * s.sc.kv_lora_rank, rows * cap.kv_buffer.shape[-1]) > SUMS_BUDGET:
        return  # the pool's rows in fp64 or its page sums would not fit the budget (a large pool)
    pages = s.memo("misplaced.pool_pages", lambda: _pool_pages(s))
    S, W = _page_sums(s, r, pages)  # [H, pages], [pages, H, Dv]
    whole = pages.length == P  # a source must be a whole page, as its target
    own = torch.nonzero((pages.request == b) & whole).flatten()  # whole pages
    own_all = torch.nonzero(pages.request == b).flatten()
    S_b, W_b = S[:, own_all].sum(-1), W[own_all].sum(0)  # [H], [H, Dv]
    if len(own) == 0:
        return
    target, tol = s.o64[r.rows[0]], s.row_tol[r.rows[0]]  # [H, Dv], [H]
    src = torch.nonzero(whole).flatten()
    if NEAREST_KEEP < len(own) * len(src) <= NEAREST_PAIRS:  # every pair ranked by one GEMM, the nearest kept
        js, ts = _nearest_pairs(S, W, S_b, W_b, target, tol, own, src, NEAREST_KEEP)
    else:
        effect = ((W - S.T[..., None] * target[None]).abs().amax(-1) / (S_b * tol)[None]).amax(-1)  # [pages]
        js, ts = _pairs(effect, own, src)

    def ratio(js, ts, Wb, W, target, rms=False):  # [K] worst-head error / allowed of page js holding ts
        St = ST[W.dtype]  # [pages, H] rows gathered (columns of S would be a strided gather)
        den = (S_b.to(W.dtype)[None] - St.index_select(0, js) + St.index_select(0, ts))[..., None]  # [K, H, 1]
        d = (Wb[None] - W.index_select(0, js) + W.index_select(0, ts)) / den - target[None]  # [K, H, w]
        err = d.norm(dim=-1) / math.sqrt(d.shape[-1]) if rms else d.abs().amax(-1)  # [K, H]
        return torch.nan_to_num(err / tol.to(err.dtype)[None], nan=math.inf).amax(-1)

    ST = {torch.float64: S.T.contiguous(), torch.float32: S.T.float().contiguous()}
    if len(js) * W.shape[1] * W.shape[2] > PAIR_BUDGET:  # rank with the value axis projected
        proj = projection(W.shape[2], RANK_WIDTH)
        Wp, Wbp, tp = ((x @ proj).float() for x in (W, W_b, target))  # ranking precision is plenty
        n = RANK_CHUNK
        rank = torch.cat([ratio(js[a : a + n], ts[a : a + n], Wbp, Wp, tp, True) for a in range(0, len(js), n)])
        keep = torch.argsort(rank)[:64]
        js, ts = js[keep], ts[keep]
    scores = ratio(js, ts, W_b, W, target)
    for k in torch.argsort(scores)[:3].tolist():
        score, j, t = float(scores[k]), int(js[k]), int(ts[k])
        if score >= SCREEN:
            break
        fb, fp, rows = int(pages.request[t]), int(pages.page[t]), pages.rows_of(t)
        page = int(pages.page[j])
        if _without_page_fits(s, b, page, P):
            continue  # the page's own rows not read at all fits too: its source is not identified
        seq = r.pool_rows.clone()
        seq[page * P : (page + 1) * P] = rows
        exp, ctl = s.attend_rows(b, seq, r.vis)
        yield Candidate({"page": page, "from_request": fb, "from_page": fp}, exp, ctl, score,
                        simplicity=(fb == b, page))  # fmt: skip


def _without_page_fits(s: Search, b: int, page: int, P: int) -> bool:
    """Request b with page ``page`` not read passes the comparator: whatever row stood in for it
    weighs nothing, so any light row of the pool fits as its source (a look-elsewhere fit)."""
    r = s.req(b)
    keep = torch.ones(r.L, dtype=torch.bool)
    keep[page * P : (page + 1) * P] = False
    exp, ctl = s.attend_rows(b, r.pool_rows, r.vis, keep=keep)
    return s.confirm(exp, ctl, s.rows_of(b)).passed


def _page_sums(s: Search, r, pages: PoolPages) -> tuple[torch.Tensor, torch.Tensor]:
    """Per page of the pool, under request r's query: sum exp(logit - max) [H, pages] and its
    weighted values [pages, H, Dv]."""
    kv = s.memo("misplaced.pool_kv", lambda: ref.gather(s.cap.kv_buffer, pages.rows, torch.float64))  # [N, D]
    logits = torch.einsum("hd,nd->hn", r.q64[0], kv) * s.sc.k_scale * s.sc.sm_scale  # [H, N]
    if s.sc.logit_cap > 0:
        logits = s.sc.logit_cap * torch.tanh(logits / s.sc.logit_cap)
    w = torch.exp(logits - logits.max(-1, keepdim=True).values).nan_to_num(0.0)  # [H, N]
    v = kv[:, : s.sc.kv_lora_rank] * s.sc.v_scale  # [N, Dv]
    n = len(pages.length)
    seg = torch.repeat_interleave(torch.arange(n), pages.length)  # [N]
    S = torch.zeros(w.shape[0], n, dtype=torch.float64).index_add_(1, seg, w)  # [H, pages]
    W = torch.zeros(n, w.shape[0], v.shape[1], dtype=torch.float64).index_add_(
        0, seg, torch.einsum("hn,nv->nhv", w, v))  # [pages, H, Dv]  # fmt: skip
    return S, W


def _nearest_pairs(S, W, S_b, W_b, target, tol, own, src, keep: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``keep`` (own page j, source page t) pairs whose predicted outputs lie nearest the target.

    Page j holding page t's rows moves the output's numerator by e_t - e_j, e_p = W_p - S_p o
    (o the target): the pair fits when e_t - e_j = R = S_b o - W_b, up to noise. With each head
    scaled by S_b * tol (the denominator taken as S_b: a ranking) and the value axis projected to
    RANK_WIDTH, that is a nearest-neighbour search between e_j + R and e_t (refmla.nearest).
    """
    proj = projection(W.shape[2], RANK_WIDTH)
    scale = (S_b * tol)[:, None]  # [H, 1]
    e = (W @ proj - S.T[..., None] * (target @ proj)[None]) / scale  # [pages, H, w]
    R = ((S_b[:, None] * target - W_b) @ proj) / scale  # [H, w]
    i, j, _ = nearest_pairs((e[own] + R).flatten(1), e[src].flatten(1), keep,
                            allowed=lambda i0, i1: own[i0:i1, None] != src[None])  # a page never stands for itself
    return own[i], src[j]


def _pairs(effect: torch.Tensor, own: torch.Tensor, src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(own page, source page) pairs to score, a page never standing for itself: all of them up to
    PAIR_LIMIT, else those whose own page or source moves the output most (``effect`` [pages]: how
    far removing or adding the page alone moves it; two light pages swapped move it by little)."""
    if len(own) * len(src) > PAIR_LIMIT:
        k = max(1, PAIR_LIMIT // (2 * max(len(own), len(src))))
        top_own = own[torch.argsort(effect[own], descending=True)[:k]]
        top_src = src[torch.argsort(effect[src], descending=True)[:k]]
        js = torch.cat([top_own.repeat_interleave(len(src)), own.repeat_interleave(len(top_src))])
        ts = torch.cat([src.repeat(len(top_own)), top_src.repeat(len(own))])
    else:
        js, ts = own.repeat_interleave(len(src)), src.repeat(len(own))
    keep = js != ts
    return js[keep], ts[keep]


def search_other_rows(s: Search) -> Optional[Explanation]:
    return per_request(s, OTHER_ROWS, find_other_rows) if s.cap.is_decode else None


# --------------------------------------------------------------------------------------------
# Output rows written to another request's row
# --------------------------------------------------------------------------------------------


def search_permuted(s: Search) -> Optional[Explanation]:
    """Each failing output row matched to the reference row nearest it; a mapping that moves rows
    and is one-to-one is confirmed."""
    if not s.cap.is_decode or s.o64.shape[0] < 2:
        return None
    R = s.o64.shape[0]
    bad = torch.nonzero(s.bad_rows.any(-1)).flatten().tolist()
    perm = list(range(R))
    for r in bad:
        d = (s.o64[r][None] - s.ref).abs().amax(-1) / s.row_tol[r][None]  # [R, H]
        perm[r] = int(torch.nan_to_num(d, nan=math.inf).amax(-1).argmin())
    moved = {r: perm[r] for r in bad if perm[r] != r}
    if not moved or len(set(perm)) != R:
        return None
    idx = torch.tensor(perm)
    cand = Candidate({"rows": moved}, s.ref[idx], s.ctrl[idx])
    return global_hypothesis(s, PERMUTED, iter([cand]))

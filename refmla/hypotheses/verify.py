"""The speculative verify path's mistakes (issue 13), one search each; verify captures only.

    draft_kv_missing    {"how": "zeroed" | "dropped", "drafts": n}   per request: the drafts' KV rows
                        read as zeros, or not attended at all (only the prefix)
    causal_alignment    {"alignment": "top-left" | "none"}            per request: query i of n sees
                        positions 0..i (top-left), or every draft (no causal mask among the drafts)
    mask_wrong_request  {"mask_of": b2}                               per request: the drafts see each
                        other through request b2's tree mask
    qlen_pow2_padding   {"qlen": n, "padded_to": Q, "reads": "queries" | "kv_rows" | "both"}
                        whole output: the kernel padded qlen to the next power of two Q; "queries":
                        request b's query i read from row b*Q + i; "kv_rows": its causal offset taken
                        from Q (query i sees L - Q + i + 1 positions); "both"

Each candidate is the reference and the control recomputed with that visibility (or those
queries / zeroed rows), judged by the comparator like every hypothesis (refmla.hypotheses.search).
"""

from __future__ import annotations

from typing import Iterator, Optional

import torch

from refmla import reference as ref
from refmla.control import attend_control
from refmla.hypotheses.drivers import global_hypothesis, per_request, rescore
from refmla.hypotheses.search import SCREEN, Candidate, Search
from refmla.results import Explanation


def attend_visible(
    s: Search, b: int, visible: torch.Tensor, zero: Optional[torch.Tensor] = None, q: Optional[torch.Tensor] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference (fp64) and control of request b's rows: token t sees ``visible[t]`` [T, L] of its
    positions, rows in ``zero`` [L] read as zeros, queries ``q`` [T, H, D] (default the capture's)."""
    r = s.req(b)
    kv64, kvs = s._sequence(r, r.pool_rows, zero)
    q = s.cap.q[r.rows] if q is None else q  # [T, H, D] stored dtype
    H, Dv = q.shape[1], s.sc.kv_lora_rank
    exp = torch.empty(r.T, H, Dv, dtype=torch.float64)
    ctl = torch.empty(r.T, H, Dv, dtype=s.dtype)
    for t in range(r.T):
        sel = visible[t]
        exp[t] = ref.attend(q[t].double(), kv64[sel], s.sc)[0]
        ctl[t] = attend_control(q[t], kvs[sel], s.sc, s.dtype)[0]
    return exp, ctl


def _ranked(s: Search, b: int, cands: list[Candidate]) -> Iterator[Candidate]:
    for c in cands:
        c.score = rescore(s, b, c.expected)
    yield from sorted((c for c in cands if c.score < SCREEN), key=lambda c: c.score)


# -- draft_kv_missing ---------------------------------------------------------------------------


def search_draft_kv(s: Search) -> Optional[Explanation]:
    return per_request(s, "draft_kv_missing", find_draft_kv) if s.cap.is_verify else None


def find_draft_kv(s: Search, b: int) -> Iterator[Candidate]:
    """Zeroed and dropped, each confirmed on request b's rows; "zeroed or dropped" when both pass
    (zero rows whose logit 0 carries no softmax mass next to the real ones)."""
    r = s.req(b)
    drafts = torch.arange(r.L) >= r.L - r.T  # [L]
    vis = r.visible()
    variants = {"zeroed": attend_visible(s, b, vis, zero=drafts), "dropped": attend_visible(s, b, vis & ~drafts[None, :])}
    rows = s.rows_of(b)
    ok = [how for how, (exp, ctl) in variants.items() if s.confirm(exp, ctl, rows).passed]
    if ok:
        yield Candidate({"how": " or ".join(ok), "drafts": r.T}, *variants[ok[0]])


# -- causal_alignment ---------------------------------------------------------------------------


def search_causal(s: Search) -> Optional[Explanation]:
    return per_request(s, "causal_alignment", find_causal) if s.cap.is_verify else None


def find_causal(s: Search, b: int) -> Iterator[Candidate]:
    r = s.req(b)
    pos, i = torch.arange(r.L)[None, :], torch.arange(r.T)[:, None]
    top_left = pos <= i  # [T, L]
    no_causal = (pos < r.L).expand(r.T, r.L)  # every position, every draft
    cands = [Candidate({"alignment": a}, *attend_visible(s, b, v)) for a, v in (("top-left", top_left), ("none", no_causal))]
    yield from _ranked(s, b, cands)


# -- mask_wrong_request -------------------------------------------------------------------------


def search_mask(s: Search) -> Optional[Explanation]:
    if not s.cap.is_verify or not s.att.has_mask or s.cap.batch_size < 2:
        return None
    return per_request(s, "mask_wrong_request", find_mask)


MAX_OTHER_MASKS = 16  # other requests' masks tried per failing request (not B - 1 of them)


def find_mask(s: Search, b: int) -> Iterator[Candidate]:
    r, cands = s.req(b), []
    nearest = sorted(range(s.cap.batch_size), key=lambda b2: abs(b2 - b))[1 : 1 + MAX_OTHER_MASKS]
    for b2 in nearest:  # the neighbours first (an off-by-k index), a bounded number of them
        r2 = s.req(b2)
        if r2.T != r.T:
            continue
        vis = r.visible().clone()
        vis[:, r.L - r.T :] = r2.tree[:, r2.L - r2.T :]
        cands.append(Candidate({"mask_of": b2}, *attend_visible(s, b, vis)))
    yield from _ranked(s, b, cands)


# -- qlen_pow2_padding --------------------------------------------------------------------------


def search_pow2(s: Search) -> Optional[Explanation]:
    if not s.cap.is_verify:
        return None
    qo = s.att.query_indptr  # [B + 1]
    n = int((qo[1:] - qo[:-1]).max()) if s.cap.batch_size else 0
    Q = 1 << max(0, (n - 1).bit_length())
    if Q == n:
        return None
    return global_hypothesis(s, "qlen_pow2_padding", pow2_candidates(s, n, Q))


def pow2_candidates(s: Search, n: int, Q: int) -> Iterator[Candidate]:
    cap = s.cap
    for reads in ("queries", "kv_rows", "both"):
        expected, control = s.ref.clone(), s.ctrl.clone()
        for b in range(cap.batch_size):
            r = s.req(b)
            if r.T == 0:
                continue
            q = None
            if reads != "kv_rows":
                src = torch.arange(r.T) + b * Q
                q = torch.zeros_like(cap.q[r.rows])
                ok = src < cap.q.shape[0]
                q[ok] = cap.q[src[ok]]
            vis = r.visible()
            if reads != "queries":
                vis = vis & (torch.arange(r.L)[None, :] < (r.L - Q + torch.arange(r.T) + 1)[:, None])
            expected[r.rows], control[r.rows] = attend_visible(s, b, vis, q=q)
        yield Candidate({"qlen": n, "padded_to": Q, "reads": reads}, expected, control)


__all__ = ["attend_visible", "search_causal", "search_draft_kv", "search_mask", "search_pow2"]

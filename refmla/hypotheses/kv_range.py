"""kv_range_missing {"start", "end", "how"}: positions [start, end) of a request dropped or read as
zeros, at page granularity (page_size > 1) or in 32-token split units, plus the split bounds.

Per request: every block-aligned range is scored at once (refmla.hypotheses.ranges), the best few
dropped and zeroed are recomputed and confirmed on the request's rows; the smallest range that
confirms is reported, the others are its ``alternatives``. When no block-aligned range confirms
(and no split fits), ranges whose ends lie inside the blocks are searched (:func:`sub_ranges`: a
sub-page range only when the data tell it from the whole pages), the roundest reported. A dropped range that is
exactly one split of the kernel's schedule is left to ``split_missing``: dropping a split's
partial from the merge and dropping its positions are the same arithmetic, so split_missing lists
the dropped range under ``other_causes`` (:func:`dropped_alternative`: a page that never arrived
and a split left out of the merge are told apart by nothing in the output, where a page boundary
and a split bound coincide).
"""

from __future__ import annotations

from typing import Iterator, Optional

import torch

from refmla.hypotheses.drivers import per_request, residual
from refmla.hypotheses.ranges import (
    PAIR_BUDGET, RANK_WIDTH, BlockSums, beyond_screen, best_of, best_pairs, block_sums, nearest_ranges, split_schedule,
    window_pairs,
)
from refmla.hypotheses.search import CONFIRM_TOP, SCREEN, Candidate, Search
from refmla.nearest import projection
from refmla.results import Alternative, Explanation
from refmla.schedule import MIN_BLOCK_KV
from refmla.util import roundness

NAME = "kv_range_missing"
SUB_BUDGET = 2**24  # values of the finer block sums a sub-block search may hold
NEAREST_KEEP = 256  # ranges of positions kept by the nearest-neighbour ranking, then scored exactly
COARSE_TOP = 4  # past the budgets: block ranges whose ends are moved inside their blocks


def search(s: Search) -> Optional[Explanation]:
    return per_request(s, NAME, find_range, limit=None)  # find_range bounds itself


def find_range(s: Search, b: int) -> Iterator[Candidate]:
    """Block-aligned ranges of request b, best first, each confirmed as dropped and as zeroed; when
    none confirms (and no split of the schedule fits), ranges inside the blocks (:func:`sub_ranges`)."""
    bs = block_sums(s, b, s.sc)
    if bs is None:
        return
    bnd = bs.bnd.tolist()
    splits = split_pairs(s, b, bnd)
    whole = (0, len(bnd) - 1)
    ranked = best_pairs(bs, False, splits | {whole}, CONFIRM_TOP) + best_pairs(bs, True, set(), CONFIRM_TOP)
    seen: set[tuple[int, int]] = set()
    for rng in sorted(ranked):
        if rng.score >= SCREEN or len(seen) >= 2 * CONFIRM_TOP:
            break
        if (rng.i, rng.j) in seen:
            continue
        seen.add((rng.i, rng.j))
        cand = range_candidate(s, b, bs, bnd[rng.i], bnd[rng.j], whole=(rng.i, rng.j) == whole,
                               one_split=(rng.i, rng.j) in splits)  # fmt: skip
        if cand is not None:
            cand.score = rng.score
            # page-aligned first (a split bound inside a page fits as well when the positions between
            # carry ~no mass; the page is what a kernel engineer recognises), then the smallest
            cand.simplicity = (not page_aligned(s, b, bnd[rng.i], bnd[rng.j]), bnd[rng.j] - bnd[rng.i], bnd[rng.i])
            yield cand
            seen.add((-1, -1))  # a block-aligned range confirmed: the blocks are the answer's unit
    if not seen & ({(-1, -1)} | splits):  # nothing block-aligned confirmed nor screened as one split
        yield from sub_ranges(s, b, bs, splits)


def sub_ranges(s: Search, b: int, bs: BlockSums, splits: set[tuple[int, int]]) -> Iterator[Candidate]:
    """Ranges whose ends lie inside blocks, scored at once, the best few confirmed (dropped, then zeroed).

    Every range of positions when the request's per-position sums fit SUB_BUDGET values (ranked
    by one GEMM, :func:`nearest_ranges`); else the best COARSE_TOP block ranges with each end moved position by
    position up to one block either way. Reported only because no block-aligned range fits: the
    data tell the sub-page range apart from the whole pages (issue 21 part 4).
    """
    bnd = bs.bnd.tolist()
    Lp, seen = bnd[-1], set()
    split_pos = {(bnd[i], bnd[j]) for i, j in splits}
    for fine, windows, where in fine_windows(s, b, bs):
        bnd_fine = torch.tensor(fine, dtype=torch.int64)
        if windows is None:  # every range: ranked on projected sums, skipped when none is near
            fp = block_sums(s, b, s.sc, bnd_fine, proj=projection(s.sc.kv_lora_rank, RANK_WIDTH))
            near = {z: nearest_ranges(fp, z, NEAREST_KEEP) for z in (False, True)}
            if all(beyond_screen(d, fp, s.sc.kv_lora_rank, SCREEN) for _, _, d in near.values()):
                continue
        fs = block_sums(s, b, s.sc, bnd_fine)
        for zeroed in (False, True):
            starts, ends = windows if windows is not None else near[zeroed][:2]
            budget = SUB_BUDGET // 4 if windows is not None else PAIR_BUDGET  # the nearest: scored exactly
            for rng in best_of(fs, starts, ends, zeroed, CONFIRM_TOP, budget=budget):
                a, e = fine[rng.i], fine[rng.j]
                if rng.score >= SCREEN or (a, e) in seen:
                    continue
                seen.add((a, e))
                cand = range_candidate(s, b, fs, a, e, whole=(a, e) == (0, Lp), one_split=(a, e) in split_pos)
                if cand is not None:
                    cand.score, cand.simplicity = rng.score, (-roundness(a, e), e - a, a)
                    cand.extra["granularity"] = f"positions: no range of whole {granularity(s)} fits (ends searched {where})"
                    yield cand


def fine_windows(s: Search, b: int, bs: BlockSums) -> Iterator[tuple[list[int], Optional[tuple], str]]:
    """(boundaries, (range starts, range ends), what was searched) of the sub-block search: every
    position a boundary and every range ranked (None: :func:`nearest_ranges`), or, past the
    budget, windows of one block around the best block ranges."""
    bnd = bs.bnd.tolist()
    TH, Dv = bs.W.shape
    Lp = bnd[-1]
    if (Lp + 1) * TH * Dv <= SUB_BUDGET:
        yield list(range(Lp + 1)), None, "at every position"
        return
    radius = min(unit(s), (SUB_BUDGET // max(TH * Dv, 1) - len(bnd)) // 4)
    if radius < 2:
        return
    coarse = {(c.i, c.j): None for z in (False, True) for c in best_pairs(bs, z, set(), COARSE_TOP)}
    for i, j in coarse:  # the best block ranges, dropped or zeroed, in that order
        p0, p1 = bnd[i], bnd[j]
        near = {p for p in range(max(0, p0 - radius), min(Lp, p1 + radius) + 1) if min(abs(p - p0), abs(p - p1)) <= radius}
        fine = sorted(set(bnd) | near)
        yield fine, window_pairs(fine, p0, p1, radius), f"within {radius} of the block range {p0}..{p1}"


def unit(s: Search) -> int:
    """The block a range is first searched in: the page (page_size > 1), else the 32-token split unit."""
    P = s.cap.meta.page_size
    return P if P > 1 else MIN_BLOCK_KV


def page_aligned(s: Search, b: int, p0: int, p1: int) -> bool:
    """Both ends of [p0, p1) on request b's page boundaries (the end may be the request's end);
    True at page_size 1, where every position is a page."""
    P = s.cap.meta.page_size
    return P <= 1 or (p0 % P == 0 and (p1 % P == 0 or p1 == s.req(b).L))


def split_pairs(s: Search, b: int, bnd: list[int]) -> set[tuple[int, int]]:
    """Block pairs (i, j) that are exactly one split of request b's schedule, when it has two or more."""
    splits = split_schedule(s, b) or []
    if len(splits) < 2:
        return set()
    pos = {p: i for i, p in enumerate(bnd)}
    return {(pos[a], pos[e]) for a, e in splits if a in pos and e in pos}


def range_candidate(
    s: Search, b: int, bs: BlockSums, p0: int, p1: int, whole: bool, one_split: bool
) -> Optional[Candidate]:
    """Positions [p0, p1) of request b dropped (unless ``whole``) and zeroed, each confirmed on its
    rows: the candidate naming those that pass, or None (also when [p0, p1) is ``one_split`` of the
    schedule and dropping it passes: split_missing names that)."""
    r = s.req(b)
    span = (torch.arange(r.L) >= p0) & (torch.arange(r.L) < p1)
    variants = {}
    if not whole:
        variants["dropped"] = s.attend_rows(b, r.pool_rows, r.vis, keep=~span)
    variants["zeroed"] = s.attend_rows(b, r.pool_rows, r.vis, zero=span)
    rows = s.rows_of(b)
    ok = [how for how, (exp, ctl) in variants.items() if s.confirm(exp, ctl, rows).passed]
    if not ok or (one_split and "dropped" in ok):
        return None
    exp, ctl = variants[ok[0]]
    extra = {"granularity": granularity(s)}
    if len(ok) == 2:
        mass = float(((p1 - p0) * bs.E / bs.Z).max())
        extra["note"] = (f"dropped and zeroed are indistinguishable here: the zero rows would carry at most "
                         f"{mass:.2g} of the softmax mass")  # fmt: skip
    return Candidate({"start": p0, "end": p1, "how": " or ".join(ok)}, exp, ctl, extra=extra)


def granularity(s: Search) -> str:
    return f"{'pages' if s.cap.meta.page_size > 1 else 'split units'} of {unit(s)} positions, and split bounds"


def dropped_alternative(s: Search, e: Optional[Explanation]) -> Optional[Explanation]:
    """split_missing(split=k) drops the same positions as kv_range_missing(start, end, "dropped")
    with [start, end) split k's bounds: list that range under ``other_causes`` when it confirms too,
    so the engineer checks the transfer (a page missing) as well as the merge."""
    if e is None:
        return e
    details = {b["request"]: b["detail"] for b in e.extra.get("requests", [])} or {e.request: e.detail}
    for b in e.explained_requests or [e.request]:
        splits = split_schedule(s, b) or []
        k = details.get(b, {}).get("split")
        if k is None or k >= len(splits):
            continue
        p0, p1 = splits[k]
        r = s.req(b)
        span = (torch.arange(r.L) >= p0) & (torch.arange(r.L) < p1)
        exp, ctl = s.attend_rows(b, r.pool_rows, r.vis, keep=~span)
        cmp = s.confirm(exp, ctl, s.rows_of(b))
        if cmp.passed:
            e.other_causes.append(Alternative(NAME, {"start": p0, "end": p1, "how": "dropped"}, b, residual(cmp)))
    return e

"""kv_range_missing {"start", "end", "how"}: positions [start, end) of a request dropped or read as
zeros, at page granularity (page_size > 1) or in 32-token split units, plus the split bounds.

Per request: every block-aligned range is scored at once (refmla.hypotheses.ranges), the best few
dropped and zeroed are recomputed and confirmed on the request's rows; the smallest range that
confirms is reported, the others are its ``alternatives``. A dropped range that is
exactly one split of the kernel's schedule is left to ``split_missing``: dropping a split's
partial from the merge and dropping its positions are the same arithmetic, and the split names
the mechanism.
"""

from __future__ import annotations

from typing import Iterator, Optional

import torch

from refmla.hypotheses.drivers import per_request
from refmla.hypotheses.ranges import BlockSums, best_pairs, block_sums, split_schedule
from refmla.hypotheses.search import CONFIRM_TOP, SCREEN, Candidate, Search
from refmla.results import Explanation
from refmla.schedule import MIN_BLOCK_KV

NAME = "kv_range_missing"


def search(s: Search) -> Optional[Explanation]:
    return per_request(s, NAME, find_range, limit=None)  # find_range bounds itself


def find_range(s: Search, b: int) -> Iterator[Candidate]:
    """Block-aligned ranges of request b, best first, each confirmed as dropped and as zeroed."""
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
            cand.simplicity = (bnd[rng.j] - bnd[rng.i], bnd[rng.i])  # the smallest range first
            yield cand


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
    P = s.cap.meta.page_size
    return f"{'pages' if P > 1 else 'split units'} of {P if P > 1 else MIN_BLOCK_KV} positions, and split bounds"

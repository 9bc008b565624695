"""Which simple merge mistake explains a merged output that differs from the fp64 merge: each one
is the same merge (refmla.merge.reference.merge) on the inputs the mistaken merger used, judged by
the one comparator against the output production wrote. Tried in this order:

    merge_lse_base           the pieces' lse merged in the other base (log2 lse merged as ln, and back)
    merge_empty_piece_lse    an empty piece merged with its recorded lse, 0 or NaN instead of -inf
    merge_piece_dropped      one piece left out (the output is the other piece alone)
    merge_lse_layout         the lse read as [H, T] when it is [T, H] (vLLM's layout against SGLang's)
    merge_lse_swapped        each piece's output weighted by the other piece's lse
    merge_unnormalized       the weighted sum never divided by the weights' sum (weights exp(lse - max), or exp(lse))
"""

from __future__ import annotations

import math
from typing import Callable, Iterator, Optional

import torch

from refmla.compare import Tolerance, compare
from refmla.merge.format import MergeCapture
from refmla.merge.reference import Pieces, documented, merge, recorded
from refmla.results import Explanation

Variant = tuple[str, dict, Pieces]


def _base(cap: MergeCapture) -> Iterator[Variant]:
    p = documented(cap)
    other = "e" if p.base == "2" else "2"
    yield "merge_lse_base", {"documented_base": p.base, "merged_as": other}, p.with_(base=other)


def _empty(cap: MergeCapture) -> Iterator[Variant]:
    p, r = documented(cap), recorded(cap)
    for piece in ("a", "b"):
        empty = cap.empty(piece)
        if not bool(empty.any()):
            continue
        rows = sorted({int(t) for t in empty.nonzero()[:, 0]})
        lse = getattr(r, f"lse_{piece}")
        for value in (0.0, math.nan):
            v = torch.where(empty, torch.tensor(value, dtype=lse.dtype), lse)
            yield "merge_empty_piece_lse", {"piece": piece, "value": "nan" if value != value else value,
                                            "rows": rows[:16]}, p.with_(**{f"lse_{piece}": v})  # fmt: skip


def _dropped(cap: MergeCapture) -> Iterator[Variant]:
    p = documented(cap)
    for piece, keep in (("a", "b"), ("b", "a")):
        lse = getattr(p, f"lse_{piece}")
        yield "merge_piece_dropped", {"dropped": piece}, p.with_(**{f"lse_{piece}": torch.full_like(lse, -math.inf)})


def _layout(cap: MergeCapture) -> Iterator[Variant]:
    p = documented(cap)
    T, H = p.lse_a.shape
    if T > 1 and H > 1:
        as_ht = {k: getattr(p, k).reshape(H, T).t() for k in ("lse_a", "lse_b")}
        yield "merge_lse_layout", {"stored": "[T, H]", "read_as": "[H, T]"}, p.with_(**as_ht)


def _swapped(cap: MergeCapture) -> Iterator[Variant]:
    p = documented(cap)
    yield "merge_lse_swapped", {}, p.with_(lse_a=p.lse_b, lse_b=p.lse_a)


def _unnormalized(cap: MergeCapture) -> Iterator[Variant]:
    p = documented(cap)
    for weights in ("exp(lse - max)", "exp(lse)"):
        yield "merge_unnormalized", {"weights": weights}, p.with_(weights=weights)


FAMILIES: tuple[Callable[[MergeCapture], Iterator[Variant]], ...] = (_base, _empty, _dropped, _layout, _swapped,
                                                                     _unnormalized)  # fmt: skip


def explain(cap: MergeCapture, tol: Tolerance) -> Optional[Explanation]:
    """The first variant whose merge the output matches within the comparator's allowance, or None."""
    for family in FAMILIES:
        for name, detail, pieces in family(cap):
            want, _ = merge(pieces)
            ctl = merge(pieces, torch.float32)[0].to(cap.out.dtype)
            c = compare(name, cap.out, want, ctl, tol=tol)
            if c.passed:
                return Explanation(hypothesis=name, request=None, detail=detail, max_abs_err=c.max_abs_err,
                                   residual_ratio=float(c.worst.ratio or 0.0))  # fmt: skip
    return None


__all__ = ["FAMILIES", "explain"]

"""How a family's candidates become an explanation.

* :func:`per_request`: each failing request (worst first) gets its own candidate, confirmed on its
  rows; then all of them together on the whole output. A request nothing explains ends the search.
* :func:`global_hypothesis`: whole-output candidates, confirmed best first.

Both confirm at most CONFIRM_TOP candidates, and both report through :func:`explained`.
"""

from __future__ import annotations

from itertools import islice
from typing import Any, Callable, Iterator, Optional

import torch

from refmla.compare import Comparison
from refmla.hypotheses.search import CONFIRM_TOP, Candidate, Search
from refmla.results import Explanation

Finder = Callable[[Search, int], Iterator[Candidate]]  # request b's candidates, best first


def per_request(s: Search, name: str, finder: Finder) -> Optional[Explanation]:
    """Explain every failing request (worst first, each its own detail), then confirm them together."""
    found: dict[int, Candidate] = {}
    for b in s.failing:
        hit = first_confirmed(s, finder(s, b), s.rows_of(b))
        if hit is None:
            return None
        found[b] = hit[0]
    expected, control = s.ref.clone(), s.ctrl.clone()
    for b, cand in found.items():
        rows = s.rows_of(b)
        expected[rows], control[rows] = cand.expected, cand.control
    cmp = s.confirm(expected, control)
    if not cmp.passed:
        return None
    worst = found[s.worst_request]
    extra = {"scope": "request", **worst.extra}
    if len(found) > 1:
        extra["requests"] = [{"request": b, "detail": c.detail} for b, c in found.items()]
    return explained(s, name, worst.detail, cmp, extra)


def global_hypothesis(s: Search, name: str, candidates: Iterator[Candidate]) -> Optional[Explanation]:
    """Confirm whole-output candidates, best first."""
    hit = first_confirmed(s, candidates)
    if hit is None:
        return None
    cand, cmp = hit
    return explained(s, name, cand.detail, cmp, {"scope": "all requests", **cand.extra})


def first_confirmed(
    s: Search, candidates: Iterator[Candidate], rows: Optional[torch.Tensor] = None
) -> Optional[tuple[Candidate, Comparison]]:
    """The first of the CONFIRM_TOP first candidates the comparator passes (on ``rows``, or all)."""
    for cand in islice(candidates, CONFIRM_TOP):
        cmp = s.confirm(cand.expected, cand.control, rows)
        if cmp.passed:
            return cand, cmp
    return None


def explained(s: Search, name: str, detail: dict[str, Any], cmp: Comparison, extra: dict[str, Any]) -> Explanation:
    """The explanation of hypothesis ``name`` with ``detail``, confirmed by ``cmp``, about the worst request."""
    b = s.worst_request
    ratio = cmp.row_err / cmp.row_tol if cmp.row_err is not None else None
    return Explanation(
        hypothesis=name, request=b, detail=detail, max_abs_err=cmp.max_abs_err,
        residual_ratio=float(ratio.max()) if ratio is not None and ratio.numel() else 0.0,
        heads=s.heads_failing(b), extra=extra,
    )  # fmt: skip


def rescore(s: Search, b: int, expected: torch.Tensor) -> float:
    """Screening ratio of request b's rows against a candidate's fp64 expectation."""
    rows = s.rows_of(b)
    r = s.row_ratio(s.o64[rows], expected, rows)
    if s.mask is not None:
        r = r[s.mask[rows]]
    return float(r.max()) if r.numel() else 0.0

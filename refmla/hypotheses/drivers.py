"""How a family's candidates become an explanation.

* :func:`per_request`: each failing request (worst first) gets its own candidate, confirmed on its
  rows; then all of them together on the whole output. A worst request nothing explains ends the
  search; a later one is listed under ``unexplained_requests`` (a partial explanation, which
  :func:`refmla.hypotheses.explain_failure` reports only when no family explains everything).
* :func:`global_hypothesis`: whole-output candidates.

Both confirm the candidates a family hands them (at most ``limit``, in screening order) and
report the *simplest* that the comparator passes (``Candidate.simplicity``, then the screening
score), never merely the best-screening one: the last tokens of a long request carry little
weight, so deltas -1, -2 and -3 can all fit, and the kernel engineer must be sent after the -1.
Every other candidate that also confirms is listed under ``alternatives``.
"""

from __future__ import annotations

from itertools import islice
from typing import Any, Callable, Iterator, Optional

import torch

from refmla.compare import Comparison
from refmla.hypotheses.search import CONFIRM_TOP, Candidate, Search
from refmla.results import Alternative, Explanation

Finder = Callable[[Search, int], Iterator[Candidate]]  # request b's candidates, best first
Hit = tuple[Candidate, Comparison]


# A per-request family searches the worst failing requests, at most this many: its cost follows the
# bound, not the batch (10**6 failing requests would be 10**6 searches); the rest are reported as
# unexplained_requests, so the explanation is then partial, never silently complete (issue 22).
MAX_SEARCHED_REQUESTS = 64


def per_request(s: Search, name: str, finder: Finder, limit: Optional[int] = CONFIRM_TOP) -> Optional[Explanation]:
    """Explain every failing request (worst first, each its own detail), then confirm them together."""
    found: dict[int, Candidate] = {}
    alts: list[Alternative] = []
    unexplained: list[int] = list(s.failing[MAX_SEARCHED_REQUESTS:])  # past the bound: not searched
    for b in s.failing[:MAX_SEARCHED_REQUESTS]:
        hits = confirmed(s, finder(s, b), s.rows_of(b), limit)
        if not hits:
            if b == s.worst_request:
                return None  # the worst request decides: abandon the family at once
            unexplained.append(b)
            continue
        found[b] = hits[0][0]
        alts += [Alternative(name, c.detail, b, residual(cmp)) for c, cmp in hits[1:]]
    expected, control = s.ref.clone(), s.ctrl.clone()
    for b, cand in found.items():
        rows = s.rows_of(b)
        expected[rows], control[rows] = cand.expected, cand.control
    if unexplained:  # judge the explained requests' rows only
        rows = torch.cat([s.rows_of(b) for b in found])
        cmp = s.confirm(expected[rows], control[rows], rows)
    else:
        cmp = s.confirm(expected, control)
    if not cmp.passed:
        return None
    worst = found[s.worst_request]
    extra = {"scope": "request", **worst.extra}
    if len(found) > 1:
        extra["requests"] = [{"request": b, "detail": c.detail} for b, c in found.items()]
    e = explained(s, name, worst.detail, cmp, extra, alts)
    e.explained_requests, e.unexplained_requests = list(found), unexplained
    return e


def global_hypothesis(
    s: Search, name: str, candidates: Iterator[Candidate], limit: Optional[int] = CONFIRM_TOP
) -> Optional[Explanation]:
    """Confirm whole-output candidates (at most ``limit``, in the order given); the simplest that passes."""
    hits = confirmed(s, candidates, None, limit)
    if not hits:
        return None
    (cand, cmp), rest = hits[0], hits[1:]
    alts = [Alternative(name, c.detail, None, residual(m)) for c, m in rest]
    return explained(s, name, cand.detail, cmp, {"scope": "all requests", **cand.extra}, alts)


def confirmed(
    s: Search, candidates: Iterator[Candidate], rows: Optional[torch.Tensor] = None, limit: Optional[int] = CONFIRM_TOP
) -> list[Hit]:
    """The first ``limit`` candidates (all with None) that the comparator passes (on ``rows``, or
    all), simplest first (``Candidate.simplicity``, then the screening score)."""
    hits = []
    for i, cand in enumerate(islice(candidates, limit)):
        cmp = s.confirm(cand.expected, cand.control, rows)
        if cmp.passed:
            hits.append((cand, cmp, i))
    hits.sort(key=lambda h: (h[0].simplicity, h[0].score, h[2]))
    seen, out = set(), []
    for c, m, _ in hits:  # one setting named twice (a named and a fitted ratio that agree) counts once
        key = detail_key(c.detail)
        if key not in seen:
            seen.add(key)
            out.append((c, m))
    return out


def detail_key(detail: dict[str, Any]) -> tuple:
    """A detail, floats to 9 significant digits: two settings that are the same number are one."""
    return tuple((k, float(f"{v:.9g}") if isinstance(v, float) else repr(v)) for k, v in sorted(detail.items()))


def first_confirmed(
    s: Search, candidates: Iterator[Candidate], rows: Optional[torch.Tensor] = None
) -> Optional[Hit]:
    """The first of the CONFIRM_TOP first candidates the comparator passes (on ``rows``, or all)."""
    for cand in islice(candidates, CONFIRM_TOP):
        cmp = s.confirm(cand.expected, cand.control, rows)
        if cmp.passed:
            return cand, cmp
    return None


def residual(cmp: Comparison) -> float:
    """Worst (row, head) error / allowed of a comparison (0 when nothing was compared)."""
    ratio = cmp.row_err / cmp.row_tol if cmp.row_err is not None else None
    return float(ratio.max()) if ratio is not None and ratio.numel() else 0.0


def explained(
    s: Search, name: str, detail: dict[str, Any], cmp: Comparison, extra: dict[str, Any],
    alternatives: Optional[list[Alternative]] = None,
) -> Explanation:  # fmt: skip
    """The explanation of hypothesis ``name`` with ``detail``, confirmed by ``cmp``, about the worst request."""
    b = s.worst_request
    return Explanation(
        hypothesis=name, request=b, detail=detail, max_abs_err=cmp.max_abs_err, residual_ratio=residual(cmp),
        heads=s.heads_failing(b), extra=extra, alternatives=list(alternatives or []),
    )  # fmt: skip


def rescore(s: Search, b: int, expected: torch.Tensor) -> float:
    """Screening ratio of request b's rows against a candidate's fp64 expectation.

    The allowance is the replay's own for each row, widened where the candidate's output is larger
    than the reference's (rounding noise follows the magnitude: a page read from a block of large
    garbage rows gives outputs ten times the reference's, and its bf16 rounding with them); the
    confirmation then judges the candidate with its own control, as the comparator does."""
    rows = s.rows_of(b)
    r = s.row_ratio(s.o64[rows], expected, rows) / s.magnitude_ratio(expected, rows)
    if s.mask is not None:
        r = r[s.mask[rows]]
    return float(r.max()) if r.numel() else 0.0

"""What the whole-output scalar hypotheses share (wrong_sm_scale, logit_cap_mismatch): screening a
value on the worst request in fp32, a 1-D fit when no named value screens well, and confirming
the survivors on the whole output, recomputed under the value.

A family lists the values that name a known mistake, screens them (:class:`Guess`), fits one
more with :func:`fit_1d` when none screens within GOOD, and hands the ranking to
:func:`scalar_hypothesis` with how to build a candidate from a guess.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch

from refmla import reference as ref
from refmla.control import capture_control
from refmla.hypotheses.drivers import global_hypothesis
from refmla.hypotheses.search import SCREEN, Candidate, Search
from refmla.results import Explanation
from refmla.scales import Scales

GOOD = 1.5  # a named candidate screening this well is confirmed before any fit is tried
FIT_HEADS = 2  # rows (token, head) of the worst request a 1-D fit looks at


@dataclass
class Guess:
    """A value a scalar may have had instead of the given one, and how well it screens."""

    score: float  # screening ratio on the worst request (refmla.hypotheses.drivers.rescore)
    value: float
    why: str  # the mistake it names, or "fitted" / "fitted, rounded"


def best_score(guesses: list[Guess]) -> float:
    return min((g.score for g in guesses), default=math.inf)


def prefer(guesses: list[Guess]) -> list[Guess]:
    """The order to confirm guesses listed in preference order: those screening within tolerance
    keep their preference order (named before fitted, round before exact), then the rest by score."""
    ok = [g for g in guesses if g.score <= 1.0]
    return ok + sorted((g for g in guesses if g.score > 1.0), key=lambda g: g.score)


def scalar_hypothesis(
    s: Search, name: str, guesses: list[Guess], candidate: Callable[[Guess], Candidate]
) -> Optional[Explanation]:
    """Confirm the guesses screening under SCREEN on the whole output, in :func:`prefer`'s order
    (at most CONFIRM_TOP: each is a whole-output recompute); of those that pass, the simplest is
    reported: a named mistake before a fitted value, in the order ``guesses`` lists them."""
    rank = {id(g): (g.why.startswith("fitted"), i) for i, g in enumerate(guesses)}

    def candidates() -> Iterator[Candidate]:
        for g in prefer(guesses):
            if g.score >= SCREEN:
                return
            c = candidate(g)
            c.score, c.simplicity = g.score, rank[id(g)]
            yield c

    return global_hypothesis(s, name, candidates())


def rounded(x: float) -> list[tuple[float, str]]:
    """A fitted value and its rounder neighbours (2 and 3 significant digits): people set round
    numbers, and a candidate that screens equally well sorts by its score anyway."""
    out = [(float(f"{x:.2g}"), "fitted, rounded"), (float(f"{x:.3g}"), "fitted, rounded"), (x, "fitted")]
    return list({v: (v, why) for v, why in reversed(out)}.values())[::-1]


# --------------------------------------------------------------------------------------------
# The worst request in fp32, and the 1-D fit
# --------------------------------------------------------------------------------------------


@dataclass
class WorstRows:
    """The worst request's logits and values in fp32: what screening a scale or a cap recomputes."""

    logits: torch.Tensor  # [T, H, L] q . k * k_scale, positions a token does not see at -inf
    values: torch.Tensor  # [L, Dv] v * v_scale
    fit_rows: torch.Tensor  # [FIT_HEADS] its worst (token, head) rows, as indices into T * H


def worst_rows(s: Search) -> WorstRows:
    """The worst request's fp32 pieces, built once per search."""
    return s.memo("scalars.worst_rows", lambda: _worst_rows(s))


def _worst_rows(s: Search) -> WorstRows:
    r = s.req(s.worst_request)
    visible = r.visible()  # [T, L]
    logits = r.raw.float().masked_fill(~visible[:, None, :], -math.inf)  # [T, H, L]
    values = r.kv64[:, : s.sc.kv_lora_rank].float() * s.sc.v_scale  # [L, Dv]
    ratio = s.row_ratio(s.o64[r.rows], s.ref[r.rows], r.rows).flatten()  # [T * H]
    fit_rows = torch.argsort(torch.nan_to_num(ratio, posinf=1e300), descending=True)[:FIT_HEADS]
    return WorstRows(logits, values, fit_rows)


def worst_out(s: Search, scale: float, cap: float, fit: bool = False) -> torch.Tensor:
    """Output of the worst request under (sm_scale, logit_cap), fp32 inside: [T, H, Dv] fp64.

    With ``fit``, only its FIT_HEADS worst (token, head) rows: [k, Dv] (what a 1-D fit looks at).
    """
    w = worst_rows(s)
    S = w.logits.flatten(0, 1)[w.fit_rows] if fit else w.logits  # [k, L] or [T, H, L]
    S = S * scale
    if cap > 0:
        S = cap * torch.tanh(S / cap)
    return (torch.softmax(S, dim=-1) @ w.values).double()


def fit_1d(s: Search, f: Callable[[float], torch.Tensor], lo: float, hi: float, n: int = 31) -> float:
    """argmin over x in [lo, hi] (log grid, then golden section) of the squared error on the worst
    request's worst rows; ``f(x)`` returns those rows [k, Dv] (worst_out(..., fit=True))."""
    r = s.req(s.worst_request)
    fit_rows = worst_rows(s).fit_rows
    o = s.o64[r.rows].flatten(0, 1)[fit_rows]  # [k, Dv]
    w = 1.0 / s.row_tol[r.rows].flatten()[fit_rows][:, None]  # weight rows by their allowance

    def loss(logx: float) -> float:
        d = torch.nan_to_num((f(math.exp(logx)) - o) * w, nan=1e6, posinf=1e6, neginf=-1e6)
        return float((d * d).sum())

    grid = torch.linspace(math.log(lo), math.log(hi), n).tolist()
    vals = [loss(x) for x in grid]
    k = min(range(n), key=vals.__getitem__)
    a, c = grid[max(k - 1, 0)], grid[min(k + 1, n - 1)]
    g = (math.sqrt(5) - 1) / 2
    x1, x2 = c - g * (c - a), a + g * (c - a)
    f1, f2 = loss(x1), loss(x2)
    for _ in range(26):  # bracket * 0.618**26 ~ 4e-6 of two grid steps
        if f1 < f2:
            c, x2, f2 = x2, x1, f1
            x1 = c - g * (c - a)
            f1 = loss(x1)
        else:
            a, x1, f1 = x1, x2, f2
            x2 = a + g * (c - a)
            f2 = loss(x2)
    return math.exp((a + c) / 2)


def full_under(s: Search, sc: Scales, q: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference (fp64) and control of the whole capture under other scales (and another q)."""
    exp = ref.mla_ref(s.cap.q if q is None else q, s.cap.kv_buffer, s.att, sc)[0]
    return exp, capture_control(s.cap, s.dtype, sc=sc, q=q)[0]

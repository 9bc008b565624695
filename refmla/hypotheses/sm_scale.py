"""wrong_sm_scale {"ratio": r}: the kernel used r * sm_scale.

Whole output: ratios that name a known mistake (no yarn mscale^2, mscale once, 1/sqrt(D) for the
usual D, exp vs exp2, no scale at all, sm_scale or k_scale applied twice: a ratio equal to the
capture's own sm_scale or k_scale) are screened on the worst request; when none screens
within GOOD, the ratio is fitted (0.05..20) and it and its rounder neighbours are screened too.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

from refmla.hypotheses.drivers import rescore
from refmla.hypotheses.scalars import GOOD, Guess, best_score, fit_1d, full_under, rounded, scalar_hypothesis, worst_out
from refmla.hypotheses.search import Candidate, Search
from refmla.results import Explanation

NAME = "wrong_sm_scale"
LOG2E = 1.0 / math.log(2.0)


def search(s: Search) -> Optional[Explanation]:
    sm, cap = s.sc.sm_scale, s.sc.logit_cap
    if not s.req(s.worst_request).L:
        return None

    def guess(ratio: float, why: str) -> Guess:
        return Guess(rescore(s, s.worst_request, worst_out(s, ratio * sm, cap)), ratio, why)

    guesses = [guess(x, why) for x, why in scale_candidates(s)]
    if best_score(guesses) > GOOD:  # no named mistake fits: fit the ratio
        fitted = fit_1d(s, lambda x: worst_out(s, x * sm, cap, fit=True), 0.05, 20.0)
        if all(abs(fitted / g.value - 1) > 2e-3 for g in guesses):
            guesses += [guess(x, why) for x, why in rounded(fitted)]

    def candidate(g: Guess) -> Candidate:
        exp, ctl = full_under(s, dataclasses.replace(s.sc, sm_scale=g.value * sm))
        return Candidate({"ratio": g.value}, exp, ctl, extra={"why": g.why, "sm_scale_used": g.value * sm})

    return scalar_hypothesis(s, NAME, guesses, candidate)


def scale_candidates(s: Search) -> list[tuple[float, str]]:
    """Ratios r (kernel used r * sm_scale) that name a known mistake, and the mistake."""
    sm = s.sc.sm_scale
    D = s.cap.meta.head_dim
    out: list[tuple[float, str]] = []
    # DeepSeek-V3 / Kimi-K2: sm_scale = qk_head_dim**-0.5 * mscale**2 (qk_head_dim 192 = 128 nope + 64 rope)
    for qk in (192, D, s.sc.kv_lora_rank, 128):
        m2 = sm * math.sqrt(qk)
        if m2 > 1.0 + 1e-6:  # a yarn mscale^2 is in there
            out += [(1 / m2, f"without yarn mscale^2 (1/sqrt({qk}) only)"),
                    (1 / math.sqrt(m2), f"yarn mscale once instead of squared (qk_head_dim {qk})"),
                    (m2, f"yarn mscale^2 applied twice (qk_head_dim {qk})")]  # fmt: skip
        out.append((qk**-0.5 / sm, f"1/sqrt({qk}) instead of the given sm_scale"))
    out += [(LOG2E, "scaled by log2(e) twice (exp2 path)"), (1 / LOG2E, "log2(e) missing in an exp2 softmax"),
            (1 / sm, "no softmax scale at all"), (sm, "sm_scale applied twice (the ratio is the capture's sm_scale)")]
    if abs(s.sc.k_scale - 1) > 1e-6:
        out.append((s.sc.k_scale, "k_scale applied twice (folded into the softmax scale, then again)"))
    return [(r, why) for r, why in out if abs(r - 1) > 1e-6]

"""logit_cap_mismatch {"logit_cap": c}: the kernel applied soft cap c (0: omitted).

Whole output: the given cap omitted and the caps models use are screened on the worst request;
when none screens within GOOD, the cap is fitted (1..1000) and it and its rounder neighbours are
screened too.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from refmla.hypotheses.drivers import rescore
from refmla.hypotheses.scalars import GOOD, Guess, best_score, fit_1d, full_under, rounded, scalar_hypothesis, worst_out
from refmla.hypotheses.search import Candidate, Search
from refmla.results import Explanation

NAME = "logit_cap_mismatch"
CAPS = (30.0, 50.0, 20.0, 15.0, 10.0, 25.0, 40.0, 60.0)  # soft caps models use (Grok 30, Gemma-2 50)


def search(s: Search) -> Optional[Explanation]:
    sm, given = s.sc.sm_scale, s.sc.logit_cap
    if not s.req(s.worst_request).L:
        return None

    def guess(c: float, why: str) -> Guess:
        return Guess(rescore(s, s.worst_request, worst_out(s, sm, c)), c, why)

    named = [(0.0, "soft cap omitted")] if given > 0 else []
    named += [(c, "a common soft cap") for c in CAPS if abs(c - given) > 1e-9]
    guesses = [guess(c, why) for c, why in named]
    if best_score(guesses) > GOOD:
        fitted = fit_1d(s, lambda c: worst_out(s, sm, c, fit=True), 1.0, 1000.0)
        for c, why in rounded(fitted):
            if all(abs(c - g.value) > 1e-9 for g in guesses):
                guesses.append(guess(c, why))

    def candidate(g: Guess) -> Candidate:
        exp, ctl = full_under(s, dataclasses.replace(s.sc, logit_cap=g.value))
        return Candidate({"logit_cap": g.value}, exp, ctl, extra={"why": g.why, "given_logit_cap": given})

    return scalar_hypothesis(s, NAME, guesses, candidate)

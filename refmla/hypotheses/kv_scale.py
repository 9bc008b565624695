"""kv_scale_misapplied {"scale", "applied"}: on a pool stored with dequant scales (fp8), the kernel
applied k_scale and/or v_scale twice or not at all, or one in the other's place (applied "the other
scale in its place": vLLM #37054, a kernel that reads V through K dequantizes it with k_scale).

Whole output. K's scale multiplies every logit, V's the output:

    k_scale twice      logits * k_scale        k_scale missing   logits / k_scale
    v_scale twice      output * v_scale        v_scale missing   output / v_scale

Identifiability: k_scale applied twice (or missing) is exactly the arithmetic of a softmax scale
off by the ratio k_scale (or 1 / k_scale), what wrong_sm_scale would report. This family is tried
before wrong_sm_scale and names the scale: a ratio equal to the pool's own k_scale is the scale
the kernel already had, a simpler cause than a new softmax scale (the explanation's ``why`` says
so). A v_scale mistake scales the output, which nothing else explains. Single-scale mistakes are
tried before both together; each is screened on the worst request and the survivors confirmed on
the whole output, recomputed under the scales.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator, Optional

from refmla.hypotheses.drivers import global_hypothesis, rescore
from refmla.hypotheses.scalars import full_under, worst_out
from refmla.hypotheses.search import SCREEN, Candidate, Search
from refmla.results import Explanation

NAME = "kv_scale_misapplied"
APPLIED = {"twice": lambda x: x * x, "not at all": lambda x: 1.0}
# one scale used in the other's place (vLLM #37054; TRITON_MLA reads V as K, dequantized with k_scale)
SWAPPED = "the other scale in its place"


def used(scale: str, applied: str, k: float, v: float) -> tuple[float, float]:
    """(k_scale, v_scale) the kernel used under the mistake."""
    if applied == SWAPPED:
        return (v, v) if scale == "k_scale" else (k, k)
    return (APPLIED[applied](k) if "k_scale" in scale else k, APPLIED[applied](v) if "v_scale" in scale else v)


def search(s: Search) -> Optional[Explanation]:
    k, v = s.sc.k_scale, s.sc.v_scale
    if (k == 1.0 and v == 1.0) or not s.req(s.worst_request).L:
        return None
    guesses = []  # (score, preference, k_used, v_used, detail)
    for pref, (scale, applied) in enumerate(mistakes(k, v)):
        k2, v2 = used(scale, applied, k, v)
        out = worst_out(s, s.sc.sm_scale * k2 / k, s.sc.logit_cap) * (v2 / v)
        guesses.append((rescore(s, s.worst_request, out), pref, k2, v2, {"scale": scale, "applied": applied}))
    ok = sorted((g for g in guesses if g[0] <= 1.0), key=lambda g: g[1])  # within tolerance: simplest first
    rest = sorted((g for g in guesses if 1.0 < g[0] < SCREEN), key=lambda g: g[0])

    def candidates() -> Iterator[Candidate]:
        for _, _, k2, v2, detail in ok + rest:
            exp, ctl = full_under(s, dataclasses.replace(s.sc, k_scale=k2, v_scale=v2))
            yield Candidate(detail, exp, ctl, extra={"k_scale": k, "v_scale": v, "k_scale_used": k2,
                                                     "v_scale_used": v2, "why": why(detail, k, v)})  # fmt: skip

    return global_hypothesis(s, NAME, candidates())


def mistakes(k: float, v: float) -> list[tuple[str, str]]:
    """(which scale, how applied), single scales first, skipping scales of 1 (no mistake to see)."""
    out = []
    for scale, x in (("k_scale", k), ("v_scale", v)):
        if x != 1.0:
            out += [(scale, "twice"), (scale, "not at all")]
    if k != 1.0 and v != 1.0:
        out += [("k_scale and v_scale", "twice"), ("k_scale and v_scale", "not at all")]
    if k != v:
        out += [("v_scale", SWAPPED), ("k_scale", SWAPPED)]
    return out


def why(detail: dict, k: float, v: float) -> str:
    if detail["applied"] == SWAPPED:
        other = "k_scale" if detail["scale"] == "v_scale" else "v_scale"
        return (f"{detail['scale']} replaced by {other} ({k:.6g} / {v:.6g}): K and V dequantized with one scale, "
                f"as a kernel reading V through K does")  # fmt: skip
    r = k if detail["applied"] == "twice" else 1.0 / k
    if "k_scale" in detail["scale"]:
        return (f"{detail['scale']} {detail['applied']}: logits scaled by {r:.6g}, the same arithmetic as "
                f"wrong_sm_scale(ratio={r:.6g}); a ratio equal to the pool's own k_scale names the scale the kernel "
                f"already had, simpler than a new softmax scale")  # fmt: skip
    r = v if detail["applied"] == "twice" else 1.0 / v
    return f"v_scale {detail['applied']}: the output scaled by {r:.6g}"

"""Faults of a kernel's launch plan (issue 31), planted the way the broken kernel computes them and
registered with the hypothesis that must name each:

    heads_folded_zero    32 -> 16 style head folding (fold 2), only pseudo-row 0 written back:
                         the second half of the heads zero (vLLM #42956)
    heads_folded_mixed   heads folded 4x where the heads allow it (else 2x), unfolded one pseudo-row
                         off: head h holds head h + H / fold (vLLM #46952: cosine 0.69)
"""

from __future__ import annotations

import torch

from refmla.synth.faults import Planting, fault


def _fold(p: Planting, want: int) -> int:
    H = p.spec.num_heads
    if H % want == 0 and H // want >= 2:
        return want
    if H % 2 == 0 and H >= 4:
        return 2
    raise ValueError(f"{H} heads cannot be folded with at least 2 heads per pseudo-row")


@fault("heads_folded_zero", "heads folded 2x (H/2 per pseudo-row), only pseudo-row 0 written back: heads H/2.. zero",
       expect="heads_folded")  # fmt: skip
def _heads_folded_zero(p: Planting):
    f = _fold(p, 2)
    out = p.run().clone()
    out[:, p.spec.num_heads // f :] = 0
    return out, {"fold": f, "how": "zero"}


@fault("heads_folded_mixed", "heads folded 4x (2x when H < 8), unfolded one pseudo-row off: head h holds head "
       "h + H/fold", expect="heads_folded")  # fmt: skip
def _heads_folded_mixed(p: Planting):
    H = p.spec.num_heads
    f = _fold(p, 4)
    src = torch.tensor([(h + H // f) % H for h in range(H)])
    return p.run()[:, src], {"fold": f, "how": "mixed"}

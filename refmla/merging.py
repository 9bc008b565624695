"""Split partials merged in fp32: the standard merge the control and the split kernels use
(:class:`Partials`), and the merges of a kernel that merges its splits otherwise
(:func:`merge_partials` under refmla.control.Rounding's ``merge`` / ``split_lse``: lse in log2
units read as ln, natural lse merged with exp2, partials stored unnormalized, lse stored narrow).
"""

from __future__ import annotations

import math

import torch

MERGES = ("ln", "log2_as_ln", "ln_as_log2", "unnormalized")  # how split partials are merged
LOG2E, LN2 = 1.0 / math.log(2.0), math.log(2.0)
# ``rnd`` below: a refmla.control.Rounding, read for its ``merge`` and ``split_lse`` only
MERGE_FANIN = 64  # partials held at once; more are merged 64 at a time (the budget's headroom)


class Partials:
    """fp32 partials (o [H, Dv] normalized, lse [H], sum [H]) merged in the standard way (exp of
    lse - logsumexp), at most MERGE_FANIN held: up to that many the merge is the flat one, bit for bit."""

    def __init__(self):
        self.parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def add(self, o: torch.Tensor, lse: torch.Tensor, z: torch.Tensor) -> None:
        self.parts.append((o, lse, z))
        if len(self.parts) == MERGE_FANIN:
            self.parts = [self.merged()]

    def merged(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if len(self.parts) == 1:
            return self.parts[0]
        outs = torch.stack([o for o, _, _ in self.parts])  # [S, H, Dv]
        lses = torch.stack([l for _, l, _ in self.parts])  # [S, H]
        sums = torch.stack([z for _, _, z in self.parts])  # [S, H]
        lse = torch.logsumexp(lses, dim=0)  # [H]
        m = (lses - torch.log(sums)).amax(dim=0)  # [H] the largest partial maximum
        return (torch.exp(lses - lse)[..., None] * outs).sum(dim=0), lse, torch.exp(lse - m)


def merge_partials(outs: torch.Tensor, lses: torch.Tensor, sums: torch.Tensor, rnd) -> torch.Tensor:
    """Split partials merged as a kernel under ``rnd`` merges them (fp32 or fp64, as given).

    outs [S, H, Dv] normalized partials, lses [S, H], sums [S, H] each partial's sum of p (its
    normalization, for ``unnormalized``) -> [H, Dv].
    """
    num, den, _ = _weighted(outs, lses, sums, rnd)
    return num / den[..., None]


def _weighted(outs: torch.Tensor, lses: torch.Tensor, sums: torch.Tensor, rnd) -> tuple[torch.Tensor, ...]:
    """:func:`merge_partials` before its division: sum_s w_s o_s [H, Dv], sum_s w_s [H], and the
    maximum m [H] the weights w_s = exp(c (lse_s - m)) are taken against (c: the merge's base)."""
    if rnd.split_lse is not None:
        lses = lses.to(rnd.split_lse).to(lses.dtype)
    if rnd.merge == "unnormalized":
        outs = outs * sums[..., None]
    m = lses.amax(dim=0)  # [H]
    w = torch.exp(_in_base(lses - m, rnd))  # [S, H]
    return (w[..., None] * outs).sum(dim=0), w.sum(dim=0), m


def _in_base(d: torch.Tensor, rnd) -> torch.Tensor:
    """A difference of lses as the merge exponentiates it (log2 units read as ln, or the reverse)."""
    if rnd.merge == "log2_as_ln":  # lse stored as log2, merged with exp
        return d * LOG2E
    if rnd.merge == "ln_as_log2":  # natural lse merged with exp2
        return d * LN2
    return d


class StreamMerge:
    """:func:`merge_partials` over chunks of splits, folded as they come (a running numerator,
    denominator and maximum); with one chunk it is merge_partials itself, bit for bit."""

    def __init__(self, rnd):
        self.rnd, self.acc, self.lse = rnd, None, None

    def add(self, parts: list[tuple[torch.Tensor, ...]]) -> None:
        outs, lses, sums = (torch.stack([p[i] for p in parts]) for i in range(3))  # [S, H, Dv], [S, H], [S, H]
        num, den, m = _weighted(outs, lses, sums, self.rnd)
        lse = torch.logsumexp(lses, dim=0)  # [H]
        if self.acc is None:
            self.acc, self.lse = (num, den, m), lse
            return
        num0, den0, m0 = self.acc
        top = torch.maximum(m0, m)
        a, b = torch.exp(_in_base(m0 - top, self.rnd)), torch.exp(_in_base(m - top, self.rnd))  # [H]
        self.acc = (num0 * a[:, None] + num * b[:, None], den0 * a + den * b, top)
        self.lse = torch.logaddexp(self.lse, lse)

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        num, den, _ = self.acc
        return num / den[..., None], self.lse


__all__ = ["LN2", "LOG2E", "MERGES", "MERGE_FANIN", "Partials", "StreamMerge", "merge_partials"]

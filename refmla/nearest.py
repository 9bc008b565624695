"""The pairs of two point sets nearest each other, by one GEMM per block of rows: how the searches
rank every (own page, source page) pair and every (start, end) range of a request at once
(||x - y||^2 = |x|^2 + |y|^2 - 2 x . y), holding one block of distances at a time; and the fixed
random projection their rankings use."""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch

BLOCK_VALUES = 2**22  # distances held at a time


def nearest_pairs(
    X: torch.Tensor,
    Y: torch.Tensor,
    keep: int,
    allowed: Optional[Callable[[int, int], torch.Tensor]] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ``keep`` pairs (i, j) with the smallest ||X[i] - Y[j]||^2, nearest first: (i, j,
    squared distance), each [k], k <= keep. X [n, F], Y [m, F]; ``allowed(i0, i1)`` -> [i1 - i0, m]
    bool: the pairs of rows i0..i1 that count (default all)."""
    n, m = X.shape[0], Y.shape[0]
    xn, yn = (X * X).sum(1), (Y * Y).sum(1)
    step = max(1, BLOCK_VALUES // max(m, 1))
    best_d, best_k = torch.empty(0, dtype=X.dtype), torch.empty(0, dtype=torch.int64)
    for i0 in range(0, n, step):
        i1 = min(n, i0 + step)
        d = xn[i0:i1, None] + yn[None] - 2 * (X[i0:i1] @ Y.T)  # [i1 - i0, m]
        if allowed is not None:
            d.masked_fill_(~allowed(i0, i1), math.inf)
        top = torch.topk(d.flatten(), min(keep, d.numel()), largest=False)
        best_d, best_k = torch.cat([best_d, top.values]), torch.cat([best_k, top.indices + i0 * m])
        if len(best_d) > keep:
            sel = torch.topk(best_d, keep, largest=False).indices
            best_d, best_k = best_d[sel], best_k[sel]
    order = torch.argsort(best_d)
    best_d, best_k = best_d[order], best_k[order]
    fin = torch.isfinite(best_d)
    return best_k[fin] // m, best_k[fin] % m, best_d[fin]


def nearest_ranges(prefix: torch.Tensor, total: torch.Tensor, keep: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ``keep`` ranges [i, j), i < j, of prefix points ``prefix`` [n + 1, F] whose part
    prefix[j] - prefix[i] lies nearest ``total`` [F], nearest first: (i, j, squared distance). A
    range whose removal explains an output is one whose part equals the whole residual: the points
    prefix[i] + total and prefix[j] are near."""
    idx = torch.arange(prefix.shape[0])
    return nearest_pairs(prefix + total[None], prefix, keep, allowed=lambda a, e: idx[None] > idx[a:e, None])


def projection(dim: int, width: int, dtype=torch.float64) -> torch.Tensor:
    """A fixed random projection [dim, width] (seed 0): rankings reproducible run to run."""
    return torch.randn(dim, width, generator=torch.Generator().manual_seed(0), dtype=dtype)

"""heads_folded {"fold": f, "how": ...}: a folded launch unfolded wrongly.

A kernel that folds heads (aiter's fp8 decode: 32 heads run as 16 per pseudo-row, vLLM #46952;
V3.2 sparse 32 -> 16, vLLM #42956; SGLang #14936) maps (request, head h) to pseudo-row
``h // g``, lane ``h % g`` with ``g = H / f`` heads per pseudo-row. Unfolding it wrongly gives,
for each fold factor f the kernels use (2, 4, 8; at least 2 heads per pseudo-row):

    mixed       output head h holds head (h + g) mod H (or h - g): the pseudo-row index off by one
    transposed  the pseudo-row and the lane swapped: head h holds head (h % f) * g + h // f
    zero        only pseudo-row 0 written back: heads g..H-1 zero
    duplicated  pseudo-row 0 written to every pseudo-row: head h holds head h % g

Whole output, each candidate screened on the compared rows (an index of the reference: no
recompute), the best few confirmed. Tried right before ``head_misaligned``, which would name the
permutations as a bare mapping (and cannot name the zeroed half).
"""

from __future__ import annotations

from typing import Iterator, Optional

import torch

from refmla.hypotheses.drivers import global_hypothesis
from refmla.hypotheses.search import SCREEN, Candidate, Search
from refmla.results import Explanation

NAME = "heads_folded"
FOLDS = (2, 4, 8)  # the fold factors the kernels use (32 -> 16, 64 -> 16, 128 -> 16)
HOWS = ("mixed", "transposed", "zero", "duplicated")


def mappings(H: int) -> Iterator[tuple[int, str, list[Optional[int]]]]:
    """(fold, how, source head of each output head; None: zero) for every fold of H heads."""
    for f in FOLDS:
        g = H // f
        if H % f or g < 2:
            continue
        yield f, "mixed", [(h + g) % H for h in range(H)]
        if f > 2:  # the other direction (the same map at fold 2)
            yield f, "mixed", [(h - g) % H for h in range(H)]
        yield f, "transposed", [(h % f) * g + h // f for h in range(H)]
        yield f, "zero", [h if h < g else None for h in range(H)]
        yield f, "duplicated", [h % g for h in range(H)]


def search(s: Search) -> Optional[Explanation]:
    H = s.o64.shape[1]
    rows = torch.arange(s.o64.shape[0]) if s.mask is None else torch.nonzero(s.mask).flatten()  # compared rows
    if len(rows) == 0:
        return None
    cands = []
    for f, how, m in mappings(H):
        exp, ctl = unfolded(s.ref, m), unfolded(s.ctrl, m)
        score = float(s.row_ratio(s.o64[rows], exp[rows], rows).max())  # [rows, H] -> the worst
        if score < SCREEN:
            g = H // f
            extra = {"heads": m, "heads_per_row": g, "mapping": describe(f, how, H)}
            cands.append(Candidate({"fold": f, "how": how}, exp, ctl, score, extra, simplicity=(f, HOWS.index(how))))
    cands.sort(key=lambda c: c.score)
    return global_hypothesis(s, NAME, iter(cands)) if cands else None


def unfolded(t: torch.Tensor, m: list[Optional[int]]) -> torch.Tensor:
    """``t`` [R, H, Dv] with output head h holding head m[h] (zeros where m[h] is None)."""
    out = torch.zeros_like(t)
    for h, src in enumerate(m):
        if src is not None:
            out[:, h] = t[:, src]
    return out


def describe(f: int, how: str, H: int) -> str:
    g = H // f
    return {
        "mixed": f"{H} heads folded {f}x ({g} per pseudo-row), unfolded one pseudo-row off: head h holds head h +- {g}",
        "transposed": f"{H} heads folded {f}x ({g} per pseudo-row), pseudo-row and lane swapped on unfold",
        "zero": f"{H} heads folded {f}x ({g} per pseudo-row), only pseudo-row 0 written back: heads {g}..{H - 1} zero",
        "duplicated": f"{H} heads folded {f}x ({g} per pseudo-row), pseudo-row 0 written to every pseudo-row",
    }[how]

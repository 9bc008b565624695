"""head_misaligned {"mapping": "...", "heads": [...]}: output head h holds reference head heads[h].

Whole output: each output head is matched to its nearest reference head over all compared rows;
a mapping other than the identity is named (head padding sliced the wrong way, a rotation, a
permutation, duplicates) and confirmed.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from refmla.hypotheses.drivers import global_hypothesis
from refmla.hypotheses.search import Candidate, Search
from refmla.results import Explanation

NAME = "head_misaligned"


HEADS_WORK = 1 << 28  # elements the cost matrix may read (rows x H x H x Dv); the candidate is confirmed on all rows


def search(s: Search) -> Optional[Explanation]:
    o, e = s.o64, s.ref
    R, H, _ = o.shape
    rows = torch.arange(R) if s.mask is None else torch.nonzero(s.mask).flatten()
    if H < 2 or len(rows) == 0:
        return None
    rows = rows[: max(1, HEADS_WORK // (H * H * o.shape[-1]))]  # the cost matrix from a bounded sample of rows
    cost = torch.empty(H, H, dtype=torch.float64)  # [output head, reference head]
    for h in range(H):
        d = (o[rows, h][:, None, :] - e[rows]).abs().amax(-1)  # [r, H]
        cost[h] = torch.nan_to_num(d / s.row_tol[rows], nan=math.inf).amax(0)
    m = cost.argmin(1).tolist()
    if m == list(range(H)):
        return None
    idx = torch.tensor(m)
    cand = Candidate({"mapping": describe_mapping(m), "heads": m}, e[:, idx], s.ctrl[:, idx])
    return global_hypothesis(s, NAME, iter([cand]))


def describe_mapping(m: list[int]) -> str:
    H = len(m)
    ident = list(range(H))
    if H < 16 and 16 % H == 0:
        f = 16 // H
        if m == [h // f for h in range(H)]:
            return f"head padding: repeat_interleave({f}) to 16 heads, output sliced [:{H}] instead of [::{f}]"
        if m == [(h * f) % H for h in range(H)]:
            return f"head padding: tiled (repeat) to 16 heads, output sliced [::{f}] instead of [:{H}]"
    for k in range(1, H):
        if m == ident[-k:] + ident[:-k]:
            return f"heads rotated by {k}: output head h holds reference head (h - {k}) mod {H}"
    if sorted(m) == ident:
        return "heads permuted: output head h holds reference head heads[h]"
    return "heads duplicated: output head h holds reference head heads[h]"

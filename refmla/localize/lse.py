"""A final lse in the wrong units: log2 where ln is meant (lse / ln 2), or ln where log2 is meant
(lse * ln 2). Named when every failing (row, head) of the lse is the reference's in those units
to 1e-4 relative (the lse's own tolerance is 1e-5 relative: a wrong base is 44% off)."""

from __future__ import annotations

import math
from typing import Optional

import torch

from refmla.context import ReplayContext

UNITS = {"log2": 1 / math.log(2), "ln": math.log(2)}  # units -> lse in them / lse in ln


def lse_units(ctx: ReplayContext, lse: Optional[torch.Tensor], rows: list[int]) -> Optional[dict]:
    """{"hypothesis": "lse_units", "detail": {"units": ...}, "requests": rows} or None."""
    if lse is None or not rows:
        return None
    req = ctx.cap.request_of_row()
    sel = torch.nonzero(torch.isin(req, torch.tensor(rows))).flatten()
    got, want = lse.detach().double().cpu()[sel], ctx.ref_lse.double()[sel]  # [r, H]
    fin = torch.isfinite(want) & (want.abs() > 1e-3)
    if not bool(fin.any()):
        return None
    for units, f in UNITS.items():
        if bool(((got[fin] - want[fin] * f).abs() <= 1e-4 * want[fin].abs()).all()):
            return {"hypothesis": "lse_units", "detail": {"units": units}, "requests": list(rows)}
    return None

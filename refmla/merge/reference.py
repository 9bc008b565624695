"""The merge of two attention pieces, in the order the math reads (one function, any precision):

    la, lb   = lse_a, lse_b in natural units (x ln 2 for a log2 merger); +inf read as -inf
    m        = max(la, lb)                                   [T, H]
    wa, wb   = exp(la - m), exp(lb - m)                      [T, H]
    out      = (wa * out_a + wb * out_b) / (wa + wb)         [T, H, D]
    lse      = m + ln(wa + wb), back in the merger's base    [T, H]
    both empty (m = -inf): out 0, lse -inf (vLLM's torch and Triton merges; SGLang's Triton merge gives NaN)

``Pieces.weights`` other than "normalized" is a merger that forgot to divide by wa + wb
(``merge_unnormalized``).

The reference runs it in fp64 on the documented inputs (an empty piece's lse is -inf whatever was
recorded); the control runs it in fp32 and rounds ``out`` to the capture's dtype (the tolerance's
noise floor). The hypotheses run it on the inputs a mistaken merger would have used (:class:`Pieces`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from refmla.merge.format import MergeCapture

LN2 = math.log(2.0)


@dataclass(frozen=True)
class Pieces:
    """What one merge reads: both pieces and the base their lse are in."""

    out_a: torch.Tensor  # [T, H, D]
    lse_a: torch.Tensor  # [T, H]
    out_b: torch.Tensor
    lse_b: torch.Tensor
    base: str  # "e" | "2"
    weights: str = "normalized"  # NORMALIZED; a mistaken merger's: "exp(lse - max)" | "exp(lse)", not divided by their sum

    def with_(self, **kw) -> "Pieces":
        return replace(self, **kw)


def recorded(cap: MergeCapture) -> Pieces:
    """The pieces as the capture recorded them (an empty piece's lse as it was given)."""
    return Pieces(cap.out_a, cap.lse_a, cap.out_b, cap.lse_b, cap.meta.lse_base)


def documented(cap: MergeCapture) -> Pieces:
    """The pieces by the convention: an empty piece's lse is -inf."""
    ninf = torch.tensor(-math.inf, dtype=cap.lse_a.dtype)
    return recorded(cap).with_(lse_a=torch.where(cap.empty("a"), ninf, cap.lse_a),
                               lse_b=torch.where(cap.empty("b"), ninf, cap.lse_b))  # fmt: skip


def merge(p: Pieces, dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [T, H, D], lse [T, H]) in ``dtype`` (module docstring)."""
    unit = LN2 if p.base == "2" else 1.0
    la, lb = (x.to(dtype) * unit for x in (p.lse_a, p.lse_b))  # [T, H] natural
    la, lb = (torch.where(x == math.inf, -math.inf, x) for x in (la, lb))
    m = torch.maximum(la, lb)  # [T, H]
    empty = m == -math.inf
    m0 = torch.where(empty, torch.zeros_like(m), m)
    wa, wb = torch.exp(la - m0), torch.exp(lb - m0)  # [T, H]
    se = wa + wb
    if p.weights == "exp(lse)":  # the max never subtracted either
        wa, wb = torch.exp(la), torch.exp(lb)
    out = wa[..., None] * p.out_a.to(dtype) + wb[..., None] * p.out_b.to(dtype)  # [T, H, D]
    if p.weights == "normalized":
        out = out / se[..., None]
    out = torch.where(empty[..., None], torch.zeros_like(out), out)
    lse = torch.where(empty, m, m0 + torch.log(se)) / unit  # [T, H]
    return out, lse


def reference(cap: MergeCapture) -> tuple[torch.Tensor, torch.Tensor]:
    return merge(documented(cap))


def control(cap: MergeCapture) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32, ``out`` rounded to the capture's output dtype."""
    out, lse = merge(documented(cap), torch.float32)
    return out.to(cap.out.dtype), lse


__all__ = ["Pieces", "control", "documented", "merge", "recorded", "reference"]

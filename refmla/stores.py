"""How an fp32 (or fp64) result is stored in a narrower dtype: to nearest even, toward zero, to
nearest with ties away from zero, or through fp16 first (the control's and the numerics variants'
stores, refmla.control.Rounding.store)."""

from __future__ import annotations

import torch

STORES = ("nearest_even", "toward_zero", "half_away", "via_fp16")  # fp32 result -> output dtype


def store_as(x: torch.Tensor, dtype: torch.dtype, how: str = "nearest_even") -> torch.Tensor:
    """fp32 (or fp64) ``x`` stored in ``dtype``: to nearest even (``.to``), toward zero, to nearest
    with ties away from zero, or through fp16 first (STORES)."""
    y = x.to(dtype)
    if how == "nearest_even" or not dtype.is_floating_point or dtype.itemsize >= x.dtype.itemsize:
        return y
    if how == "via_fp16":
        return x.to(torch.float16).to(dtype)
    lo = torch.where(y.double().abs() > x.double().abs(), _toward_zero(y), y)  # |lo| <= |x|
    if how == "toward_zero":
        return lo
    hi = torch.where(lo.double() == x.double(), lo, _away_from_zero(lo, x))
    tie = (x.double() - lo.double()).abs() == (hi.double() - x.double()).abs()
    return torch.where(tie & torch.isfinite(x), hi, y)  # half_away


def _bits(y: torch.Tensor) -> torch.Tensor:
    return y.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[y.dtype.itemsize])


def _toward_zero(y: torch.Tensor) -> torch.Tensor:
    """One ulp toward zero (finite non-zero values; sign-magnitude bits: the magnitude minus one)."""
    ok = torch.isfinite(y) & (y != 0)
    return torch.where(ok, (_bits(y) - 1).view(y.dtype), y)


def _away_from_zero(y: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """One ulp away from zero, with the sign of ``like`` where ``y`` is zero."""
    z = torch.where(y == 0, torch.zeros_like(y).copysign(like.to(y.dtype)), y)
    nxt = (_bits(z) + 1).view(y.dtype)
    return torch.where(torch.isfinite(y), nxt, y)


__all__ = ["STORES", "store_as"]

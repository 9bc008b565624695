"""The one comparator (docs/contract.md section 5), used by replay, tests, goldens and benchmarks.

A backend's output passes when, on every (row, head) -- a row is a request in decode, a token
in extend -- its max abs error against the fp64 reference is at most

    k * (the low-precision control's max abs error on that row)
      + ulps * (one unit in the last place of the output dtype at the row's largest magnitude)

NaN and Inf sit at the same places, and the cosine difference ``1 - 2*sum(x*y)/sum(x*x + y*y)``
stays under ``cos`` over the whole output and on every row. ``cos`` defaults to 1e-5 and is
widened to ``k**2`` times the control's own cosine difference (the cosine difference grows with
the square of the error) where the stored dtypes are coarser (fp8 KV), so the threshold always
means "k times rounding noise".
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import Optional

import numpy as np
import torch

from refmla.util import request_label


@dataclass(frozen=True)
class Tolerance:
    k: float = 2.0  # allowed multiple of the control's error
    ulps: float = 1.0  # plus this many ulp of the output dtype at the row's largest magnitude
    cos: float = 1e-5  # cosine-difference ceiling (whole output and each row)

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Worst:
    """The worst (row, head) of a comparison, and its worst element where it names one: what the
    output's comparison, the lse check and the split check report. ``keys`` are the JSON keys it
    was given, in order (each check names its own; :meth:`to_json` writes exactly those)."""

    request: Optional[int] = None
    head: Optional[int] = None
    row: Optional[int] = None  # the compared row (token) of the tensor
    dim: Optional[int] = None
    split: Optional[int] = None
    actual: Optional[float] = None
    expected: Optional[float] = None
    err: Optional[float] = None
    allowed: Optional[float] = None
    ratio: Optional[float] = None
    keys: tuple = field(default=(), repr=False)

    @classmethod
    def of(cls, **kw) -> "Worst":
        """The worst with these fields, written to JSON in this order."""
        return cls(**kw, keys=tuple(kw))

    @classmethod
    def from_json(cls, d: Optional[dict]) -> Optional["Worst"]:
        return None if d is None else cls.of(**d)

    def to_json(self) -> dict:
        return {k: getattr(self, k) for k in self.keys}


@dataclass
class Comparison:
    name: str
    passed: bool
    max_abs_err: float
    max_rel_err: float  # max abs error / the row's largest magnitude
    max_ulp_err: float  # in ulps of the output dtype at each element's magnitude
    cos_diff: float  # whole output
    worst_row_cos_diff: float
    worst: Worst  # request, head (and row/token, dim, actual, expected, err, allowed, ratio)
    failed_rows: int = 0  # compared (row, head) rows that fail: over their allowance or a NaN / Inf misplaced
    compared_rows: int = 0
    nan_mismatch: int = 0  # elements whose NaN / signed Inf placement differs from the reference
    reasons: list = field(default_factory=list)
    nonfinite_rows: int = 0  # compared (row, head) rows with a misplaced NaN / Inf (counted in failed_rows)
    # the error at the misplaced elements (NaN, or Inf when every one is an Inf against a number):
    # what max_abs_err, taken where both sides are finite, cannot show
    nonfinite_err: float = field(default=0.0, repr=False)
    row_err: Optional[torch.Tensor] = field(default=None, repr=False)  # [R, H] max abs err
    row_tol: Optional[torch.Tensor] = field(default=None, repr=False)  # [R, H] allowed
    # [R, H] the verdict per compared (row, head): over its allowance, NaN / signed Inf misplaced, or
    # its cosine difference over its ceiling (False for rows not compared); what the search reads
    row_failed: Optional[torch.Tensor] = field(default=None, repr=False)
    row_nonfinite: Optional[torch.Tensor] = field(default=None, repr=False)  # [R, H] a NaN / Inf misplaced

    def to_json(self) -> dict:
        skip = ("row_err", "row_tol", "row_failed", "row_nonfinite", "name", "nonfinite_err")
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in skip}
        d["worst"], d["reasons"] = self.worst.to_json(), list(self.reasons)
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in d.items()}

    def err_text(self) -> str:
        """max_abs_err for people: ``nan (4096 non-finite)`` where a NaN / Inf is misplaced, so a
        failure never reads as the noise level of the elements that are finite."""
        if self.nan_mismatch:
            return f"{'inf' if self.nonfinite_err == math.inf else 'nan'} ({self.nan_mismatch} non-finite)"
        return "0" if self.max_abs_err == 0 else f"{self.max_abs_err:.3g}"

    def summary(self) -> str:
        w = self.worst
        where = f"{request_label(w.request)} head {w.head}"
        if self.passed:
            return f"{self.name}: pass (max abs err {self.max_abs_err:.3g} at {where})"
        return f"{self.name}: FAIL ({'; '.join(self.reasons)})"


def judged_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype an output is judged in (the control is rounded to it; its ulp is allowed): the
    output's own floating dtype, fp32 for fp64 outputs (a reference-precision output is held to fp32
    noise) and for anything that is not floating point."""
    return dtype if dtype.is_floating_point and dtype.itemsize < 8 else torch.float32


def ulp(dtype: torch.dtype, magnitude: torch.Tensor) -> torch.Tensor:
    """One unit in the last place of ``dtype`` at ``magnitude`` (fp64 tensor)."""
    fi = torch.finfo(dtype)
    m = magnitude.abs().clamp(min=fi.tiny)
    return fi.eps * torch.exp2(torch.floor(torch.log2(m)))


def cos_diff(x: torch.Tensor, y: torch.Tensor, dim=None) -> torch.Tensor:
    """1 - 2*sum(x*y)/sum(x*x + y*y) in fp64; 0 where both are all zero."""
    x, y = x.double(), y.double()
    num = 2 * (x * y).sum(dim=dim) if dim is not None else 2 * (x * y).sum()
    den = (x * x + y * y).sum(dim=dim) if dim is not None else (x * x + y * y).sum()
    return torch.where(den > 0, 1 - num / den.clamp(min=1e-300), torch.zeros_like(den))


COMPARE_BLOCK = 1 << 21  # elements of [rows, H, Dv] judged at once (each fp64 copy 16 MiB): memory follows a block


def compare(
    name: str,
    actual: torch.Tensor,
    expected: torch.Tensor,
    control: Optional[torch.Tensor] = None,
    *,
    out_dtype: Optional[torch.dtype] = None,
    tol: Tolerance = Tolerance(),
    row_mask: Optional[torch.Tensor] = None,
    request_of_row: Optional[torch.Tensor] = None,
) -> Comparison:
    """Compare ``actual`` [R, H, Dv] with the fp64 ``expected`` [R, H, Dv].

    control: the low-precision control's output (same shape), or None (ulps term only).
    out_dtype: whose ulp to allow (default judged_dtype(actual.dtype)). row_mask [R]: rows to compare.
    request_of_row [R]: the request each row belongs to, for the report (default: the row).
    Works in blocks of rows (COMPARE_BLOCK elements): a row's verdict is its own, the whole
    output's cosine the sums of its blocks; what it holds besides the inputs is [R, H] per row.
    """
    out_dtype = out_dtype or judged_dtype(actual.dtype)
    if actual.shape != expected.shape:
        return _shape_failure(name, actual, expected)
    R = actual.shape[0]
    mask = torch.ones(R, dtype=torch.bool) if row_mask is None else row_mask.to("cpu", torch.bool)
    req = torch.arange(R) if request_of_row is None else request_of_row.to("cpu")
    rows = _RowErrors.judged(actual, expected, control, tol, out_dtype, mask)  # 1. NaN / Inf, 2. error per (row, head)
    nan_reason = _nan_inf_reason(rows, mask, req)
    over_rows, row_reason = _rows_over_allowance(rows, mask, req)
    whole_cos, row_cos, cos_reasons, cos_failed = _cosine(rows, mask, req, tol, over_rows)  # 3. cosine
    reasons = [r for r in (nan_reason, row_reason) if r] + cos_reasons
    nan_mismatch = rows.nan_mismatch
    row_nonfinite = rows.bad_rows  # [R, H] a misplaced NaN / Inf: the row fails whatever its finite error
    worst = _worst_row(actual, expected, rows, mask, req, nan_mismatch > 0)  # 4. the worst row

    sel = mask[:, None].expand(R, rows.row_err.shape[1]) if rows.row_err.dim() == 2 else mask
    return Comparison(
        name=name,
        passed=not reasons,
        max_abs_err=float(rows.row_err[sel].max()) if sel.any() else 0.0,
        max_rel_err=float((rows.row_err / rows.row_mag.clamp(min=1e-300))[sel].max()) if sel.any() else 0.0,
        max_ulp_err=float(rows.row_ulp[mask].max()) if sel.any() else 0.0,
        cos_diff=whole_cos,
        worst_row_cos_diff=float(row_cos.max()) if row_cos.numel() else 0.0,
        worst=worst,
        failed_rows=int((((rows.row_err > rows.row_tol) | row_nonfinite) & mask[:, None]).sum()),
        compared_rows=int(sel.sum()),
        nan_mismatch=nan_mismatch,
        reasons=reasons,
        nonfinite_rows=int(row_nonfinite.sum()),
        nonfinite_err=(math.nan if rows.misplaced_nan else math.inf) if nan_mismatch else 0.0,
        row_err=rows.row_err,
        row_tol=rows.row_tol,
        row_failed=((rows.row_err > rows.row_tol) | row_nonfinite | cos_failed) & mask[:, None],
        row_nonfinite=row_nonfinite,
    )


@dataclass
class _RowErrors:
    """Errors of one output against the reference, per (row, head), and the sums the whole output's
    verdicts need; built block of rows by block (:meth:`judged`)."""

    row_err: torch.Tensor  # [R, H] max abs error (where both are finite)
    row_mag: torch.Tensor  # [R, H] the reference's largest finite magnitude
    row_tol: torch.Tensor  # [R, H] allowed: k * control's max abs error + ulps * ulp(row_mag)
    ctrl_cos: torch.Tensor  # [R, H] the control's own cosine difference
    row_ulp: torch.Tensor  # [R, H] the largest error in ulps of the output dtype at each element's magnitude
    row_dim: torch.Tensor  # [R, H] int64: the dim of the row's largest error
    row_cos: torch.Tensor  # [R, H] cosine difference of the compared rows' finite elements
    bad_rows: torch.Tensor  # [R, H] a NaN / signed Inf misplaced (compared rows only)
    num: float = 0.0  # whole output: 2 * sum(x * y) over compared finite elements
    den: float = 0.0  # sum(x * x + y * y)
    nan_mismatch: int = 0  # elements whose NaN / Inf placement differs
    first_bad: Optional[tuple] = None  # (row, head, dim, actual, expected) of the first such element
    misplaced_nan: bool = False  # a NaN among them (else every one is an Inf against a number)

    @classmethod
    def judged(cls, actual, expected, control, tol: Tolerance, out_dtype: torch.dtype, mask: torch.Tensor) -> "_RowErrors":
        R = actual.shape[0]
        per_row = max(1, actual[:1].numel())
        step = max(1, COMPARE_BLOCK // per_row)
        parts = [cls._block(actual[i : i + step], expected[i : i + step],
                            None if control is None else control[i : i + step], tol, out_dtype, mask[i : i + step], i)
                 for i in range(0, R, step)] or [cls._block(actual, expected, control, tol, out_dtype, mask, 0)]  # fmt: skip
        cat = lambda k: torch.cat([getattr(p, k) for p in parts])  # noqa: E731
        firsts = [p.first_bad for p in parts if p.first_bad is not None]
        return cls(row_err=cat("row_err"), row_mag=cat("row_mag"), row_tol=cat("row_tol"), ctrl_cos=cat("ctrl_cos"),
                   row_ulp=cat("row_ulp"), row_dim=cat("row_dim"), row_cos=cat("row_cos"), bad_rows=cat("bad_rows"),
                   num=sum(p.num for p in parts), den=sum(p.den for p in parts),
                   nan_mismatch=sum(p.nan_mismatch for p in parts), first_bad=firsts[0] if firsts else None,
                   misplaced_nan=any(p.misplaced_nan for p in parts))  # fmt: skip

    @classmethod
    def _block(cls, actual, expected, control, tol: Tolerance, out_dtype: torch.dtype, mask: torch.Tensor,
               row0: int) -> "_RowErrors":  # fmt: skip
        """One block of rows (``row0`` its first), in fp64."""
        a = actual.detach().to("cpu", torch.float64)
        e = expected.detach().to("cpu", torch.float64)
        keep = mask.reshape(-1, *([1] * (a.dim() - 1)))  # [r, 1, 1]
        bad = _misplaced(a, e) & keep  # [r, H, Dv]
        finite = torch.isfinite(a) & torch.isfinite(e)
        err = torch.where(finite, (a - e).abs(), torch.zeros_like(a))  # [r, H, Dv]
        row_err, row_dim = err.max(dim=-1) if err.shape[-1] else (err.amax(dim=-1), err.sum(-1).long())  # [r, H]
        row_mag = torch.where(finite, e.abs(), torch.zeros_like(e)).amax(dim=-1)  # [r, H]
        if control is not None:
            c = control.detach().to("cpu", torch.float64)
            ctrl_err = torch.where(finite & torch.isfinite(c), (c - e).abs(), torch.zeros_like(c)).amax(-1)
            ctrl_cos = cos_diff(torch.where(finite, c, 0), torch.where(finite, e, 0), dim=-1)  # [r, H]
        else:
            ctrl_err = torch.zeros_like(row_err)
            ctrl_cos = torch.zeros_like(row_err)
        row_tol = tol.k * ctrl_err + tol.ulps * ulp(out_dtype, row_mag)  # [r, H]
        row_ulp = torch.where(finite, err / ulp(out_dtype, e), torch.zeros_like(err)).amax(-1)  # [r, H]
        am, em = torch.where(finite & keep, a, 0), torch.where(finite & keep, e, 0)
        row_cos = torch.where(mask.reshape(-1, *([1] * (row_err.dim() - 1))), cos_diff(am, em, dim=-1),
                              torch.zeros_like(row_err))  # fmt: skip
        n = int(bad.sum())
        first = None
        if n:
            idx = tuple(int(i) for i in torch.nonzero(bad)[0])
            first = (row0 + idx[0], *idx[1:], a[idx].item(), e[idx].item())
        return cls(row_err=row_err, row_mag=row_mag, row_tol=row_tol, ctrl_cos=ctrl_cos, row_ulp=row_ulp, row_dim=row_dim,
                   row_cos=row_cos, bad_rows=bad.any(-1), num=float(2 * (am * em).sum()), den=float((am * am + em * em).sum()),
                   nan_mismatch=n, first_bad=first, misplaced_nan=bool((a[bad] - e[bad]).isnan().any()) if n else False)  # fmt: skip


def same_nonfinite(a: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """Where both are NaN or both the same signed Inf: the output's placement rule, which the lse
    and the split lse follow too (NaN vs NaN and -inf vs -inf judged alike: as agreeing values)."""
    return (torch.isnan(a) & torch.isnan(e)) | (torch.isinf(a) & (a == e))


def _misplaced(a: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """Elements where NaN / signed Inf differ."""
    same_nan = torch.isnan(a) == torch.isnan(e)
    same_inf = torch.isinf(a) == torch.isinf(e)
    same_inf &= ~torch.isinf(a) | (torch.sign(a) == torch.sign(e))
    return ~(same_nan & same_inf)


def _nan_inf_reason(rows: _RowErrors, mask: torch.Tensor, req: torch.Tensor) -> Optional[str]:
    """The reason naming the misplaced NaN / Inf, if any."""
    n = rows.nan_mismatch
    if not n:
        return None
    r, h, d, a, e = rows.first_bad
    H = rows.bad_rows.shape[1] if rows.bad_rows.dim() > 1 else 1
    where = f"{int(rows.bad_rows.sum())} of {int(mask.sum()) * H} (request, head) rows"
    return (f"NaN/Inf placement differs at {n} elements ({where}), first request {int(req[r])} "
            f"head {h} dim {d}: {a:.6g} vs expected {e:.6g}")  # fmt: skip


def _rows_over_allowance(rows: _RowErrors, mask: torch.Tensor, req: torch.Tensor) -> tuple[int, Optional[str]]:
    """How many compared (row, head) rows exceed their allowance, and the reason naming the worst."""
    H = rows.row_err.shape[1]
    failed_rows = int(((rows.row_err > rows.row_tol) & mask[:, None]).sum())
    if not failed_rows:
        return 0, None
    ratio = torch.where(mask[:, None], rows.row_err / rows.row_tol, torch.zeros_like(rows.row_err))
    r, h = divmod(int(ratio.argmax()), H)
    return failed_rows, (
        f"{failed_rows} of {int(mask.sum()) * H} (request, head) rows exceed k*control+ulp, "
        f"worst request {int(req[r])} head {h}: err {rows.row_err[r, h].item():.3g} > allowed {rows.row_tol[r, h].item():.3g}"
    )


def _cosine(
    rows: _RowErrors, mask: torch.Tensor, req: torch.Tensor, tol: Tolerance, failed_rows: int,
) -> tuple[float, torch.Tensor, list[str], torch.Tensor]:
    """(cosine difference of the whole output, per row [R, H], reasons, rows over their ceiling
    [R, H]). A row's cosine is reported only when no row already failed on its error."""
    H = rows.row_err.shape[1]
    whole_cos = 1 - rows.num / max(rows.den, 1e-300) if rows.den > 0 else 0.0
    row_cos = rows.row_cos  # [R, H]
    # cosine difference grows with the square of the error: k times the control's error is k**2 its cos
    ctrl_cos = rows.ctrl_cos
    row_cos_tol = torch.clamp(tol.k**2 * ctrl_cos, min=tol.cos)
    whole_cos_tol = max(tol.cos, tol.k**2 * float(ctrl_cos.max()) if ctrl_cos.numel() else 0.0)
    reasons = []
    if whole_cos > whole_cos_tol:
        reasons.append(f"cosine difference {whole_cos:.3g} over the whole output > {whole_cos_tol:.3g}")
    if bool((row_cos > row_cos_tol).any()) and not failed_rows:
        r, h = divmod(int((row_cos / row_cos_tol).argmax()), H)
        reasons.append(
            f"cosine difference {row_cos[r, h].item():.3g} on request {int(req[r])} head {h} > {row_cos_tol[r, h].item():.3g}"
        )
    return whole_cos, row_cos, reasons, row_cos > row_cos_tol


def _worst_row(
    a: torch.Tensor, e: torch.Tensor, rows: _RowErrors, mask: torch.Tensor, req: torch.Tensor, misplaced: bool,
) -> Worst:
    """The worst (row, head): the first misplaced NaN / Inf, else the highest error relative to its
    allowance; with its worst element (read from ``a`` / ``e`` as given)."""
    R, H = a.shape[0], a.shape[1]
    ratio = torch.where(mask[:, None], rows.row_err / rows.row_tol, torch.full_like(rows.row_err, -1.0))
    if misplaced:
        r, h = rows.first_bad[:2]
    else:
        r, h = divmod(int(ratio.argmax()), H) if ratio.numel() else (0, 0)
    if not R or not H:  # no query row or no head: an empty output, nothing to point at
        return Worst.of(request=None, head=None if not H else h, row=r, dim=0)
    d = int(rows.row_dim[r, h]) if a.shape[-1] else 0
    return Worst.of(request=int(req[r]), head=h, row=r, dim=d, actual=_num(a[r, h, d].double()), expected=_num(e[r, h, d].double()),
                    err=_num(rows.row_err[r, h]), allowed=_num(rows.row_tol[r, h]), ratio=_num(ratio[r, h]))  # fmt: skip


@dataclass
class LseJudgement:
    """An lse judged value by value (:func:`judge_lse`)."""

    bad: torch.Tensor  # [...] bool: off by more than allowed, or NaN / an Inf the reference does not have
    err: torch.Tensor  # [...] fp64 |got - want|, 0 where both are the same infinity
    allowed: torch.Tensor  # [...] fp64

    def worst(self) -> tuple[int, ...]:
        """Index of the worst value: a non-finite error first, else the highest err / allowed."""
        ratio = torch.where(self.bad & ~torch.isfinite(self.err), torch.full_like(self.err, math.inf),
                            self.err / self.allowed)  # fmt: skip
        flat = int(ratio.nan_to_num(math.inf).argmax()) if ratio.numel() else 0
        return tuple(int(i) for i in np.unravel_index(flat, tuple(ratio.shape))) if ratio.numel() else ()  # numpy's: torch's imports sympy (0.6 s)


def judge_lse(
    got: torch.Tensor, want: torch.Tensor, control: Optional[torch.Tensor] = None, k: float = 0.0,
    floor: Optional[torch.Tensor] = None,
) -> LseJudgement:  # fmt: skip
    """The one lse rule (docs/contract.md section 5): |got - want| <= k * |control - want| + floor,
    floor 1e-5 * (1 + |want|) unless given; non-finite values follow the output's rule
    (:func:`same_nonfinite`: NaN against NaN and the same infinity on both sides, an empty row's
    -inf, agree; a NaN or Inf against anything else fails; issue 22). Used by the replay's lse
    check, the split partials' lse and the goldens' self-check (floor: one fp32 ulp, k 0)."""
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    err = (got - want).abs()
    err = torch.where(same_nonfinite(got, want), torch.zeros_like(err), err)
    if floor is None:
        floor = 1e-5 * (1 + want.abs().nan_to_num(0.0))
    allowed = floor
    if control is not None:
        allowed = k * (control.detach().double().cpu() - want).abs().nan_to_num(0.0) + floor
    return LseJudgement(bad=~(err <= allowed), err=err, allowed=allowed)


def _num(x: torch.Tensor) -> Optional[float]:
    v = float(x)
    return v if math.isfinite(v) else None  # JSON has no NaN / Inf


def _shape_failure(name: str, a: torch.Tensor, e: torch.Tensor) -> Comparison:
    return Comparison(
        name=name, passed=False, max_abs_err=math.inf, max_rel_err=math.inf, max_ulp_err=math.inf,
        cos_diff=math.inf, worst_row_cos_diff=math.inf, worst=Worst.of(request=None, head=None),
        reasons=[f"shape {list(a.shape)} != expected {list(e.shape)}"],
    )  # fmt: skip

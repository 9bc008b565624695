"""Checking a backend against a golden file: the verdict ``refmla replay`` would give, against the stored reference.

    golden file + backend name --check--> GoldenResult (replay's comparator and split check)

``reference`` is the self-check: this machine's fp64 reference must round to the stored fp32 values.
"""

from __future__ import annotations

import dataclasses
import math
import shlex
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

import torch

from refmla import reference as ref
from refmla.backends import is_sparse_kernel
from refmla.capture import Capture, read_capture
from refmla.compare import Tolerance, compare, judge_lse, ulp
from refmla.context import ReplayContext, ReplayOptions
from refmla.golden.determinism import nan_filled
from refmla.golden.result import GoldenResult
from refmla.pipeline import run_backend
from refmla.results import BackendEntry

CHECK_BACKENDS = ("reference", "triton", "aiter", "extend", "triton_decode_per_query", "aiter_decode_per_query")
VERIFY_PATHS = ("triton_decode_per_query", "aiter_decode_per_query")  # the plain decode of a verify capture
DECODE_ONLY = ("triton",)  # SGLang's decode kernel: one query token per request


def backend_applies(backend: str, mode: str) -> bool:
    """Whether a golden of ``mode`` is a case for ``backend`` at all (the kernel-regression suite
    pairs only these): the per-query plain-decode paths exist for verify captures only, SGLang's
    Triton decode kernel for decode captures only (a verify capture is its per-query path's case)."""
    if backend in VERIFY_PATHS:
        return mode == "verify"
    if is_sparse_kernel(backend):  # a sparse top-k kernel outside refmla: the sparse goldens are its cases
        return False
    return not (backend in DECODE_ONLY and mode == "verify")
STORED = ("out", "lse", "attn_logits", "attn_lse")  # the reference a golden file holds
STORED_BY_MODE = {"verify": ("out", "lse")}  # modes whose files hold less (no split schedule)

PathLike = Union[str, Path]


@dataclass(frozen=True)
class GoldenHeader:
    """Who a golden file is, from its meta["golden"]."""

    case: str
    why: str
    pool_base_row: int  # > 0: the check moves the pool to rows base.. of a NaN pool

    @classmethod
    def of(cls, golden: dict[str, Any], path: PathLike) -> "GoldenHeader":
        return cls(golden.get("case", Path(path).stem), golden.get("why", ""), int(golden.get("pool_base_row", 0)))


class GoldenContext(ReplayContext):
    """A replay context whose reference is the golden file's, not a fresh computation.

    ``recomputed`` keeps this machine's fp64 reference for the reference self-check. The stored
    per-split reference serves the split check whenever a backend follows the stored schedule.
    """

    def __init__(self, cap: Capture, opts: ReplayOptions, stored: dict[str, torch.Tensor]):
        super().__init__(cap, opts)
        self.recomputed = (self.ref_out, self.ref_lse)
        self.stored = stored
        self.ref_out, self.ref_lse = stored["out"].double(), stored["lse"].double()

    def split_reference(self, num_kv_splits: torch.Tensor, S: int, control: bool = False, arith=None):
        logits, lses = self.stored["attn_logits"], self.stored["attn_lse"]
        S0 = logits.shape[2]
        other = arith is not None and arith.split_block != self.cap.split_block  # another kernel's schedule
        if control or other or S < S0 or not torch.equal(num_kv_splits.cpu().long(), self.cap.num_kv_splits.long()):
            return super().split_reference(num_kv_splits, S, control, arith)
        B, H, _, Dv = logits.shape
        parts = torch.zeros(B, H, S, Dv, dtype=torch.float64)
        lse = torch.full((B, H, S), -math.inf, dtype=torch.float64)
        parts[:, :, :S0] = logits.double() * self.cap.meta.v_scale  # replay compares partials with v_scale
        lse[:, :, :S0] = lses.double()
        valid = torch.zeros(B, S, dtype=torch.bool)
        valid[:, :S0] = torch.isfinite(lses[:, 0, :]) if H else False
        return parts, lse, valid


def replay_command(path: PathLike, backend: str, pool_base_row: int = 0) -> str:
    """The command that reproduces a check; a pool_base_row case needs the harness, not replay."""
    p = Path(path)
    try:
        shown = shlex.quote(str(p.resolve().relative_to(Path.cwd())))
    except ValueError:
        shown = shlex.quote(str(p))
    if pool_base_row:
        return (f"python -m refmla.golden check {shown} --backend {backend}  (refmla replay runs the "
                f"compact pool; this puts it at row {pool_base_row})")  # fmt: skip
    return f"refmla replay {shown} --backend {backend}"


def inputs_only(cap: Capture) -> Capture:
    """The capture a production kernel would have been given: the stored reference removed."""
    return dataclasses.replace(cap, out=None, lse=None, attn_logits=None, attn_lse=None, warnings=[])


def materialize_pool(cap: Capture, base_row: int) -> Capture:
    """The capture with its pool moved to rows [base_row, base_row + N) of a NaN pool (int64 indices)."""
    N, _, D = cap.kv_buffer.shape
    pool = nan_filled((base_row + N, 1, D), cap.kv_buffer.dtype)
    pool[base_row:] = cap.kv_buffer
    return dataclasses.replace(cap, kv_buffer=pool, kv_indices=cap.kv_indices.long() + base_row)


def check(path: PathLike, backend: str, *, tol: Tolerance = Tolerance(), device: Optional[str] = None) -> GoldenResult:
    """Run ``backend`` on a golden file's inputs and compare with its stored reference.

    ``reference`` is the self-check: this machine's fp64 reference, out / lse / split partials,
    must round to the stored fp32 values (one fp32 ulp at the row's magnitude). Other backends run
    through :func:`refmla.pipeline.run_backend` against the stored reference, with the control
    recomputed for the tolerance, so the verdict is the one ``refmla replay`` gives; a backend that
    returns split partials (triton) must match the stored per-split reference too. Never raises
    for a backend's failure: a crash is status ``error``, an unusable backend ``skipped``.
    """
    t0 = time.perf_counter()
    cap = read_capture(path)
    head = GoldenHeader.of(cap.meta.extra.get("golden") or {}, path)
    stored = {k: getattr(cap, k) for k in STORED_BY_MODE.get(cap.meta.mode, STORED)}
    missing = [k for k, v in stored.items() if v is None]
    if missing:
        return GoldenResult.error(head.case, backend, f"{path}: not a golden file (no {', '.join(missing)})")
    # trim=False: the production buffer width (max_kv_splits); its strides are part of the test
    opts = ReplayOptions(backends=[backend], tol=tol, device=device, trim=False)
    opts.check()  # the bounds every command that replays checks (refmla.options)
    inputs = inputs_only(cap)
    if head.pool_base_row and backend != "reference":
        inputs = materialize_pool(inputs, head.pool_base_row)
    ctx = GoldenContext(inputs, opts, stored)
    entry = self_check(ctx, tol) if backend == "reference" else backend_check(backend, ctx)
    return GoldenResult(head.case, backend, entry, head.why, replay_command(path, backend, head.pool_base_row),
                        time.perf_counter() - t0)  # fmt: skip


def backend_check(backend: str, ctx: GoldenContext) -> BackendEntry:
    """replay's entry for ``backend``; an output that passes with failing split partials fails."""
    entry = run_backend(backend, ctx)
    if entry.status == "pass" and entry.splits is not None and entry.splits.status == "fail":
        entry.status = "fail"
        entry.reason = "the output passes but its stage-1 split partials do not (splits below)"
    return entry


def self_check(ctx: GoldenContext, tol: Tolerance) -> BackendEntry:
    """This machine's fp64 reference against the stored one: out, lse and every split partial."""
    cap, s = ctx.cap, ctx.stored
    f32, one_ulp = torch.float32, dataclasses.replace(tol, k=0.0, ulps=1.0)
    cmp = compare("reference", s["out"], ctx.recomputed[0], out_dtype=f32, tol=one_ulp)
    if "attn_logits" not in s:  # verify: out and lse only
        reasons = list(cmp.reasons) + lse_reasons("lse", s["lse"], ctx.recomputed[1])
        return BackendEntry("fail" if reasons else "pass", reason="; ".join(reasons) or None, comparison=cmp,
                            max_abs_err=cmp.max_abs_err, cos_diff=cmp.cos_diff, worst=cmp.worst,
                            info={"what": "fp64 reference recomputed here vs the stored one"})  # fmt: skip
    S0 = s["attn_logits"].shape[2]
    parts, lses, valid = ref.mla_decode_split_ref(
        cap.q, cap.kv_buffer, cap.attended(), cap.num_kv_splits, cap.scales().but(v_scale=1.0), max_kv_splits=S0
    )
    B, H, _, Dv = parts.shape
    per_split = lambda x: x.transpose(1, 2).reshape(B * S0, H, Dv)  # noqa: E731 [B, H, S, Dv] -> [B * S, H, Dv]
    split_cmp = compare("splits", per_split(s["attn_logits"]), per_split(parts), out_dtype=f32, tol=one_ulp)
    reasons = list(cmp.reasons) + [f"split partials: {r}" for r in split_cmp.reasons]
    reasons += lse_reasons("lse", s["lse"], ctx.recomputed[1])
    reasons += lse_reasons("attn_lse", s["attn_lse"], lses)
    info = {"what": "fp64 reference recomputed here vs the stored one",
            "split_max_abs_err": split_cmp.max_abs_err, "valid_splits": int(valid.sum())}  # fmt: skip
    return BackendEntry("fail" if reasons else "pass", reason="; ".join(reasons) or None, comparison=cmp,
                        max_abs_err=cmp.max_abs_err, cos_diff=cmp.cos_diff, worst=cmp.worst, info=info)  # fmt: skip


def lse_reasons(what: str, got: torch.Tensor, want: torch.Tensor) -> list[str]:
    """Why a stored fp32 LSE does not round from this machine's fp64 one: -inf placement, more than one ulp."""
    reasons = []
    want = want.double()
    finite = torch.isfinite(want) & torch.isfinite(got)
    one_ulp = torch.where(torch.isfinite(want), ulp(torch.float32, want.nan_to_num(0.0)), torch.zeros_like(want))
    judged = judge_lse(got, want, floor=one_ulp)  # the one lse rule, k 0: within one fp32 ulp
    if bool((judged.bad & ~finite).any()):
        reasons.append(f"{what}: -inf / NaN placement differs from this machine's reference")
    off = judged.bad & finite
    if bool(off.any()):
        ratio = torch.where(off, judged.err / judged.allowed, torch.zeros_like(judged.err))
        i = int(ratio.argmax())
        err, allowed = judged.err.flatten()[i], judged.allowed.flatten()[i]
        reasons.append(f"{what}: off by {err.item():.3g} > one fp32 ulp {allowed.item():.3g}")
    return reasons

"""Replay: one capture through the backends, each compared with the fp64 reference.

    capture --read/validate--> metadata checks --> reference (fp64), control (kernel rounding)
            --> each backend: run, compare (refmla.compare), split partials, explain a failure
            --> verdict + diagnosis (refmla.diagnosis) --> report dict (CONTRACT section 3)
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch

from refmla import reference as ref
from refmla.backends import NAMES, BackendUnavailable, get_backend
from refmla.capture import Capture, CaptureError, read_capture
from refmla.context import ReplayContext, ReplayOptions
from refmla.compare import Comparison, Tolerance, compare, judged_dtype
from refmla.diagnosis import diagnose
from refmla.schedule import nonempty_splits


# --------------------------------------------------------------------------------------------


def replay_file(path: Any, opts: ReplayOptions) -> dict:
    """Replay one capture file. Never raises for bad input: returns an ``invalid`` report."""
    try:
        cap = read_capture(path)
    except CaptureError as e:
        return invalid_report(str(path), e)
    return replay_capture(cap, opts)


def invalid_report(path: str, e: CaptureError) -> dict:
    name, sentence, _ = diagnose({}, invalid=True)
    return {
        "capture": path, "verdict": "invalid", "diagnosis": name, "diagnosis_text": sentence,
        "error": str(e), "metadata": {"ok": False, "errors": [str(e)], "warnings": []}, "backends": {},
    }  # fmt: skip


def backend_names(opts: ReplayOptions) -> list[str]:
    """reference and observed always; then the named backends, or all others."""
    chosen = NAMES[2:] if opts.backends is None else [n for n in opts.backends if n not in NAMES[:2]]
    for n in chosen:
        if n not in NAMES:
            raise KeyError(f"unknown backend {n!r}; choose from {', '.join(NAMES)}")
    return ["reference", "observed", *dict.fromkeys(chosen)]


def replay_capture(cap: Capture, opts: ReplayOptions) -> dict:
    from refmla.checks import check_capture

    meta_report = check_capture(cap)
    report: dict[str, Any] = {
        "capture": cap.path,
        "verdict": None,
        "diagnosis": None,
        "metadata": meta_report,
        "mode": cap.meta.mode,
        "shape": {"requests": cap.batch_size, "rows": cap.q.shape[0], "heads": cap.num_heads,
                  "head_dim": cap.meta.head_dim, "v_head_dim": cap.meta.kv_lora_rank,
                  "q_dtype": _dt(cap.q.dtype), "kv_dtype": _dt(cap.kv_buffer.dtype),
                  "max_seq_len": int(cap.seq_lens.max()) if cap.batch_size else 0},
        "meta": cap.meta.to_json(),
        "tolerance": opts.tol.to_json(),
        "backends": {},
    }  # fmt: skip
    if not meta_report["ok"]:
        report.update(verdict="invalid", diagnosis="metadata")
        report["diagnosis_text"] = diagnose({}, invalid=True)[1]
        return report
    ctx = ReplayContext(cap, opts)
    for name in backend_names(opts):
        report["backends"][name] = run_backend(name, ctx)
    ctl = ctx.compare("control", ctx.control(cap.out_dtype))
    report["control"] = {"dtype": _dt(cap.out_dtype), "max_abs_err": ctl.max_abs_err, "cos_diff": ctl.cos_diff}
    statuses = {n: b["status"] for n, b in report["backends"].items()}
    name, sentence, about = diagnose(statuses, produced_by=cap.meta.backend)
    report["verdict"] = "diverged" if any(s in ("fail", "error") for s in statuses.values()) else "agree"
    report["diagnosis"], report["diagnosis_text"], report["diagnosis_backends"] = name, sentence, about
    return report


def run_backend(name: str, ctx: ReplayContext) -> dict:
    # every contract key is present on every backend, null where it does not apply (skipped, error)
    entry: dict[str, Any] = {"status": None, "reason": None, "max_abs_err": None, "cos_diff": None, "worst": None}
    t0 = time.perf_counter()
    if name == "reference":
        entry.update(status="pass", max_abs_err=0.0, cos_diff=0.0, worst=None,
                     info={"accum_dtype": "float64", "what": "the truth"})  # fmt: skip
        return entry
    backend = get_backend(name)
    ok, why = backend.availability()
    if not ok:
        return {**entry, "status": "skipped", "reason": why}
    try:
        res = backend.run(ctx.cap, ctx.opts)
    except BackendUnavailable as e:
        return {**entry, "status": "skipped", "reason": str(e)}
    except Exception as e:  # a kernel that crashes is a finding, not a crash of refmla
        return {**entry, "status": "error", "reason": f"{type(e).__name__}: {_first_line(e)}"}
    mask = None if res.defines_empty_rows else ~ctx.empty_rows()
    cmp = ctx.compare(name, res.out, row_mask=mask)
    entry.update(status="pass" if cmp.passed else "fail", reason=None if cmp.passed else "; ".join(cmp.reasons))
    entry.update(cmp.to_json())
    entry["info"] = {"version": why, **res.info}
    if mask is not None and not bool(mask.all()):
        entry["info"]["not_compared"] = "rows of zero-length requests (this path leaves them undefined)"
    if res.attn_logits is not None and res.attn_lse is not None and ctx.cap.is_decode:
        entry["splits"] = compare_splits(ctx, res)
    if not cmp.passed and ctx.opts.explain:
        expl = explain(ctx, res.out, cmp)
        if expl is not None:
            entry["explanation"] = expl.to_json()
    entry["seconds"] = round(time.perf_counter() - t0, 3)
    return entry


def compare_splits(ctx: ReplayContext, res) -> dict:
    """Stage-1 partials against the split reference, per valid (request, split)."""
    splits = res.num_kv_splits if res.num_kv_splits is not None else ctx.cap.num_kv_splits
    if splits is None:
        return {"status": "skipped", "reason": "no num_kv_splits to place the partials"}
    S = res.attn_logits.shape[2]  # may be trimmed to the splits that hold tokens
    lens = ctx.cap.seq_lens.tolist()
    needed = max((nonempty_splits(L, int(n)) for L, n in zip(lens, splits.tolist())), default=0)
    if needed > S:
        return {"status": "fail", "reason": f"{needed} non-empty splits but only {S} partials"}
    r_out, r_lse, valid = ctx.split_reference(splits, S)
    c_out, c_lse, _ = ctx.split_reference(splits, S, control=True)
    b_idx, s_idx = torch.nonzero(valid, as_tuple=True)  # [V] one row per non-empty split
    if len(b_idx) == 0:
        return {"status": "pass", "compared_splits": 0}
    v = ctx.cap.meta.v_scale  # kernels store partials before v_scale
    actual = (res.attn_logits.float().cpu()[b_idx, :, s_idx] * v)  # [V, H, Dv]
    # partials are fp32 but P.V ran on P rounded to the value dtype: its ulp is the unit of noise
    value_dtype = ctx.cap.kv_buffer.dtype if ctx.cap.kv_buffer.dtype.itemsize < 4 else torch.float32
    cmp = compare("splits", actual, r_out[b_idx, :, s_idx], c_out[b_idx, :, s_idx],
                  out_dtype=value_dtype, tol=ctx.opts.tol, request_of_row=b_idx)  # fmt: skip
    a_lse = res.attn_lse.double().cpu()[b_idx, :, s_idx]  # [V, H]
    lse_err = (a_lse - r_lse[b_idx, :, s_idx]).abs()
    lse_allowed = ctx.opts.tol.k * (c_lse[b_idx, :, s_idx].double() - r_lse[b_idx, :, s_idx]).abs() + 1e-5 * (
        1 + r_lse[b_idx, :, s_idx].abs()
    )
    lse_bad = ~(lse_err <= lse_allowed)
    row, head = divmod(int((cmp.row_err / cmp.row_tol).argmax()), cmp.row_err.shape[1])
    out = {
        "status": "pass" if cmp.passed and not bool(lse_bad.any()) else "fail",
        "compared_splits": len(b_idx),
        "max_abs_err": cmp.max_abs_err,
        "lse_max_abs_err": float(lse_err.max()),
        "worst": {"request": int(b_idx[row]), "head": head, "split": int(s_idx[row])},
    }
    if not cmp.passed:
        out["reason"] = "; ".join(cmp.reasons)
    elif bool(lse_bad.any()):
        r, h = (int(i) for i in torch.nonzero(lse_bad)[0])
        out["reason"] = f"lse of request {int(b_idx[r])} split {int(s_idx[r])} head {h} off by {lse_err[r, h].item():.3g}"
    return out


def explain(ctx: ReplayContext, out: torch.Tensor, cmp: Comparison) -> Optional[dict]:
    """The simplest CONTRACT section 4 hypothesis that explains a failing output, if any."""
    try:
        from refmla.hypotheses import explain_failure
    except ImportError:
        return None
    return explain_failure(ctx, out, cmp)


def worst_status(reports: list[dict]) -> int:
    """Exit code over reports: 2 invalid > 1 diverged > 0 agree."""
    code = 0
    for r in reports:
        code = max(code, {"agree": 0, "diverged": 1, "invalid": 2}.get(r.get("verdict"), 1))
    return code


def _dt(d: torch.dtype) -> str:
    return str(d).replace("torch.", "")


def _first_line(e: BaseException) -> str:
    s = str(e).strip()
    return s.splitlines()[0] if s else ""


def json_safe(x: Any) -> Any:
    """Replace NaN/Inf floats (not JSON) with None, recursively."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    return x

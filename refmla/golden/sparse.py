"""The sparse golden cases (``golden/sparse/``): DeepSeek-V4-Flash (C4, C128) and V3.2 DSA sparse
decode calls with their fp64 reference stored (``golden_out`` / ``golden_lse``), and the check the
kernel-regression suite runs on each (``tests/kernel_regression/test_sparse_golden.py``): the
reference reproduces the stored one to one fp32 ulp; a kernel stays within k x the control's error
(a sparse top-k kernel outside refmla, refmla.kernel layout ``sparse_topk``, through the one
replay's path: refmla.pipeline.run_backend with refmla.kinds.SparseKind, against the stored reference).
The same bytes on every run and every x86 machine (seeded synth, sorted header): the fp64 reference
is stored rounded to fp32 (``golden_out`` / ``golden_lse`` keep their fp64 dtype), because an fp64
reduction's last ulp differs between CPUs (BLAS kernels sum in different orders, ~1e-16) while its
fp32 rounding does not (short of a value within 1e-16 of an fp32 rounding boundary); the checks
judge at one fp32 ulp, far below every kernel's tolerance."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from refmla.atomic import make_dir
from refmla.compare import Tolerance
from refmla.golden.build import write_with_manifests
from refmla.kinds import SparseKind
from refmla.options import ReplayOptions
from refmla.pipeline import run_backend
from refmla.results import BackendEntry
from refmla.sparse.backends import BACKENDS, Unavailable, declared_arithmetic
from refmla.sparse.faults import planted_output
from refmla.sparse.format import SparseCapture, parse_sparse_meta
from refmla.sparse.validation import read_sparse, write_sparse
from refmla.sparse.presets import sparse_preset
from refmla.sparse.reference import SparseOutput, judge_lse, judge_out, sparse_control, sparse_reference
from refmla.sparse.synth import build_case

MANIFEST = "manifest.json"
SPARSE_FORMAT = "refmla.golden.sparse/1"
KERNELS = ("triton", "aiter_sparse", "tilelang")
CHECK_BACKENDS = ("reference", *KERNELS)

# name -> (preset, overrides, why)
CASES: dict[str, tuple[str, dict, str]] = {
    "dsv4-flash-c4-h8": ("deepseek-v4-flash-tp8", {}, "V4-Flash C4 layer: window + compressed cache, sink, stale tails"),
    "dsv4-flash-c128-h8-lonely": ("deepseek-v4-flash-tp8-c128", {"seq_lens": (1, 60, 300)},
                                  "V4-Flash C128 layer: a row whose compressed list is one -1 inside its length"),
    "dsv32-dsa-h16": ("deepseek-v3.2-tp8", {"seq_lens": (1, 70, 300)}, "V3.2 DSA: 656-byte layout, top-k 2048, no sink"),
}  # fmt: skip


@dataclass
class SparseGoldenResult:
    status: str  # "pass" | "FAIL" | "skipped"
    reason: str = ""
    entry: Optional[BackendEntry] = None  # the replay's entry (a kernel outside refmla)

    @property
    def passed(self) -> bool:
        return self.status == "pass"


def write_case(name: str, out_dir: Path) -> dict[str, Any]:
    preset, overrides, why = CASES[name]
    case = build_case(dataclasses.replace(sparse_preset(preset), **overrides))
    out, lse = planted_output(case)
    meta = case.meta()
    tensors = {**case.tensors(), "out": out, "lse": lse}
    ref = sparse_reference(SparseCapture(path=name, meta=parse_sparse_meta(meta), **tensors))
    path = out_dir / f"{name}.safetensors"
    stored = {"golden_out": ref.out.float().double(), "golden_lse": ref.lse.float().double()}  # reproducible (docstring)
    write_sparse(path, {**tensors, **stored}, meta)
    return {"name": name, "file": path.name, "preset": preset, "overrides": {k: list(v) for k, v in overrides.items()},
            "why": why}  # fmt: skip


def case_paths(out: Path) -> list[Path]:
    return [out / f"{name}.safetensors" for name in CASES]


def write_cases(out: Path) -> dict[str, Any]:
    """Every sparse case written to ``out``; returns their manifest (written by the caller, last)."""
    return {"format": SPARSE_FORMAT, "cases": [write_case(n, out) for n in CASES]}


def generate(out_dir: Any) -> dict[str, Any]:
    """The sparse goldens alone, written as one suite (refmla.golden.build.write_with_manifests)."""
    out = make_dir(out_dir)
    docs = write_with_manifests(case_paths(out), {out / MANIFEST: SPARSE_FORMAT}, lambda: [(out / MANIFEST, write_cases(out))])
    return docs[0][1]


def load_manifest(golden_dir: Any) -> dict[str, Any]:
    return json.loads((Path(golden_dir) / MANIFEST).read_text())


def check(path: Any, backend: str, tol: Tolerance = Tolerance()) -> SparseGoldenResult:
    cap = read_sparse(path)
    stored = SparseOutput(cap.golden_out, cap.golden_lse)
    if backend == "reference":
        ref = sparse_reference(cap)
        ulp = torch.finfo(torch.float32).eps * stored.out.abs().clamp_min(1e-30)
        off = int(((ref.out - stored.out).abs() > ulp).sum())
        same_lse = torch.allclose(ref.lse, stored.lse, rtol=float(torch.finfo(torch.float32).eps), atol=0.0)
        return SparseGoldenResult("pass" if off == 0 and same_lse else "FAIL",
                                  "" if off == 0 and same_lse else f"{off} elements off the stored reference by > 1 fp32 ulp")  # fmt: skip
    if backend not in BACKENDS:  # a sparse top-k kernel outside refmla: the one replay's path
        e = kernel_entry(cap, stored, backend, tol)
        status = {"pass": "pass", "skipped": "skipped"}.get(e.status, "FAIL")
        return SparseGoldenResult(status, "" if status == "pass" else (e.reason or e.status), e)
    try:
        got = BACKENDS[backend](cap)
    except Unavailable as e:
        return SparseGoldenResult("skipped", str(e))
    arith = declared_arithmetic(backend, cap)  # each kernel at its own declared arithmetic
    ctrl = sparse_control(cap, arith=arith)
    c = judge_out(backend, cap, got.out, stored, ctrl, tol, arith)
    lse = judge_lse(got.lse, stored, ctrl, tol) if got.lse is not None else None
    if c.passed and (lse is None or lse.status == "pass"):
        return SparseGoldenResult("pass")
    return SparseGoldenResult("FAIL", "; ".join(c.reasons + ([lse.reason] if lse and lse.reason else [])))


def kernel_entry(cap: SparseCapture, stored: SparseOutput, backend: str, tol: Tolerance) -> BackendEntry:
    """replay's entry for a sparse kernel outside refmla, judged against the golden's stored reference
    (its control, localization and explanation as replay computes them)."""
    kind = SparseKind(cap, ReplayOptions(backends=[backend], tol=tol))
    kind.ref = stored
    return run_backend(backend, kind)


__all__ = ["CASES", "CHECK_BACKENDS", "SparseGoldenResult", "check", "generate", "kernel_entry", "load_manifest"]

"""The indexer goldens (``golden/indexer/``): DeepSeek's lightning indexer calls (V3.2 fp8, V3.2 bf16,
V4 C4) frozen with the fp64 reference's top-k as their ``indices``, and the check the
kernel-regression suite runs on each (``tests/kernel_regression/test_indexer_golden.py``).

A golden file is an indexer capture (docs/contract.md, "indexer captures") whose ``indices`` are
the reference's top min(K, L) entries of each request, in ascending order, not a production
output; ``meta["golden"]`` holds the case, why, and each request's k-th best reference logit
rounded to fp32 (``kth``). So ``refmla replay FILE --backend NAME`` replays it as any indexer capture.

    reference   this machine's fp64 reference: the stored set is its exact top-k (no entry left out
                scores above an entry chosen) and each k-th best logit rounds to the stored fp32
    a kernel    its index set judged by the one set judge (refmla.indexer.judge), as replay judges it

The same bytes on every run: the inputs are the seeded synth (refmla.indexer.synth, fault none),
the indices a set (sorted), the k-th logits fp32 (an fp64 reduction's last ulp may differ between
CPUs; its fp32 rounding does not, short of a value within 1e-16 of a rounding boundary).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch

from refmla.atomic import make_dir
from refmla.compare import Tolerance
from refmla.golden.build import write_with_manifests
from refmla.golden.result import GoldenResult
from refmla.indexer.backends import BACKENDS
from refmla.indexer.io import read_indexer, write_indexer
from refmla.indexer.judge import judge_indexer
from refmla.indexer.reference import Scored, Scores, judge_request
from refmla.indexer.synth import PRESETS, synth_indexer
from refmla.options import ReplayOptions
from refmla.results import BackendEntry

MANIFEST = "manifest.json"
INDEXER_FORMAT = "refmla.golden.indexer/1"
KERNELS = tuple(BACKENDS)
CHECK_BACKENDS = ("reference", *KERNELS)

# name -> (synth preset, seed, why)
CASES: dict[str, tuple[str, int, str]] = {
    "indexer-v32-fp8-h64": ("indexer-v32", 11, "V3.2: fp8 q (scale in the weights), fp8 keys with per-token scales, slots"),
    "indexer-v32-bf16-h64": ("indexer-v32-bf16", 12, "V3.2 bf16 keys and q, no scale, positions"),
    "indexer-v4-c4-h64": ("indexer-v4-c4", 13, "V4 C4: entries = seq_len // 4, fp8, positions"),
}  # fmt: skip


def _positions_to_values(cap: Any, b: int, pos: torch.Tensor) -> torch.Tensor:
    """Request b's positions in the capture's numbering (positions, or slots of its pages)."""
    if cap.meta.indices_kind == "positions":
        return pos
    ps = cap.meta.page_size
    return cap.page_table[b].long()[pos // ps] * ps + pos % ps


def write_case(name: str, out_dir: Path) -> dict[str, Any]:
    """The case's synth call with its ``indices`` replaced by the reference's top-k (module docstring)."""
    preset, seed, why = CASES[name]
    path = out_dir / f"{name}.safetensors"
    synth_indexer(path, preset, "none", seed=seed)
    cap = read_indexer(path)
    scores = Scores(cap).fill(range(cap.q.shape[0]))
    K = cap.meta.topk
    indices = torch.full((cap.q.shape[0], K), -1, dtype=torch.int32)
    kth = []
    for b in range(cap.q.shape[0]):
        s = scores[b].logits
        E = min(K, s.numel())
        top = torch.topk(s, E)
        indices[b, :E] = torch.sort(_positions_to_values(cap, b, top.indices)).values.int()
        kth.append(float(top.values[-1].float()) if E else None)
    tensors = {k: getattr(cap, k) for k in ("q", "q_scale", "weights", "k_cache", "page_table", "seq_lens", "k_cache_pages")}
    tensors = {k: v for k, v in tensors.items() if v is not None}
    golden = {"case": name, "why": why, "preset": preset, "seed": seed, "format": INDEXER_FORMAT, "kth": kth,
              "indices": "the fp64 reference's top-k of each request (ascending), not a production output"}  # fmt: skip
    write_indexer(path, {**tensors, "indices": indices}, {**cap.meta.to_json(), "engine": "golden", "golden": golden})
    return {"name": name, "file": path.name, "preset": preset, "seed": seed, "why": why}


def case_paths(out: Path) -> list[Path]:
    return [out / f"{name}.safetensors" for name in CASES]


def write_cases(out: Path) -> dict[str, Any]:
    """Every indexer case written to ``out``; returns their manifest (written by the caller, last)."""
    return {"format": INDEXER_FORMAT, "cases": [write_case(n, out) for n in CASES]}


def generate(out_dir: Any) -> dict[str, Any]:
    """The indexer goldens alone, written as one suite (refmla.golden.build.write_with_manifests)."""
    out = make_dir(out_dir)
    docs = write_with_manifests(case_paths(out), {out / MANIFEST: INDEXER_FORMAT}, lambda: [(out / MANIFEST, write_cases(out))])
    return docs[0][1]


def load_manifest(golden_dir: Any) -> dict[str, Any]:
    return json.loads((Path(golden_dir) / MANIFEST).read_text())


def self_check(cap: Any, kth: list) -> BackendEntry:
    """This machine's fp64 reference against the stored set and k-th logits (module docstring)."""
    scores = Scores(cap).fill(range(cap.q.shape[0]))
    reasons = []
    for b in range(cap.q.shape[0]):
        exact = Scored(scores[b].logits, 0.0)  # no noise: the stored set must be the exact top-k
        v = judge_request(cap, b, cap.indices[b], exact)
        if not v.ok:
            reasons.append(f"stored set {v.text()}")
        s = scores[b].logits
        E = min(cap.meta.topk, s.numel())
        here = float(torch.topk(s, E).values[-1].float()) if E else None
        if here != (kth[b] if b < len(kth) else "missing"):
            reasons.append(f"request {b}: k-th best logit {here!r} here (fp32), {kth[b] if b < len(kth) else None!r} stored")
    return BackendEntry("fail" if reasons else "pass", reason="; ".join(reasons) or None,
                        info={"what": "fp64 reference recomputed here vs the stored top-k"})  # fmt: skip


def check(path: Any, backend: str, tol: Tolerance = Tolerance()) -> GoldenResult:
    """``backend`` on a golden file's inputs, judged as ``refmla replay`` judges it (module docstring)."""
    cap = read_indexer(path)
    golden = cap.meta.extra.get("golden") or {}
    case, why = golden.get("case", Path(path).stem), golden.get("why", "")
    replay = f"refmla replay {path} --backend {backend}"
    if "kth" not in golden:
        return GoldenResult.error(case, backend, f"{path}: not an indexer golden file (its meta has no golden kth)")
    if backend == "reference":
        return GoldenResult(case, backend, self_check(cap, golden["kth"]), why, replay)
    if backend not in BACKENDS:
        return GoldenResult(case, backend, BackendEntry("skipped", reason=f"{backend} is no indexer backend"), why, replay)
    report = judge_indexer(cap, dataclasses.replace(ReplayOptions(backends=[backend], tol=tol), explain=False))
    return GoldenResult(case, backend, report.backends[backend], why, replay)


__all__ = ["CASES", "CHECK_BACKENDS", "INDEXER_FORMAT", "MANIFEST", "check", "generate", "load_manifest", "self_check",
           "write_cases"]  # fmt: skip

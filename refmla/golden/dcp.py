"""The context-parallel goldens (``golden/dcp/<case>/``): one decode step of a DCP-2 Kimi-K2 TP8
layer as its ranks' captures (refmla.synthetic.dcp, vLLM's layout: each rank's shard on shuffled
16-row pages, NaN elsewhere), with the fp64 reference stored in place of the outputs: each rank's
``out`` / ``lse`` the reference over its shard, its ``dcp_out`` the reference over the whole context
for its heads, all rounded to fp32. ``refmla replay golden/dcp/<case>`` judges that folder as the
one call it is (its stored outputs agree).

The check of a backend: the backend runs on each rank's inputs (its shard, the gathered queries);
the ranks' outputs are combined as vLLM's ``cp_lse_ag_out_rs`` combines them (each rank's term held
in the output dtype, summed in it); the step is then judged exactly as ``refmla replay FOLDER``
judges a step (refmla.cp.replay.captures_report): each rank on its shard, the combine, the whole
context. ``reference`` is the self-check: this machine's fp64 references round to the stored ones.
The bytes are the same on every run (seeded synth, sorted header; the references stored in fp32,
as the sparse goldens' are, refmla.golden.sparse)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import shlex
import time
from pathlib import Path
from typing import Any, Optional

import torch

from refmla.atomic import make_dir
from refmla.backends.base import BackendUnavailable
from refmla.capture import CaptureError, read_capture, write_capture
from refmla.compare import Tolerance, Worst, compare
from refmla.cp.hypotheses import attend_rows
from refmla.cp.judge import shard_attention
from refmla.cp.replay import captures_report
from refmla.cp.step import captures_in, read_step
from refmla.golden.build import write_with_manifests
from refmla.golden.check import backend_applies, lse_reasons
from refmla.golden.result import GoldenResult
from refmla.isolation import enabled, run_isolated
from refmla.kinds import kind_of
from refmla.merging import LN2
from refmla.options import ReplayOptions
from refmla.results import BackendEntry
from refmla.synthetic.dcp import PRESETS, combine, step_captures
from refmla.util import error_text

MANIFEST = "manifest.json"
DCP_FORMAT = "refmla.golden.dcp/1"
GENERATOR = "refmla.golden.dcp/1"  # bump when an unchanged case would come out as different bytes

# name -> (preset, overrides, why)
CASES: dict[str, tuple[str, dict, str]] = {
    "kimi-k2-tp8-dcp2-len37-16-1-5": ("kimi-k2-tp8-dcp2", {"seq_lens": (37, 16, 1, 5)},
                                      "DCP-2 step: odd shards on 16-row pages, a request rank 1 holds none of, "
                                      "the combine (cp_lse_ag_out_rs)"),
}  # fmt: skip


def case_paths(out: Path) -> list[Path]:
    """Every file the DCP cases write under ``out`` (the folder of golden/dcp/)."""
    return [out / name / f"rank{r}.safetensors" for name, (preset, _, _) in CASES.items()
            for r in range(PRESETS[preset].world)]  # fmt: skip


def write_case(name: str, out: Path) -> dict[str, Any]:
    """The rank captures of case ``name`` in ``out/name/``; returns its manifest entry."""
    preset, overrides, why = CASES[name]
    ranks, _ = step_captures(dataclasses.replace(PRESETS[preset], **overrides), "none", seed=0)
    folder = make_dir(Path(out) / name)
    paths = [folder / f"rank{r}.safetensors" for r in range(len(ranks))]
    for path, (tensors, meta) in zip(paths, ranks):  # first as synthesized: the step the references are of
        write_capture(path, tensors, meta, compact=False)
    step = read_step(folder, [(p, read_capture(p)) for p in paths], str(folder))
    whole = whole_reference(step)
    Hr = whole.shape[1] // step.world
    golden = {"case": name, "why": why, "generator": GENERATOR, "preset": preset,
              "params": {k: list(v) for k, v in overrides.items()}}  # fmt: skip
    files = []
    for r, (path, (tensors, meta)) in enumerate(zip(paths, ranks)):
        out_r, lse_r = shard_attention(step, r, torch.float64)
        stored = {"out": out_r.float(), "lse": lse_r.float(), "dcp_out": whole[:, r * Hr : (r + 1) * Hr].float()}
        write_capture(path, {**tensors, **stored}, {**meta, "golden": golden}, compact=False)
        data = path.read_bytes()
        files.append({"file": path.name, "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)})
    return {"name": name, "folder": name, "files": files, "preset": preset, "overrides": golden["params"], "why": why}


def write_cases(out: Path) -> dict[str, Any]:
    """Every DCP case written under ``out``; returns their manifest (written by the caller, last)."""
    return {"format": DCP_FORMAT, "generator": GENERATOR, "cases": [write_case(n, out) for n in CASES]}


def generate(out_dir: Any) -> dict[str, Any]:
    """The DCP goldens alone, written as one suite (refmla.golden.build.write_with_manifests)."""
    out = make_dir(out_dir)
    manifest = out / MANIFEST
    docs = write_with_manifests(case_paths(out), {manifest: DCP_FORMAT}, lambda: [(manifest, write_cases(out))])
    return docs[0][1]


def load_manifest(golden_dir: Any) -> dict[str, Any]:
    return json.loads((Path(golden_dir) / MANIFEST).read_text())


def case_folders(golden_dir: Any) -> list[Path]:
    """The DCP case folders of a golden folder: its own DCP manifest's, else its ``dcp/``'s; []
    when it has neither."""
    for d in (Path(golden_dir), Path(golden_dir) / "dcp"):
        try:
            m = load_manifest(d)
        except (OSError, ValueError):
            continue
        if isinstance(m, dict) and m.get("format") == DCP_FORMAT:
            return [d / c["folder"] for c in m.get("cases", [])]
    return []


def is_case(folder: Any) -> bool:
    """Whether ``folder`` is one DCP golden case (rank captures whose meta says a golden DCP step)."""
    try:
        first = captures_in(folder)[0]
        meta = read_capture(first).meta
    except (CaptureError, OSError, IndexError):
        return False
    return meta.dcp_world_size is not None and bool(meta.extra.get("golden"))


def applies(backend: str) -> bool:
    """A DCP step is decode: the verify-only per-query paths are no case for it."""
    return backend_applies(backend, "decode")


def whole_reference(step) -> torch.Tensor:
    """out [B, H, Dv] fp64: attention over each request's whole context (the truth the combine meets)."""
    cap, sc = step.any, step.any.scales()
    return torch.cat([attend_rows(cap.q[b], step.whole(b), sc, torch.float64)[0] for b in range(cap.q.shape[0])])


def check(folder: Any, backend: str, *, tol: Tolerance = Tolerance(), device: Optional[str] = None) -> GoldenResult:
    """``backend`` on every rank of the DCP golden in ``folder``, its outputs combined and judged as
    ``refmla replay FOLDER`` judges a step; ``reference``: the self-check. Never raises for a
    backend's failure (``error``) or absence (``skipped``)."""
    t0 = time.perf_counter()
    folder = Path(folder)
    command = f"refmla golden check {shlex.quote(str(folder))} --backend {backend}"
    try:
        caps = [(f, read_capture(f)) for f in captures_in(folder)]
    except CaptureError as e:
        return GoldenResult.error(folder.name, backend, str(e), replay=command)
    head = caps[0][1].meta.extra.get("golden") or {}
    if backend == "reference":
        entry = self_check(folder, caps, tol)
    else:
        entry = backend_check(folder, caps, backend, tol, device)
    return GoldenResult(head.get("case", folder.name), backend, entry, head.get("why", ""), command,
                        time.perf_counter() - t0)  # fmt: skip


def self_check(folder: Path, caps: list, tol: Tolerance) -> BackendEntry:
    """The stored step replays clean, and this machine's fp64 references (each rank's shard, the
    whole context) round to the stored fp32 ones (one fp32 ulp)."""
    one_ulp, f32 = dataclasses.replace(tol, k=0.0, ulps=1.0), torch.float32
    report = captures_report(str(folder), caps, tol)
    said = report.diagnosis_text or report.error
    reasons = [] if report.verdict == "agree" else [f"the stored step replays {report.verdict}: {said}"]
    if report.verdict == "invalid":
        return BackendEntry("error", reason=reasons[0])
    step = read_step(folder, caps, str(folder))
    whole = whole_reference(step)
    Hr = whole.shape[1] // step.world
    compared = []
    for r, cap in sorted(step.ranks.items()):
        want, want_lse = shard_attention(step, r, torch.float64)
        c = compare(f"rank {r}", cap.out, want, out_dtype=f32, tol=one_ulp)
        w = compare(f"combine on rank {r}", cap.dcp_out, whole[:, r * Hr : (r + 1) * Hr], out_dtype=f32, tol=one_ulp)
        reasons += [f"rank {r} out: {x}" for x in c.reasons]
        reasons += [f"combine on rank {r} (dcp_out): {x}" for x in w.reasons]
        reasons += lse_reasons(f"rank {r} lse", cap.lse, want_lse)
        compared += [c, w]
    worst = next((c for c in compared if not c.passed), compared[0])  # the first failing comparison
    return BackendEntry("fail" if reasons else "pass", reason="; ".join(reasons) or None, comparison=worst,
                        max_abs_err=worst.max_abs_err, cos_diff=worst.cos_diff, worst=worst.worst,
                        info={"what": "fp64 references recomputed here vs the stored ones"})  # fmt: skip


def run_rank(name: str, cap, opts: ReplayOptions) -> tuple[Optional[Any], Optional[BackendEntry]]:
    """``name`` on one rank's inputs, as run_backend runs a kernel (in a child process unless it runs
    in this one): (its BackendResult, None), or (None, the skipped / error entry)."""
    inputs = dataclasses.replace(cap, out=None, lse=None, dcp_out=None, dcp_in_out=None, dcp_in_lse=None, warnings=[])
    kind = kind_of(inputs, opts)
    if name not in kind.backend_names():
        return None, BackendEntry("skipped", reason="not a backend of a DCP rank's decode capture")
    backend = kind.backend(name)
    ok, why = backend.availability()
    if not ok:
        return None, BackendEntry("skipped", reason=why)
    try:
        if enabled(opts.isolate) and not backend.in_process:
            return run_isolated(backend.run, inputs, opts, wall_s=opts.kernel_seconds), None
        return backend.run(inputs, opts), None
    except BackendUnavailable as e:
        return None, BackendEntry("skipped", reason=str(e))
    except Exception as e:  # a kernel that crashes is a finding (KernelCrashed / KernelError included)
        return None, BackendEntry("error", reason=f"rank {cap.meta.dcp_rank}: {error_text(e)}")


def rank_lse(res, cap) -> Optional[torch.Tensor]:
    """[B, H] fp32 natural lse of a rank's result: the kernel's own, or its split lses merged (SGLang's
    Triton decode: stage 2's e_max + log(e_sum) over the splits it wrote); -inf where the rank holds
    no position of the request (the combine masks those terms). None: the kernel returns neither."""
    if res.lse is not None:
        lse = res.lse.detach().cpu().double()
        lse = lse * LN2 if res.arithmetic is not None and res.arithmetic.lse_base == "log2" else lse
    elif res.attn_lse is not None:
        parts = res.attn_lse.detach().cpu().double()
        splits = res.num_kv_splits if res.num_kv_splits is not None else cap.num_kv_splits
        used = torch.arange(parts.shape[-1])[None, :] < splits.cpu().long()[:, None]  # [B, S]
        parts = torch.where(used[:, None, :] & torch.isfinite(parts), parts, -math.inf)
        lse = torch.logsumexp(parts, dim=-1)
    else:
        return None
    empty = (cap.seq_lens.cpu() == 0)[:, None]
    return torch.where(empty, -math.inf, lse).float()


def backend_check(folder: Path, caps: list, name: str, tol: Tolerance, device: Optional[str]) -> BackendEntry:
    # a DCP rank's capture holds no split schedule: SGLang's rule, the buffer trimmed to the splits used
    opts = ReplayOptions(backends=[name], tol=tol, device=device)
    opts.check()
    results = []
    for _, cap in caps:
        res, entry = run_rank(name, cap, opts)
        if entry is not None:
            return entry
        lse = rank_lse(res, cap)
        if lse is None:
            why = "returns no lse (nor split lses): a DCP combine cannot weigh its partial"
            return BackendEntry("skipped", reason=why)
        results.append((res.out.detach().cpu(), lse))
    merged = combine([o for o, _ in results], [l for _, l in results])  # vLLM's cp_lse_ag_out_rs
    Hr = merged.shape[1] // len(results)
    judged = [(path, dataclasses.replace(cap, out=o, lse=l, dcp_out=merged[:, r * Hr : (r + 1) * Hr], dcp_in_out=None,
                                         dcp_in_lse=None))
              for r, ((path, cap), (o, l)) in enumerate(zip(caps, results))]  # fmt: skip
    return step_entry(captures_report(str(folder), judged, tol))


def step_entry(report) -> BackendEntry:
    """The judged step as the backend's one entry: pass when the step agrees; else each failing row
    (rank R, combine) with its reasons, the diagnosis, the worst element of the first failing row."""
    if report.verdict == "invalid":
        return BackendEntry("error", reason=report.error)
    rows = {n: b for n, b in report.backends.items() if n != "reference"}
    failing = [(n, b) for n, b in rows.items() if b.status == "fail"]
    info = {"context_parallel": report.kind_keys.get("context_parallel"),
            "rows": {n: b.status for n, b in rows.items()}}  # fmt: skip
    if report.verdict == "agree":
        errs = [b.max_abs_err for b in rows.values() if b.max_abs_err is not None]
        return BackendEntry("pass", max_abs_err=max(errs, default=0.0), info=info)
    reasons = []
    for n, b in failing:
        c, bad = (b.info or {}).get("comparison") or {}, (b.info or {}).get("lse_bad")
        said = [f"{n}: {x}" for x in c.get("reasons") or []]
        said += [f"{n}: {bad} (request, head) lse values off"] if bad else []
        reasons += said or [f"{n}: {b.reason or 'fail'}"]
    reasons.append(report.diagnosis_text)
    first = failing[0][1] if failing else None
    c = ((first.info or {}).get("comparison") or {}) if first else {}
    return BackendEntry("fail", reason="; ".join(r for r in reasons if r), max_abs_err=c.get("max_abs_err"),
                        cos_diff=c.get("cos_diff"), worst=Worst.from_json(c.get("worst")),
                        explanation=first.explanation if first else None, info=info)  # fmt: skip


__all__ = ["CASES", "DCP_FORMAT", "GENERATOR", "MANIFEST", "applies", "case_folders", "case_paths", "check", "generate",
           "is_case", "load_manifest", "write_cases"]  # fmt: skip

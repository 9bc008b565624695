"""Context-parallel steps inside `refmla replay`: which of the given captures are the DCP ranks of
one step (grouped by where they were given, meta ``layer_id`` and ``step``), and a step's judgment
(refmla.cp.judge) as the one ReplayReport every other kind returns (kind ``context_parallel``,
one backend row per rank and one for the combine, the step's whole document under
``context_parallel``).

A group is judged as one step when it holds two captures or more, or came from a folder; a lone
rank capture named as a file is replayed as the decode capture it is (its kernel over its shard).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional, Sequence

from refmla.capture import CaptureError, read_capture
from refmla.compare import Tolerance
from refmla.cp.judge import judge
from refmla.cp.result import CpReport
from refmla.cp.step import read_step
from refmla.diagnosis import diagnose
from refmla.results import BackendEntry, Explanation, MetadataReport, ReplayReport, Shape
from refmla.util import dtype_name, error_text

KIND = "context_parallel"
REFERENCE = BackendEntry("pass", max_abs_err=0.0, cos_diff=0.0,
                         info={"accum_dtype": "float64", "what": "the truth over the whole context"})  # fmt: skip


def dcp_key(path: Any) -> Optional[tuple]:
    """(layer_id, step) of a DCP rank capture from its header alone; None for any other file (or
    one that cannot be read: the ordinary replay reports it)."""
    from safetensors import safe_open

    try:
        if not Path(path).is_file():
            return None
        with safe_open(str(path), framework="pt", device="cpu") as f:
            meta = json.loads((f.metadata() or {}).get("meta", "{}"))
    except Exception:
        return None
    if not isinstance(meta, dict) or meta.get("dcp_world_size") is None or meta.get("mode", "decode") != "decode":
        return None
    return (_num(meta.get("layer_id")), _num(meta.get("step")))


def _num(v: Any) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) else -1


def group_steps(paths: Sequence[str], origins: Sequence[str]) -> tuple[list[str], dict[str, list[str]]]:
    """``paths`` (each with the argument it came from, ``origins``) as replay units, in the order
    given: a plain capture stays itself; DCP rank captures become one unit per (origin folder,
    layer, step), labelled ``ORIGIN`` (or ``ORIGIN (layer L, step S)`` where the origin holds
    several steps). Returns (units, {label: [rank files]})."""
    keyed: dict[tuple, list[str]] = {}
    first: dict[tuple, int] = {}
    from_dir: dict[tuple, bool] = {}
    plain: list[tuple[int, str]] = []
    for i, (p, o) in enumerate(zip(paths, origins)):
        k = dcp_key(p)
        if k is None:
            plain.append((i, p))
            continue
        origin = o if o != p else str(Path(p).parent)
        key = (origin, *k)
        keyed.setdefault(key, []).append(p)
        first.setdefault(key, i)
        from_dir[key] = o != p
    steps: dict[str, list[str]] = {}
    units = list(plain)
    per_origin: dict[str, int] = {}
    for key in keyed:
        per_origin[key[0]] = per_origin.get(key[0], 0) + 1
    for key, files in keyed.items():
        if len(files) < 2 and not from_dir[key]:
            units.append((first[key], files[0]))  # a lone rank file: the decode capture it is
            continue
        origin, layer, step = key
        label = origin if per_origin[origin] == 1 else f"{origin} (layer {layer}, step {step})"
        steps[label] = files
        units.append((first[key], label))
    return [u for _, u in sorted(units, key=lambda t: t[0])], steps


def step_report(label: str, files: Sequence[str], tol: Tolerance = Tolerance()) -> ReplayReport:
    """The step of ``files`` judged as one call, as a ReplayReport; never raises for bad input."""
    try:
        caps = [(Path(f), read_capture(f)) for f in files]
    except CaptureError as e:
        return invalid(label, str(e))
    return captures_report(label, caps, tol)


def captures_report(label: str, caps: Sequence[tuple], tol: Tolerance = Tolerance()) -> ReplayReport:
    """step_report of captures already read ([(path, Capture)]: the golden check hands a backend's
    outputs in them); never raises for bad input."""
    try:
        step = read_step(label, list(caps), label)
        cp = judge(step, tol)
    except CaptureError as e:
        return invalid(label, str(e))
    report = as_replay_report(cp, step.any.meta, tol)
    cap = step.any
    D, Dv = int(cap.q.shape[-1]), int(cap.meta.kv_lora_rank)
    report.shape = Shape(int(cap.q.shape[0]), int(cap.q.shape[0]), int(cap.q.shape[1]), D, Dv, dtype_name(cap.q.dtype),
                         dtype_name(cap.kv_buffer.dtype), int(step.total.max()) if step.total.numel() else 0,
                         {"dcp_world_size": step.world, "dcp_interleave_size": step.interleave})  # fmt: skip
    return report


def invalid(label: str, error: str) -> ReplayReport:
    d = diagnose({}, invalid=True)
    return ReplayReport(capture=label, verdict="invalid", diagnosis=d.name, diagnosis_text=d.text, error=error,
                        metadata=MetadataReport.invalid(error), kind=KIND)  # fmt: skip


def as_replay_report(cp: CpReport, meta: Any, tol: Tolerance) -> ReplayReport:
    """A judged step as the shared report: ``reference``, ``rank R`` (its partial on its shard) and
    ``combine`` rows; the findings as the rows' explanations and the diagnosis sentence."""
    if cp.verdict == "invalid":
        return invalid(cp.folder, cp.error or "invalid")
    backends = {"reference": REFERENCE}
    for e in cp.ranks:
        backends[f"rank {e.rank}"] = _entry(e.status, e.comparison, e.note, {"capture": e.path, "lse_bad": e.lse_bad})
    if cp.combine is not None:
        backends["combine"] = _entry(cp.combine.status, cp.combine.comparison, cp.combine.note, {})
    for f in cp.findings:  # each finding explains its rank's row (the combine's for a combine mistake)
        name = "combine" if f.hypothesis == "cp_combine_lse_base" or "combined_on" in f.detail else f"rank {f.rank}"
        entry = backends.get(name)
        if entry is not None and entry.explanation is None and entry.status in ("fail", "skipped"):
            entry.explanation = Explanation(f.hypothesis, f.request, {"rank": f.rank, "positions": f.positions[:8]},
                                            max_abs_err=0.0, extra={"text": f.text})  # fmt: skip
    report = ReplayReport(capture=cp.folder, verdict=cp.verdict, diagnosis=None, mode="decode", meta=meta,
                          backends=backends, tolerance=tol, kind=KIND, kind_keys={KIND: cp.to_json()},
                          diagnosis_backends=[n for n, b in backends.items() if b.status == "fail"],
                          series=[])  # fmt: skip  (a step of ranks is no series of its own)
    shape = f"DCP {cp.world} ranks, interleave {cp.interleave}, {cp.requests} requests"
    if cp.verdict == "agree":
        report.diagnosis_text = f"every rank agrees on its shard and the combine with the whole-context reference ({shape})"
    else:
        report.diagnosis = KIND
        said = "; ".join(f"{f.hypothesis}: {f.text}" for f in cp.findings) or "no context-parallel mistake reproduces it"
        report.diagnosis_text = f"the context-parallel step diverges ({shape}): {said}"
    return report


def _entry(status: str, comparison: Optional[dict], note: str, info: dict) -> BackendEntry:
    """A rank's or the combine's row: pass / fail as judged; absent / unjudged as ``skipped``."""
    c = comparison or {}
    st = status if status in ("pass", "fail") else "skipped"
    return BackendEntry(st, reason=note or (None if st != "skipped" else status), max_abs_err=c.get("max_abs_err"),
                        cos_diff=c.get("cos_diff"), info={**info, "comparison": comparison})  # fmt: skip


def replay_step_files(label: str, files: Sequence[str], opts: Any = None) -> ReplayReport:
    """step_report with a ReplayOptions' tolerance; a crash of refmla itself is the step's ``invalid``."""
    try:
        return step_report(label, files, getattr(opts, "tol", None) or Tolerance())
    except Exception as e:
        return invalid(label, f"{label}: replay: {error_text(e)}")


__all__ = ["KIND", "as_replay_report", "captures_report", "dcp_key", "group_steps", "replay_step_files", "step_report"]

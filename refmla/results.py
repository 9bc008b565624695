"""Typed results: what a check, a hypothesis, a backend and a replay report produce.

Built once where the work is done, read by attribute where they are rendered, turned into the
JSON of docs/contract.md by ``to_json`` (the only place the JSON keys are spelled). Keys are only
ever added; a ``None`` contract key stays in the JSON as null.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from refmla.capture import CaptureMeta
from refmla.compare import Comparison, Tolerance, Worst
from refmla.util import present

# --------------------------------------------------------------------------------------------
# Findings of the metadata and series checks
# --------------------------------------------------------------------------------------------

SEVERITIES = ("error", "warning", "note")


@dataclass
class Finding:
    """One fact a check established: errors make a capture invalid, warnings are suspicious, notes inform."""

    check: str  # the check's name, e.g. "zero_rows", "seq_len_step"
    severity: str  # "error" | "warning" | "note"
    message: str  # one line for people
    request: Optional[int] = None  # the request it is about (index in its capture)
    rid: Optional[str] = None
    numbers: dict[str, Any] = field(default_factory=dict)  # check-specific numbers (count, first_position, ...)

    def to_json(self) -> dict:
        return {"check": self.check, "severity": self.severity, "request": self.request, "rid": self.rid,
                **self.numbers, "message": self.message}  # fmt: skip


@dataclass
class MetadataReport:
    """The metadata checks of one capture: ``errors`` / ``warnings`` one line each, ``findings`` typed."""

    ok: bool
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)

    @classmethod
    def invalid(cls, reason: str) -> "MetadataReport":
        return cls(ok=False, errors=[reason])

    def to_json(self) -> dict:
        return {"ok": self.ok, "errors": list(self.errors), "warnings": list(self.warnings),
                "findings": [f.to_json() for f in self.findings]}  # fmt: skip


# --------------------------------------------------------------------------------------------
# A failing backend's explanation, and the split check
# --------------------------------------------------------------------------------------------


@dataclass
class Alternative:
    """Another setting that also brings the output back to rounding noise: the report names the
    simplest, and lists these so nobody chases a detail the data cannot tell apart."""

    hypothesis: str
    detail: dict[str, Any]
    request: Optional[int] = None  # the request it explains (per-request hypotheses)
    residual_ratio: Optional[float] = None  # worst (row, head) error / allowed under it

    def to_json(self) -> dict:
        return {"hypothesis": self.hypothesis, "detail": self.detail,
                **present(request=self.request, residual_ratio=self.residual_ratio)}


@dataclass
class Explanation:
    """The simplest hypothesis that brings a failing output back to rounding noise (contract section 4)."""

    hypothesis: str  # e.g. "seq_len_off_by"
    request: Optional[int]  # the worst request it explains (None: not request-specific)
    detail: dict[str, Any]  # the hypothesis' parameters, e.g. {"delta": -1}
    max_abs_err: float  # the output's error against the reference recomputed under the hypothesis
    residual_ratio: float = 0.0  # worst (row, head) error / allowed under the hypothesis
    heads: list[int] = field(default_factory=list)  # heads of the worst request that failed
    extra: dict[str, Any] = field(default_factory=dict)  # scope, other requests, notes, granularity, ...
    seconds: Optional[float] = None  # time the search took
    alternatives: list[Alternative] = field(default_factory=list)  # other settings that also confirm
    explained_requests: Optional[list[int]] = None  # per-request hypotheses: the failing requests it explains
    unexplained_requests: Optional[list[int]] = None  # ... and those it does not (a partial explanation)
    # other hypotheses that explain the same output within noise (refmla.hypotheses CROSS families)
    other_causes: list[Alternative] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        """Explains every failing request (always, for whole-output hypotheses)."""
        return not self.unexplained_requests

    def text(self) -> str:
        detail = ", ".join(f"{k}={v}" for k, v in self.detail.items())
        who = f" request {self.request}" if self.request is not None else ""
        if self.extra.get("scope") == "all requests":  # a whole-output explanation: its request is only the worst
            who = " all requests" + (f" (worst request {self.request})" if self.request is not None else "")
        line = f"explained by {self.hypothesis}({detail}){who}"
        same = [a for a in self.alternatives if a.request in (None, self.request)]
        if same:
            line += f"; {alternatives_text(self.detail, same)} also fit within noise"
        if self.unexplained_requests:
            line += f"; request(s) {', '.join(map(str, self.unexplained_requests))} not explained"
        return line

    def to_json(self) -> dict:
        d = {"hypothesis": self.hypothesis, "request": self.request, "detail": self.detail,
             "max_abs_err": self.max_abs_err, "residual_ratio": self.residual_ratio, "heads": self.heads,
             **self.extra, "alternatives": [a.to_json() for a in self.alternatives]}  # fmt: skip
        if self.explained_requests is not None:
            d["explained_requests"] = list(self.explained_requests)
            d["unexplained_requests"] = list(self.unexplained_requests or [])
        if self.seconds is not None:
            d["seconds"] = self.seconds
        if self.other_causes:
            d["other_causes"] = [a.to_json() for a in self.other_causes]
        return d


def alternatives_text(detail: dict[str, Any], alts: list[Alternative]) -> str:
    """``-2, -3`` when the details share one key with the explanation's (``delta -1; -2, -3 also
    fit``), else each alternative spelled out."""
    keys = list(detail)
    if len(keys) == 1 and all(list(a.detail) == keys for a in alts):
        return f"{keys[0]} " + ", ".join(str(a.detail[keys[0]]) for a in alts)
    return ", ".join(f"{a.hypothesis}({', '.join(f'{k}={v}' for k, v in a.detail.items())})" for a in alts)


@dataclass
class SplitCheck:
    """A kernel's stage-1 partials (each non-empty split's output and lse) against the split reference."""

    status: str  # "pass" | "fail" | "skipped"
    reason: Optional[str] = None
    compared_splits: Optional[int] = None
    max_abs_err: Optional[float] = None
    lse_max_abs_err: Optional[float] = None
    worst: Optional[Worst] = None  # request, head, split
    failed_requests: Optional[list[int]] = None  # requests with a failing (split, head) partial or lse

    def to_json(self) -> dict:
        return {k: (v.to_json() if isinstance(v, Worst) else v) for k, v in self.__dict__.items() if v is not None}


@dataclass
class LseCheck:
    """A backend's log-sum-exp [R, H] against the reference's (the production ``lse`` for observed)."""

    status: str  # "pass" | "fail"
    reason: Optional[str] = None
    compared_rows: Optional[int] = None
    max_abs_err: Optional[float] = None
    worst: Optional[Worst] = None  # row, request, head, actual, expected
    failed_requests: Optional[list[int]] = None  # requests with a failing (row, head) lse

    def to_json(self) -> dict:
        return {k: (v.to_json() if isinstance(v, Worst) else v) for k, v in self.__dict__.items() if v is not None}


# --------------------------------------------------------------------------------------------
# One backend's entry, one capture's report
# --------------------------------------------------------------------------------------------


@dataclass
class BackendEntry:
    """One backend of one replay. Every contract key is in the JSON, null where it does not apply."""

    status: str  # "pass" | "fail" | "skipped" | "error"
    reason: Optional[str] = None  # why skipped / error, or the failure's reasons
    comparison: Optional[Comparison] = None  # against the fp64 reference
    max_abs_err: Optional[float] = None  # set from the comparison, or 0 for the reference itself
    cos_diff: Optional[float] = None
    worst: Optional[Worst] = None
    info: Optional[dict] = None  # versions, kernel module, split counts used, notes
    splits: Optional[SplitCheck] = None
    explanation: Optional[Explanation] = None
    seconds: Optional[float] = None
    lse: Optional[LseCheck] = None
    failed_parts: Optional[list[str]] = None  # which outputs failed: "out", "lse", "attn_logits"
    localization: Optional[Any] = None  # a failing backend: refmla.localize.Localization (to_json, text)

    def judge_parts(self) -> None:
        """A failing part (lse, split partials) fails the entry, whatever ``out`` did: set
        ``failed_parts``, and ``status`` / ``reason`` when only a part failed."""
        parts = [("out", self.status == "fail", self.reason)]
        parts += [(name, c is not None and c.status == "fail", c.reason if c is not None else None)
                  for name, c in (("lse", self.lse), ("attn_logits", self.splits))]  # fmt: skip
        failed = [name for name, bad, _ in parts if bad]
        if failed in ([], ["out"]):  # nothing beyond the output's own verdict
            return
        self.failed_parts = failed
        self.reason = "; ".join(f"{PART_NAMES[name]}: {why or 'fail'}" for name, bad, why in parts if bad)
        self.status = "fail"

    @classmethod
    def judged(cls, cmp: Comparison, info: dict) -> "BackendEntry":
        """The entry of a backend that ran and was compared."""
        return cls(status="pass" if cmp.passed else "fail", reason=None if cmp.passed else "; ".join(cmp.reasons),
                   comparison=cmp, max_abs_err=cmp.max_abs_err, cos_diff=cmp.cos_diff, worst=cmp.worst, info=info)  # fmt: skip

    @property
    def ran(self) -> bool:
        return self.status in ("pass", "fail")

    @property
    def nonfinite(self) -> int:
        """Elements of ``out`` whose NaN / Inf placement differs from the reference (0: none, or not compared)."""
        return self.comparison.nan_mismatch if self.comparison is not None else 0

    def err_text(self) -> str:
        """The max_abs_err cell: ``nan (4096 non-finite)`` for misplaced NaN / Inf, ``-`` when not compared."""
        if self.comparison is not None:
            return self.comparison.err_text()
        return "-" if self.max_abs_err is None else ("0" if self.max_abs_err == 0 else f"{self.max_abs_err:.3g}")

    def badness(self) -> tuple:
        """Orders failing backends worst last: a misplaced NaN / Inf above any finite error."""
        return (self.nonfinite > 0, self.max_abs_err if self.max_abs_err is not None else 0.0)

    def to_json(self) -> dict:
        d: dict[str, Any] = {"status": self.status, "reason": self.reason, "max_abs_err": self.max_abs_err,
                             "cos_diff": self.cos_diff, "worst": self.worst.to_json() if self.worst is not None else None}  # fmt: skip
        if self.comparison is not None:
            d.update(self.comparison.to_json())
        if self.info is not None:
            d["info"] = self.info
        if self.splits is not None:
            d["splits"] = self.splits.to_json()
        if self.explanation is not None:
            d["explanation"] = self.explanation.to_json()
        if self.seconds is not None:
            d["seconds"] = self.seconds
        if self.lse is not None:
            d["lse"] = self.lse.to_json()
        if self.failed_parts is not None:
            d["failed_parts"] = list(self.failed_parts)
        if self.localization is not None:
            d["localization"] = self.localization.to_json()
        return d


PART_NAMES = {"out": "output", "lse": "lse", "attn_logits": "split partials"}


@dataclass
class Shape:
    requests: int
    rows: int  # rows of out: requests in decode, tokens in extend
    heads: int
    head_dim: int
    v_head_dim: int
    q_dtype: str
    kv_dtype: str
    max_seq_len: int
    dims: dict[str, Any] = field(default_factory=dict)  # a kind's own sizes (sparse: B, S, H, D, Dv, K, K_extra)

    def to_json(self) -> dict:
        return {**{k: v for k, v in self.__dict__.items() if k != "dims"}, **self.dims}


@dataclass
class NoiseFloor:
    """The low-precision control's own error against the reference: what rounding alone costs."""

    dtype: str
    max_abs_err: float
    cos_diff: float

    def to_json(self) -> dict:
        return dict(self.__dict__)


VERDICT_EXIT = {"agree": 0, "diverged": 1, "invalid": 2}


@dataclass
class ReplayReport:
    """One capture through every backend: the document ``refmla replay --json`` prints per capture."""

    capture: str
    verdict: Optional[str]  # "agree" | "diverged" | "invalid"
    diagnosis: Optional[str]  # refmla.diagnosis class, None when all agree
    diagnosis_text: str = ""
    metadata: MetadataReport = field(default_factory=lambda: MetadataReport(ok=True))
    backends: dict[str, BackendEntry] = field(default_factory=dict)
    mode: Optional[str] = None
    shape: Optional[Shape] = None
    meta: Optional[CaptureMeta] = None  # the capture's meta, typed (serialised only in to_json)
    tolerance: Optional[Tolerance] = None
    control: Optional[NoiseFloor] = None
    diagnosis_backends: Optional[list[str]] = None
    error: Optional[str] = None  # an unreadable capture: why, in one line
    series: Optional[list[Finding]] = None  # findings against the previous capture of its series
    verify_vs_decode: Optional[list[dict]] = None  # verify captures: each path over the same KV (diagnosis.verify_table)
    kind: Optional[str] = None  # "dense" | "sparse_decode" (None: a file not read far enough to tell)
    kind_keys: dict[str, Any] = field(default_factory=dict)  # keys only this kind has (sparse: noise, lonely_rows, region)
    # what tells the diagnosis's open causes apart (refmla.nextsteps.NextStep, each with to_json); None: nothing open
    next_steps: Optional[list] = None

    @property
    def exit_code(self) -> int:
        return VERDICT_EXIT.get(self.verdict or "", 1)

    def key(self) -> tuple:
        """(layer_id, tp_rank, step) from the meta, None where absent."""
        m = self.meta
        return (m.layer_id, m.tp_rank, m.step) if m is not None else (None, None, None)

    def to_json(self) -> dict:
        d: dict[str, Any] = {"capture": self.capture, "verdict": self.verdict, "diagnosis": self.diagnosis,
                             "diagnosis_text": self.diagnosis_text, "metadata": self.metadata.to_json()}  # fmt: skip
        if self.error is not None:
            d["error"] = self.error
        for name in ("mode", "diagnosis_backends"):
            if getattr(self, name) is not None:
                d[name] = getattr(self, name)
        for name in ("meta", "shape", "tolerance", "control"):
            if getattr(self, name) is not None:
                d[name] = getattr(self, name).to_json()
        if self.kind is not None:
            d["kind"] = self.kind
        d.update(self.kind_keys)
        d["backends"] = {n: b.to_json() for n, b in self.backends.items()}
        if self.series is not None:
            d["series"] = [f.to_json() for f in self.series]
        if self.verify_vs_decode is not None:
            d["verify_vs_decode"] = self.verify_vs_decode
        if self.next_steps is not None:
            d["next_steps"] = [s.to_json() for s in self.next_steps]
        return d


def worst_exit_code(reports: list) -> int:
    """Exit code over several reports: 2 invalid > 1 diverged > 0 agree."""
    return max((r.exit_code for r in reports), default=0)

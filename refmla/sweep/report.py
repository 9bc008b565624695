"""The sweep's typed results (built once, rendered by refmla.render.sweep, JSON by ``to_json``):

    SweepReport     the run: seed, budget, coverage, one BackendSweep per backend, every case
    BackendSweep    one backend: its counts per check, its findings, its time in kernel vs reference
    Finding         one (backend, check) that failed: the first failing case, shrunk, its capture,
                    the replay command and verdict, and the axis value that triggers it (Trigger)
    CaseResult      one case: its point, its parameters and each backend's CheckOutcome per check
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Optional, Sequence

from refmla.util import json_safe

NOT_RUN = "not run"  # a check of a case cut off at the budget's deadline (refmla.sweep.budget): neither a pass nor a finding
STATUSES = ("pass", "fail", "error", "n/a", "skipped", NOT_RUN)  # error: the kernel crashed or raised (a finding)


@dataclass
class CheckOutcome:
    check: str  # reference | nan_fill | repeat | splits
    status: str  # one of STATUSES
    detail: str = ""  # one sentence
    data: dict = field(default_factory=dict)  # the check's numbers (a comparison, a RepeatOutcome...)

    @property
    def failed(self) -> bool:
        return self.status in ("fail", "error")

    def to_json(self) -> dict:
        return json_safe({"check": self.check, "status": self.status, "detail": self.detail, **self.data})


@dataclass
class CaseResult:
    index: int  # place in its layout's walk
    layout: str
    point: dict  # the axis values the walk chose
    params: dict  # the concrete case (GoldenCase.params(): lengths, splits, scales, seed)
    outcomes: dict[str, dict[str, CheckOutcome]] = field(default_factory=dict)  # backend -> check -> outcome
    kernel_seconds: dict[str, float] = field(default_factory=dict)  # backend -> seconds in its kernel runs
    reference_seconds: dict[str, float] = field(default_factory=dict)  # backend -> reference, control, comparisons

    def to_json(self) -> dict:
        return {
            "index": self.index, "layout": self.layout, "point": json_safe(self.point), "params": json_safe(self.params),
            "outcomes": {b: {c: o.to_json() for c, o in oc.items()} for b, oc in self.outcomes.items()},
            "kernel_seconds": {b: round(s, 3) for b, s in self.kernel_seconds.items()},
            "reference_seconds": {b: round(s, 3) for b, s in self.reference_seconds.items()},
        }  # fmt: skip


@dataclass
class Trigger:
    """The axis value (or two, both at once) that best separates a check's failing cases from its
    passing ones."""

    axis: str
    value: Any
    failing_with: int  # failing cases with this value
    cases_with: int  # cases with this value
    failing_elsewhere: int  # failing cases without it
    cases_elsewhere: int
    and_axis: Optional[str] = None  # a second axis whose value, with the first, separates better
    and_value: Any = None
    ties: list = field(default_factory=list)  # "axis = value" of values with exactly the same cases

    @property
    def whenever(self) -> bool:
        """Every case with the value fails and none without it."""
        return self.failing_with == self.cases_with and not self.failing_elsewhere

    def text(self) -> str:
        how = "fails whenever" if self.whenever else "fails most where"
        both = f" and {self.and_axis} = {self.and_value}" if self.and_axis else ""
        ties = f"; as well: {', '.join(self.ties)} (not told apart by these cases)" if self.ties else ""
        return (f"{how} {self.axis} = {self.value}{both} ({self.failing_with} of {self.cases_with} cases; "
                f"{self.failing_elsewhere} of {self.cases_elsewhere} others{ties})")  # fmt: skip

    def to_json(self) -> dict:
        return json_safe({**asdict(self), "whenever": self.whenever, "text": self.text()})


def trigger(cases: Sequence[CaseResult], backend: str, check: str, not_needed: frozenset = frozenset()) -> Optional[Trigger]:
    """The (axis, value) whose cases fail ``check`` the most alike the failing set (F1 score), or
    two of them at once ("heads = 32 and kv = float8_e4m3fn") where the pair separates strictly
    better and holds two failing cases at least; None when nothing failed. Only cases where the
    check ran (pass, fail or error) count, and only in the layouts where it failed (a layout no
    failure came from runs another kernel under the same name, e.g. SGLang's sparse Triton kernel).
    ``not_needed``: axes the shrink moved away from while the case kept failing (its length, its
    batch, its heads): their values are not what triggers it. Values that separate as well as the
    one named are kept in ``ties`` (the cases seen cannot tell them apart)."""
    seen = [(c, c.outcomes[backend][check]) for c in cases if c.outcomes.get(backend, {}).get(check)]
    failed_in = {c.layout for c, o in seen if o.failed}
    ran = [(c.point, o.failed) for c, o in seen if c.layout in failed_in and o.status in ("pass", "fail", "error")]
    failing = sum(f for _, f in ran)
    if not failing:
        return None
    cases_of: dict[tuple[str, str], int] = {}  # (axis, repr(value)) -> bitmask of the cases with it
    for i, (p, _) in enumerate(ran):
        for a, v in p.items():
            if a not in not_needed:
                cases_of[(a, repr(v))] = cases_of.get((a, repr(v)), 0) | (1 << i)
    failed = sum(1 << i for i, (_, f) in enumerate(ran) if f)
    values = sorted(cases_of)
    if not values:
        return None

    def scored(conds) -> tuple[float, tuple, int, int]:
        mask = cases_of[conds[0]] if len(conds) == 1 else cases_of[conds[0]] & cases_of[conds[1]]
        hit, n = bin(mask & failed).count("1"), bin(mask).count("1")
        return 2 * hit / (n + failing), conds, hit, n

    def best_of(candidates) -> Optional[tuple[float, tuple, int, int]]:
        best = None
        for conds in candidates:
            got = scored(conds)
            if best is None or got[0] > best[0] + 1e-12:
                best = got
        return best

    one = best_of((av,) for av in values)
    two = best_of((x, y) for i, x in enumerate(values) for y in values[i + 1 :] if x[0] != y[0])
    score, conds, hit, n = one
    if two is not None and two[0] > score + 1e-12 and two[2] >= 2:
        score, conds, hit, n = two
    (axis, value), *rest = conds
    t = Trigger(axis, _plain(value), hit, n, failing - hit, len(ran) - n)
    if rest:
        t.and_axis, t.and_value = rest[0][0], _plain(rest[0][1])
    else:
        t.ties = [f"{a} = {_plain(v)}" for a, v in values
                  if (a, v) != (axis, value) and cases_of[(a, v)] == cases_of[(axis, value)]]  # fmt: skip
    return t


def _plain(value_repr: str) -> Any:
    try:
        import ast

        return ast.literal_eval(value_repr)
    except (ValueError, SyntaxError):
        return value_repr


@dataclass
class Finding:
    backend: str
    check: str
    detail: str  # the first failing case's outcome
    first_case: int  # CaseResult.index of the first failing case
    layout: str
    failing_cases: int = 0
    shrunk: dict = field(default_factory=dict)  # the shrunk case's parameters
    shrunk_detail: str = ""  # the shrunk case's outcome
    shrink_steps: list = field(default_factory=list)  # "requests 8 -> 1", ...
    capture: Optional[str] = None  # the shrunk case's refmla.capture/1 file
    replay_command: Optional[str] = None
    replay_verdict: Optional[str] = None  # what `refmla replay` says of the capture
    trigger: Optional[Trigger] = None

    def to_json(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if k != "trigger"}
        d["trigger"] = self.trigger.to_json() if self.trigger else None
        return json_safe(d)


@dataclass
class BackendSweep:
    backend: str
    available: bool = True
    reason: str = ""  # why not available, or its version line
    counts: dict[str, dict[str, int]] = field(default_factory=dict)  # check -> status -> cases
    findings: list[Finding] = field(default_factory=list)
    skipped_layouts: dict[str, str] = field(default_factory=dict)  # layout -> why the backend takes none
    not_run: dict[str, str] = field(default_factory=dict)  # of those, layouts it reads where it did not run, and why
    cases: int = 0
    kernel_seconds: float = 0.0
    reference_seconds: float = 0.0

    def count(self, outcomes: dict[str, CheckOutcome]) -> None:
        """One case's outcomes counted (a case none of whose checks ran, cut off by the budget, is not a case run)."""
        self.cases += any(o.status != NOT_RUN for o in outcomes.values())
        for check, o in outcomes.items():
            per = self.counts.setdefault(check, {})
            per[o.status] = per.get(o.status, 0) + 1

    @property
    def passed(self) -> bool:
        return not self.findings

    def to_json(self) -> dict:
        cpm = 60 * self.cases / self.kernel_seconds_total if self.kernel_seconds_total else None
        return json_safe({
            "backend": self.backend, "available": self.available, "reason": self.reason, "cases": self.cases,
            "counts": self.counts, "findings": [f.to_json() for f in self.findings],
            "skipped_layouts": self.skipped_layouts, "not_run": self.not_run, "kernel_seconds": round(self.kernel_seconds, 3),
            "reference_seconds": round(self.reference_seconds, 3), "cases_per_minute": cpm,
            "passed": self.passed,
        })  # fmt: skip

    @property
    def kernel_seconds_total(self) -> float:
        return self.kernel_seconds + self.reference_seconds


@dataclass
class SweepReport:
    seed: int
    budget: float
    repeat: int
    jobs: int
    layouts: list[str]
    backends: dict[str, BackendSweep] = field(default_factory=dict)
    cases: list[CaseResult] = field(default_factory=list)
    pairs: dict[str, list[int]] = field(default_factory=dict)  # layout -> [covered, total] value pairs
    walk_seconds: float = 0.0
    shrink_seconds: float = 0.0
    out_dir: Optional[str] = None
    not_walked: list[str] = field(default_factory=list)  # layouts the sweep does not walk yet
    asked: bool = False  # the backends were named (--backend): one that does not run is not a pass
    allow_skip: bool = False  # --allow-skip: a named backend that did not run is accepted
    bounds: dict = field(default_factory=dict)  # the size bounds the walk kept to (refmla.sweep.space.Bounds)
    not_started: dict[str, int] = field(default_factory=dict)  # layout -> points whose predicted cost passed what was left

    @property
    def cut_off(self) -> int:
        """Cases cut off at the budget's deadline (some check ``not run``)."""
        return sum(any(o.status == NOT_RUN for oc in c.outcomes.values() for o in oc.values()) for c in self.cases)

    @property
    def findings(self) -> list[Finding]:
        return [f for b in self.backends.values() for f in b.findings]

    @property
    def not_run(self) -> list[tuple[str, str, str]]:
        """(backend, layout, why) of each walked layout a named backend reads and did not run on
        (unavailable here, or every case of it skipped); [] without --backend."""
        if not self.asked:
            return []
        return [(n, la, why) for n, b in self.backends.items() for la, why in b.not_run.items()]

    @property
    def exit_code(self) -> int:
        """0 no finding, 1 a finding, 3 a backend named with --backend did not run on a layout it
        reads (unless --allow-skip) (docs/contract.md: exit codes; 1 over 3)."""
        if self.findings:
            return 1
        return 3 if self.not_run and not self.allow_skip else 0

    @property
    def cases_per_minute(self) -> Optional[float]:
        return 60 * len(self.cases) / self.walk_seconds if self.walk_seconds > 0 else None

    def to_json(self) -> dict:
        cpm = self.cases_per_minute
        return json_safe({
            "format": "refmla.sweep/1", "seed": self.seed, "budget": self.budget, "repeat": self.repeat,
            "jobs": self.jobs, "layouts": self.layouts, "not_walked": self.not_walked, "pairs": self.pairs,
            "walk_seconds": round(self.walk_seconds, 3), "shrink_seconds": round(self.shrink_seconds, 3),
            "cases_per_minute": None if cpm is None or math.isnan(cpm) else round(cpm, 2),
            "out_dir": self.out_dir, "exit_code": self.exit_code, "bounds": self.bounds,
            "not_started": self.not_started, "cut_off": self.cut_off,
            "not_run": [{"backend": n, "layout": la, "why": why} for n, la, why in self.not_run],
            "backends": {n: b.to_json() for n, b in self.backends.items()},
            "findings": [f.to_json() for f in self.findings], "cases": [c.to_json() for c in self.cases],
        })  # fmt: skip


__all__ = ["NOT_RUN", "STATUSES", "BackendSweep", "CaseResult", "CheckOutcome", "Finding", "SweepReport", "Trigger", "trigger"]

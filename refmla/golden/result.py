"""The result of checking one backend against one golden file: typed, rendered, and sent as JSON.

A :class:`GoldenResult` holds the backend's :class:`refmla.results.BackendEntry` (for ``reference``,
the self-check's entry, built the same way). ``message()`` renders it for a kernel engineer.
``to_json`` / ``from_json`` carry it across the process boundary of ``check_isolated``: the child
prints ``to_json()`` (the entry in the contract's JSON, docs/contract.md section 3), the parent
rebuilds the typed entry from it. JSON only, never pickle.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Optional

from refmla.compare import Comparison, Worst
from refmla.results import Alternative, BackendEntry, Explanation, SplitCheck


@dataclass
class GoldenResult:
    case: str
    backend: str
    entry: BackendEntry  # replay's backend entry; for "reference", the self-check's
    why: str = ""  # the failure class the case is for
    replay: str = ""  # the command that replays this case through this backend
    seconds: float = 0.0

    @classmethod
    def error(cls, case: str, backend: str, reason: str, **kw: Any) -> "GoldenResult":
        """A check that produced no entry of its own: not a golden file, a child process that died."""
        return cls(case, backend, BackendEntry("error", reason=reason), **kw)

    @property
    def status(self) -> str:
        return self.entry.status  # pass | fail | skipped | error

    @property
    def reason(self) -> Optional[str]:
        return self.entry.reason

    @property
    def passed(self) -> bool:
        return self.status == "pass"

    def message(self) -> str:
        """What a kernel engineer reads on failure: reasons, the worst element, the replay command."""
        e = self.entry
        why = f"  [{self.why}]" if self.why else ""
        lines = [f"golden {self.case} / {self.backend}: {self.status.upper()}{why}"]
        if self.reason:
            lines += [f"  {r}" for r in self.reason.split("; ")]
        worst = self.worst_element()
        if worst:
            lines.append(worst)
        if e.splits is not None:
            lines.append(f"  splits: {e.splits.status}" + (f" ({e.splits.reason})" if e.splits.reason else ""))
        if e.explanation is not None:
            lines.append(f"  {e.explanation.text()}")
        lines.append(f"  replay: {self.replay}")
        return "\n".join(lines)

    def worst_element(self) -> str:
        """The worst element's line of ``message()``, or "" when the entry names none."""
        w = self.entry.worst
        if w is None or w.dim is None or w.request is None:
            return ""
        got, want = ("stored", "recomputed") if self.backend == "reference" else (self.backend, "reference")
        actual = "NaN/Inf" if w.actual is None and self.entry.nonfinite else _g(w.actual)  # JSON has no NaN
        return (
            f"  worst element: request {w.request} head {w.head} dim {w.dim}: "
            f"{got} {actual} vs {want} {_g(w.expected)} "
            f"(row err {_g(w.err)}, allowed {_g(w.allowed)}, {_g(w.ratio)}x)"
        )

    def to_json(self) -> dict[str, Any]:
        return {"case": self.case, "backend": self.backend, "status": self.status, "reason": self.reason,
                "why": self.why, "entry": self.entry.to_json(), "replay": self.replay,
                "seconds": self.seconds}  # fmt: skip

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "GoldenResult":
        """The result ``to_json`` wrote (status and reason are the entry's)."""
        return cls(d["case"], d["backend"], entry_from_json(d["entry"], d["backend"]), why=d.get("why", ""),
                   replay=d.get("replay", ""), seconds=float(d.get("seconds", 0.0)))  # fmt: skip


def _g(x: Any) -> str:
    return "-" if x is None else f"{x:.6g}" if isinstance(x, float) else str(x)


# --------------------------------------------------------------------------------------------
# The contract's JSON of a backend entry, back to the typed entry
# (the inverse of the to_json methods of refmla.results; only this process boundary needs it)
# --------------------------------------------------------------------------------------------

_COMPARISON_KEYS = [f.name for f in fields(Comparison) if f.name not in ("name", "row_err", "row_tol")]
_COMPARISON_FLOATS = {f.name for f in fields(Comparison) if f.type in ("float", float)}
_EXPLANATION_KEYS = ("hypothesis", "request", "detail", "max_abs_err", "residual_ratio", "heads", "seconds")
_SPLIT_KEYS = [f.name for f in fields(SplitCheck)]


def entry_from_json(d: dict[str, Any], name: str) -> BackendEntry:
    """The :class:`BackendEntry` whose ``to_json()`` is ``d``; ``name`` names its comparison (the backend)."""
    splits, explanation = d.get("splits"), d.get("explanation")
    return BackendEntry(
        status=d["status"], reason=d.get("reason"), comparison=comparison_from_json(d, name),
        max_abs_err=d.get("max_abs_err"), cos_diff=d.get("cos_diff"), worst=Worst.from_json(d.get("worst")), info=d.get("info"),
        splits=None if splits is None else _split_from_json(splits),
        explanation=None if explanation is None else explanation_from_json(explanation), seconds=d.get("seconds"),
    )  # fmt: skip


def _split_from_json(d: dict[str, Any]) -> SplitCheck:
    kw = {k: v for k, v in d.items() if k in _SPLIT_KEYS}
    if "worst" in kw:
        kw["worst"] = Worst.from_json(kw["worst"])
    return SplitCheck(**kw)


def comparison_from_json(d: dict[str, Any], name: str) -> Optional[Comparison]:
    """The comparison flattened into an entry's JSON (None when the entry has none); null floats are NaN."""
    if "passed" not in d:
        return None
    kw = {k: d[k] for k in _COMPARISON_KEYS if k in d}
    if "worst" in kw:
        kw["worst"] = Worst.from_json(kw["worst"])
    kw.update({k: math.nan for k in _COMPARISON_FLOATS if k in kw and kw[k] is None})  # to_json spells NaN/Inf null
    return Comparison(name=name, **kw)


def explanation_from_json(d: dict[str, Any]) -> Explanation:
    named = {k: d[k] for k in _EXPLANATION_KEYS if k in d}
    typed = {"alternatives", "explained_requests", "unexplained_requests"}
    alts = [Alternative(a["hypothesis"], a["detail"], a.get("request"), a.get("residual_ratio"))
            for a in d.get("alternatives") or []]  # fmt: skip
    return Explanation(**named, extra={k: v for k, v in d.items() if k not in _EXPLANATION_KEYS and k not in typed},
                       alternatives=alts, explained_requests=d.get("explained_requests"),
                       unexplained_requests=d.get("unexplained_requests"))  # fmt: skip

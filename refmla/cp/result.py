"""Typed results of a context-parallel step's replay (refmla.cp.judge)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

HYPOTHESES = ("cp_shard_geometry", "cp_local_length", "cp_combine_lse_base", "cp_shard_missing", "cp_rank_metadata")


@dataclass
class CpFinding:
    """One context-parallel mistake: the hypothesis, the rank it is on, the request and the
    global positions ([start, end) runs) it concerns, a sentence, and what else it measured."""

    hypothesis: str  # one of HYPOTHESES
    rank: Optional[int]
    request: Optional[int]
    positions: list  # [[start, end), ...] global token positions
    text: str
    detail: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"hypothesis": self.hypothesis, "rank": self.rank, "request": self.request,
                "positions": self.positions, "text": self.text, "detail": self.detail}  # fmt: skip


@dataclass
class RankEntry:
    """One rank's partial output judged on its shard (status pass / fail / absent / unjudged)."""

    rank: int
    path: Optional[str]
    status: str
    comparison: Optional[dict] = None  # refmla.compare.Comparison.to_json()
    lse_bad: int = 0  # (request, head) lse values off by more than the lse rule allows
    note: str = ""

    def to_json(self) -> dict:
        return {"rank": self.rank, "path": self.path, "status": self.status, "comparison": self.comparison,
                "lse_bad": self.lse_bad, "note": self.note}  # fmt: skip


@dataclass
class CombineEntry:
    """The combine (the ranks' partials merged by lse) against the whole-context reference."""

    status: str  # pass / fail / unjudged
    comparison: Optional[dict] = None
    note: str = ""

    def to_json(self) -> dict:
        return {"status": self.status, "comparison": self.comparison, "note": self.note}


@dataclass
class CpReport:
    folder: str
    verdict: str  # agree / diverged / invalid
    world: Optional[int] = None
    interleave: Optional[int] = None
    requests: int = 0
    ranks: list = field(default_factory=list)  # [RankEntry]
    combine: Optional[CombineEntry] = None
    findings: list = field(default_factory=list)  # [CpFinding]
    error: Optional[str] = None

    @property
    def exit_code(self) -> int:
        return {"agree": 0, "diverged": 1}.get(self.verdict, 2)

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": "context_parallel", "folder": self.folder, "verdict": self.verdict, "dcp_world_size": self.world,
            "dcp_interleave_size": self.interleave, "requests": self.requests,
            "ranks": [r.to_json() for r in self.ranks],
            "combine": self.combine.to_json() if self.combine else None,
            "findings": [f.to_json() for f in self.findings], "error": self.error,
        }  # fmt: skip

    def text(self) -> str:
        if self.verdict == "invalid":
            return f"{self.folder}: invalid: {self.error}"
        lines = [f"{self.folder}: {self.verdict}  (DCP {self.world} ranks, interleave {self.interleave}, "
                 f"{self.requests} requests)"]  # fmt: skip
        for r in self.ranks:
            lines.append(f"  rank {r.rank}: {r.status}{'  ' + r.note if r.note else ''}")
        if self.combine is not None:
            lines.append(f"  combine: {self.combine.status}{'  ' + self.combine.note if self.combine.note else ''}")
        lines += [f"  {f.hypothesis}: {f.text}" for f in self.findings]
        return "\n".join(lines)


__all__ = ["HYPOTHESES", "CombineEntry", "CpFinding", "CpReport", "RankEntry"]

"""Typed results of ``refmla disagg``: one :class:`Row` per (request, layer, rank), and the
:class:`DisaggReport` around them. ``to_json`` is the only place the JSON keys are spelled
(docs/contract.md section 3, ``refmla disagg --json``); keys are only ever added.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from refmla.region_check import RegionCheck
from refmla.results import Finding

CLASSES = ("writer", "transfer", "metadata", "compute", "none")  # where a row's fault is, in order of precedence


@dataclass
class TransferCell:
    """Did the prompt's KV arrive intact: the diff-kv entry of the request (its first decode capture)."""

    status: str  # "faithful" | "mismatch" | "not_paired" (no prefill capture holds the rid) | "not_checked"
    positions_compared: int = 0
    mismatched_positions: int = 0
    first_mismatch: Optional[int] = None
    first_page: Optional[int] = None
    mismatched_pages: list[int] = field(default_factory=list)
    run: Optional[dict] = None  # the transfer (MORI) run holding the first mismatch: start, end, offset, zero rows
    decode_zero_rows: Optional[int] = None
    summary: Optional[str] = None
    note: Optional[str] = None
    source_rid: Optional[str] = None  # the request whose prefill rows the first mismatching range holds
    offset: Optional[int] = None  # the first source's position shift (source position - decode position)
    sources: list[str] = field(default_factory=list)  # where mismatched rows' bytes are (refmla.diffkv.provenance)
    cache: Optional[str] = None  # a sparse pair: the cache these numbers are of (its first mismatching one)
    cache_label: Optional[str] = None  # "window cache", "compressed cache (C4)", "main cache"
    ratio: Optional[int] = None  # the compressed cache's tokens per position
    caches: Optional[dict] = None  # a sparse pair: cache name -> {label, status, positions_compared, ...}
    sections: Optional[dict] = None  # packed tokens: mismatched ones whose nope / rope / scales bytes differ
    reuse: Optional[dict] = None  # paired by tokens: diff-kv's ``reuse`` (who wrote the rows, the tier they came back from)

    @property
    def bad(self) -> bool:
        return self.status == "mismatch"

    def to_json(self) -> dict:
        d = {"status": self.status, "positions_compared": self.positions_compared,
             "mismatched_positions": self.mismatched_positions, "first_mismatch": self.first_mismatch,
             "first_page": self.first_page, "mismatched_pages": list(self.mismatched_pages), "run": self.run,
             "decode_zero_rows": self.decode_zero_rows, "source_rid": self.source_rid, "summary": self.summary,
             "note": self.note, "offset": self.offset, "sources": list(self.sources)}  # fmt: skip
        if self.reuse is not None:
            d["reuse"] = dict(self.reuse)
        if self.caches is not None:
            d.update(cache=self.cache, cache_label=self.cache_label, ratio=self.ratio, sections=self.sections,
                     caches={k: dict(v) for k, v in self.caches.items()})
        return d


@dataclass
class MetadataCell:
    """Is the decode metadata right: the request's metadata findings in every decode capture, its
    series findings across the decode steps, and the MR region check of its captures."""

    problems: list[tuple[str, Finding]] = field(default_factory=list)  # (capture, warning finding)
    notes: list[tuple[str, Finding]] = field(default_factory=list)
    region: Optional[RegionCheck] = None  # the worst region check of the row's captures (both sides)
    region_capture: Optional[str] = None

    @property
    def ok(self) -> bool:
        return not self.problems

    def checks(self) -> list[str]:
        return list(dict.fromkeys(f.check for _, f in self.problems))

    def to_json(self) -> dict:
        def one(path: str, f: Finding) -> dict:
            return {"capture": path, **f.to_json()}

        return {"ok": self.ok, "checks": self.checks(), "problems": [one(p, f) for p, f in self.problems],
                "notes": [one(p, f) for p, f in self.notes],
                "region": None if self.region is None else {"capture": self.region_capture, **self.region.to_json()}}  # fmt: skip


@dataclass
class DecodeCell:
    """Which compute path diverges over that KV: the replay of the request's decode captures."""

    verdict: str  # "agree" | "diverged" | "invalid" | "not_replayed"
    diagnosis: Optional[str] = None  # a class of contract section 6, for this request
    diagnosis_text: str = ""
    backends: dict[str, str] = field(default_factory=dict)  # name -> this request's status (first diverging step)
    capture: Optional[str] = None  # the first diverging capture (else the last replayed)
    step: Optional[int] = None
    steps: int = 0  # decode captures replayed for this request
    diverged_steps: int = 0
    explanation: Optional[str] = None  # the hypothesis naming this request, as text

    @property
    def bad(self) -> bool:
        return self.verdict in ("diverged", "invalid")

    def to_json(self) -> dict:
        return {"verdict": self.verdict, "diagnosis": self.diagnosis, "diagnosis_text": self.diagnosis_text,
                "backends": dict(self.backends), "capture": self.capture, "step": self.step, "steps": self.steps,
                "diverged_steps": self.diverged_steps, "explanation": self.explanation}  # fmt: skip


@dataclass
class Row:
    """One (request, layer, rank): the three answers and where the fault is."""

    rid: str
    layer: Optional[int]
    rank: Optional[int]
    transfer: TransferCell
    metadata: MetadataCell
    decode: DecodeCell
    fault: str = "none"  # one of CLASSES
    sentence: str = ""
    decode_captures: list[str] = field(default_factory=list)
    prefill_captures: list[str] = field(default_factory=list)
    writer: Optional[Any] = None  # refmla.disagg.writer.WriterCell: the prefill writer's captures, when given

    def where(self) -> str:
        return f"request {self.rid} layer {self.layer} rank {self.rank}"

    def to_json(self) -> dict:
        return {"request": self.rid, "rid": self.rid, "layer": self.layer, "rank": self.rank, "fault": self.fault,
                "sentence": self.sentence, "transfer": self.transfer.to_json(), "metadata": self.metadata.to_json(),
                "decode": self.decode.to_json(), "decode_captures": list(self.decode_captures),
                "prefill_captures": list(self.prefill_captures),
                "writer": self.writer.to_json() if self.writer is not None else None}  # fmt: skip


@dataclass
class DisaggReport:
    """``refmla disagg``: every row, the overall sentence, and the documents it was built from."""

    rows: list[Row]
    fault: str  # the highest-precedence class among the rows ("none": all clean)
    sentence: str
    prefill: list[str]
    decode: list[str]
    regions: list[tuple[str, str, RegionCheck]] = field(default_factory=list)  # (side, capture, check)
    invalid: list[tuple[str, str]] = field(default_factory=list)  # (capture, one-line reason)
    notes: list[str] = field(default_factory=list)
    replays: list[Any] = field(default_factory=list)  # ReplayReport per decode capture
    diffs: list[Any] = field(default_factory=list)  # DiffResult per (decode capture, new rids)
    plots: Optional[list[str]] = None
    seconds: dict[str, float] = field(default_factory=dict)  # stage -> wall seconds
    indexers: list[Any] = field(default_factory=list)  # ReplayReport per indexer capture judged alone (refmla.disagg.indexers)

    @property
    def classes(self) -> dict[str, int]:
        return {c: sum(r.fault == c for r in self.rows) for c in CLASSES}

    @property
    def exit_code(self) -> int:
        """2 an unusable capture; 1 a row with a fault or a region finding; else 0."""
        if self.invalid:
            return 2
        bad = any(r.fault != "none" for r in self.rows) or any(c.is_finding for _, _, c in self.regions)
        bad = bad or any(r.verdict == "diverged" for r in self.indexers)
        return 1 if bad else 0

    def to_json(self) -> dict:
        d = {"ok": self.exit_code == 0, "fault": self.fault, "sentence": self.sentence, "classes": self.classes,
             "rows": [r.to_json() for r in self.rows],
             "regions": [{"side": s, "capture": p, **c.to_json()} for s, p, c in self.regions],
             "invalid": [{"capture": p, "error": e} for p, e in self.invalid], "notes": list(self.notes),
             "prefill": list(self.prefill), "decode": list(self.decode),
             "replays": [r.to_json() for r in self.replays], "diffs": [x.to_json() for x in self.diffs],
             "seconds": dict(self.seconds), "indexers": [r.to_json() for r in self.indexers]}  # fmt: skip
        if self.plots is not None:
            d["plots"] = list(self.plots)
        return d

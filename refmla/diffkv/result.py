"""Typed results of a diff-kv: built once in ``compare`` / ``runs``, read by attribute in ``render`` and
``plots``, turned into the JSON of docs/contract.md (section 3, ``refmla diff-kv --json``) by ``to_json``,
the only place the JSON keys are spelled.

Contract keys: ``ok`` and ``requests[].{request, positions_compared, mismatched_positions,
first_mismatch, mismatched_pages}``; every other key is an extra that is only ever added to.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Union

from refmla.util import present

Label = Union[str, int]  # a request's rid, or its index when requests are paired by order


@dataclass
class MismatchDetail:
    """One mismatched position of a request: where its two rows sit and how they differ."""

    position: int
    page: int  # position // page_size of the decode side
    max_abs_diff: float  # over the elements finite on both sides
    prefill_norm: float  # fp64 norm of the finite elements
    decode_norm: float
    differing_dims: int
    prefill_capture: int  # index of the prefill capture that owns the position
    prefill_row: int  # pool row (kv_indices) on each side
    decode_row: int
    prefill_slot: Optional[int] = None  # physical slot (orig_kv_indices), when the capture has them
    decode_slot: Optional[int] = None

    def to_json(self) -> dict:
        d = {"position": self.position, "page": self.page, "max_abs_diff": self.max_abs_diff,
             "prefill_norm": self.prefill_norm, "decode_norm": self.decode_norm,
             "differing_dims": self.differing_dims, "prefill_capture": self.prefill_capture,
             "prefill_row": self.prefill_row, "decode_row": self.decode_row}  # fmt: skip
        return {**d, **present(prefill_slot=self.prefill_slot, decode_slot=self.decode_slot)}


@dataclass
class TransferRun:
    """A maximal run of positions contiguous in both pools' physical slots (what one transfer write
    moves) that holds mismatches."""

    start: int  # positions [start, end)
    end: int
    mismatched_positions: int
    first_mismatch: int
    pages: tuple[int, int]  # first and last page (decode page_size)
    prefill_slot: int  # physical slot of position ``start`` on each side
    decode_slot: int
    searched: bool = False  # offset and zero rows looked for (the first MAX_OFFSET_SEARCH runs only)
    offset: Optional[int] = None  # k: every mismatched decode row j holds the prefill row j + k
    decode_zero_rows: int = 0  # mismatched decode rows that are all zero (not landed)

    @property
    def positions(self) -> int:
        return self.end - self.start

    def to_json(self) -> dict:
        d = {"start": self.start, "end": self.end, "positions": self.positions,
             "mismatched_positions": self.mismatched_positions, "first_mismatch": self.first_mismatch,
             "pages": list(self.pages), "prefill_slot": self.prefill_slot, "decode_slot": self.decode_slot}  # fmt: skip
        if self.searched:
            d["offset"] = self.offset
            d["decode_zero_rows"] = self.decode_zero_rows
        return d


@dataclass
class TransferRuns:
    """A request's positions cut into transfer runs; those holding mismatches (at most MAX_RANGES)."""

    runs: int  # runs in all
    with_mismatches: int
    mismatched: list[TransferRun] = field(default_factory=list)

    def to_json(self) -> dict:
        return {"runs": self.runs, "with_mismatches": self.with_mismatches,
                "mismatched": [r.to_json() for r in self.mismatched]}  # fmt: skip


@dataclass
class Mismatches:
    """The numbers of one request's mismatched rows (present only when it has some)."""

    ranges: list[tuple[int, int]]  # [start, end) runs of consecutive mismatched positions, the first MAX_RANGES
    ranges_total: Optional[int]  # how many there are, when more than listed
    max_abs_diff: float
    decode_zero_rows: int  # mismatched rows all zero on the decode side (not landed)
    prefill_zero_rows: int
    nonfinite_prefill_rows: int  # mismatched rows holding NaN/Inf on each side
    nonfinite_decode_rows: int
    first: MismatchDetail
    worst: MismatchDetail  # the largest max_abs_diff
    sections: Optional[dict] = None  # a packed sparse cache: mismatched tokens whose nope / rope / scales bytes differ

    def to_json(self) -> dict:
        d: dict = {"mismatch_ranges": [list(r) for r in self.ranges]}
        if self.ranges_total is not None:
            d["mismatch_ranges_total"] = self.ranges_total
        d.update(max_abs_diff=self.max_abs_diff, decode_zero_rows=self.decode_zero_rows,
                 prefill_zero_rows=self.prefill_zero_rows,
                 nonfinite_rows={"prefill": self.nonfinite_prefill_rows, "decode": self.nonfinite_decode_rows},
                 first_detail=self.first.to_json(), worst_detail=self.worst.to_json())  # fmt: skip
        if self.sections is not None:
            d["differing_sections"] = dict(self.sections)
        return d


@dataclass
class PrefillDisagreement:
    """Chunk captures of one request that hold the same position with different bytes."""

    positions: int
    first: Optional[int]

    def to_json(self) -> dict:
        return {"positions": self.positions, "first": self.first}


@dataclass
class RequestDiff:
    """One request: paired on both sides ("match" / "mismatch"), or on one side only
    ("prefill_only" / "decode_only", nothing compared)."""

    request: Label
    rid: Optional[str]
    status: str  # "match" | "mismatch" | "prefill_only" | "decode_only"
    positions_compared: int = 0
    mismatched_positions: int = 0
    first_mismatch: Optional[int] = None
    mismatched_pages: list[int] = field(default_factory=list)
    positions_prefill: Optional[int] = None  # positions each side holds (paired requests only)
    positions_decode: Optional[int] = None
    prefill_captures: list[int] = field(default_factory=list)  # indices of the captures that hold it
    note: Optional[str] = None
    prefill_disagreements: Optional[PrefillDisagreement] = None  # with several prefill captures
    mismatches: Optional[Mismatches] = None
    summary: Optional[str] = None  # one line on the mismatches
    transfer_runs: Optional[TransferRuns] = None  # with physical slots on both sides
    sources: Optional[list] = None  # refmla.diffkv.provenance.Source: where mismatched rows' bytes are in the prefill
    cache: Optional[str] = None  # a sparse pair: the cache compared ("window" | "main" | "compressed", refmla.diffkv.views)
    reuse: Optional[Any] = None  # paired by tokens: refmla.diffkv.tokens.Reuse (who wrote the rows, their origin)

    @property
    def paired(self) -> bool:
        return self.status in ("match", "mismatch")

    @property
    def faithful(self) -> bool:
        """Paired and every compared position identical."""
        return self.status == "match"

    @property
    def first_page(self) -> Optional[int]:
        """The page (decode page_size) of the first mismatch."""
        return self.mismatches.first.page if self.mismatches is not None else None

    @property
    def first_run(self) -> Optional[TransferRun]:
        """The transfer run that holds the first mismatch (None without physical slots)."""
        runs = self.transfer_runs.mismatched if self.transfer_runs is not None else []
        return runs[0] if runs else None

    def to_json(self) -> dict:
        d: dict = {"request": self.request, "rid": self.rid, "status": self.status,
                   "positions_compared": self.positions_compared, "mismatched_positions": self.mismatched_positions,
                   "first_mismatch": self.first_mismatch, "mismatched_pages": list(self.mismatched_pages)}  # fmt: skip
        if self.cache is not None:
            d["cache"] = self.cache
        if not self.paired:
            d["note"] = self.note
            return d
        d.update(positions_prefill=self.positions_prefill, positions_decode=self.positions_decode,
                 prefill_captures=list(self.prefill_captures))  # fmt: skip
        if self.note is not None:
            d["note"] = self.note
        if self.reuse is not None:
            d["reuse"] = self.reuse.to_json()
        if self.prefill_disagreements is not None:
            d["prefill_disagreements"] = self.prefill_disagreements.to_json()
        if self.mismatches is not None:
            d.update(self.mismatches.to_json())
            d["summary"] = self.summary
            if self.transfer_runs is not None:
                d["transfer_runs"] = self.transfer_runs.to_json()
            if self.sources is not None:
                d["sources"] = [src.to_json() | {"text": src.text(self.rid)} for src in self.sources]
        return d


@dataclass
class DiffResult:
    """A diff-kv of prefill capture(s) against one decode capture."""

    ok: bool  # positions were compared and none mismatched
    requests: list[RequestDiff]  # paired ones in decode order, then the unpaired
    prefill: list[str]  # paths
    decode: str
    pairing: str  # "rid" | "order" | "tokens" (kv_token_ids on every capture: refmla.diffkv.tokens)
    page_size: int  # the decode side's
    compared: str  # "bytes" (same dtype on both sides) | "values"
    physical_slots: bool  # orig_kv_indices on both sides: transfer runs reported
    positions_compared: int
    mismatched_positions: int
    mismatched_requests: int
    paired_requests: int
    prefill_only: list[Label]
    decode_only: list[Label]
    notes: list[str] = field(default_factory=list)
    plots: Optional[list[str]] = None  # files written by ``refmla diff-kv --plot``
    error: Optional[str] = None  # why nothing could be compared (exit 2): then ``ok`` is false
    caches: Optional[dict] = None  # a sparse pair: cache name -> its label, layout, page size and counts

    def request(self, label: Label, cache: Optional[str] = None) -> RequestDiff:
        """The entry of one request by its rid (or index when paired by order), of ``cache`` (a sparse
        pair; None: its first mismatching cache, else its first); KeyError if none."""
        mine = [e for e in self.requests if e.request == label and (cache is None or e.cache == cache)]
        if not mine:
            raise KeyError(label if cache is None else (label, cache))
        return next((e for e in mine if e.mismatched_positions), mine[0])

    def entries_of(self, label: Label) -> list[RequestDiff]:
        """Every entry of one request: one per cache of a sparse pair, else one."""
        return [e for e in self.requests if e.request == label]

    def to_json(self) -> dict:
        d = {"ok": self.ok, "requests": [e.to_json() for e in self.requests], "prefill": list(self.prefill),
             "decode": self.decode, "pairing": self.pairing, "page_size": self.page_size,
             "compared": self.compared, "physical_slots": self.physical_slots,
             "positions_compared": self.positions_compared, "mismatched_positions": self.mismatched_positions,
             "mismatched_requests": self.mismatched_requests, "paired_requests": self.paired_requests,
             "prefill_only": list(self.prefill_only), "decode_only": list(self.decode_only),
             "notes": list(self.notes)}  # fmt: skip
        if self.plots is not None:
            d["plots"] = list(self.plots)
        if self.error is not None:
            d["error"] = self.error
        if self.caches is not None:
            d["caches"] = {k: dict(v) for k, v in self.caches.items()}
        return d

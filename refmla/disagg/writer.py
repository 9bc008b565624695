"""The first link of the chain, written -> transferred -> read: the prefill node's KV writer
captures (meta mode ``kv_write``, refmla.kvwrite) among the prefill paths, each judged, and each
(request, layer, rank) row's answer: did the writer store the rows it was given as documented?"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

from refmla.batch import replay_one
from refmla.capture.kinds import file_mode
from refmla.options import ReplayOptions
from refmla.results import ReplayReport


@dataclass
class WriterCell:
    """The writer captures of one row's request and layer, judged."""

    status: str  # "ok" | "broken" | "not_captured" (no writer capture holds this rid and layer)
    captures: list[str] = field(default_factory=list)
    diagnosis: Optional[str] = None  # the first broken capture's class (kv_writer, kv_saturated)
    diagnosis_text: Optional[str] = None
    capture: Optional[str] = None  # the first broken capture

    @property
    def bad(self) -> bool:
        return self.status == "broken"

    def to_json(self) -> dict:
        return dict(self.__dict__)


def split_writers(paths: Sequence[str]) -> tuple[list[str], list[str]]:
    """(the kv_write captures, the other prefill captures), each in the order given."""
    writers = [p for p in paths if file_mode(p) == "kv_write"]
    return writers, [p for p in paths if p not in writers]


def judge_writers(paths: Sequence[str], opts: ReplayOptions) -> list[ReplayReport]:
    """Each writer capture judged (refmla.pipeline; an unusable one is an ``invalid`` report)."""
    return [replay_one(str(p), opts) for p in paths]


def writer_cell(rid: str, layer: Optional[int], reports: Sequence[ReplayReport]) -> WriterCell:
    """The row's answer from the writer captures of its layer that wrote its rid (or name no rids)."""
    mine = [r for r in reports if r.verdict != "invalid" and r.meta is not None
            and (r.meta.layer_id is None or layer is None or r.meta.layer_id == layer)
            and (not r.meta.rids or rid in r.meta.rids)]  # fmt: skip
    if not mine:
        return WriterCell("not_captured")
    broken = [r for r in mine if r.verdict == "diverged"]
    if not broken:
        return WriterCell("ok", [r.capture for r in mine])
    b = broken[0]
    return WriterCell("broken", [r.capture for r in mine], b.diagnosis, b.diagnosis_text, b.capture)


__all__ = ["WriterCell", "judge_writers", "split_writers", "writer_cell"]

"""The indexer captures (meta mode ``indexer``, refmla.indexer) among either side's paths: never read
as KV captures. One beside a sparse decode capture of the decode side (same folder, layer, rank,
step and rids: refmla.indexer.chain.beside) is judged by that capture's replay (its ``indexer``
entry, each row's request by its own verdict); every other one is judged alone (refmla.pipeline),
its report kept and said in one note, and a wrong set is a fault of the run, never a silent pass."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from refmla.batch import replay_one
from refmla.capture.kinds import file_mode
from refmla.indexer.chain import beside
from refmla.options import ReplayOptions
from refmla.results import ReplayReport
from refmla.sparse.format import SparseMeta


@dataclass
class Indexers:
    """The indexer captures of a run: those a decode replay judges, and those judged alone."""

    paired: list[str] = field(default_factory=list)
    alone: list[ReplayReport] = field(default_factory=list)

    def notes(self) -> list[str]:
        said = [f"{len(self.paired)} indexer capture(s) judged with the sparse decode capture beside each "
                f"(its 'indexer' entry)"] if self.paired else []  # fmt: skip
        for r in self.alone:
            if r.verdict == "invalid":
                continue  # said as invalid (exit 2)
            said.append(f"indexer capture {r.capture}: judged alone (no sparse decode capture of its layer, rank, step "
                        f"and rids beside it): {r.verdict}: {r.diagnosis_text}")  # fmt: skip
        return said

    def diverged(self) -> list[ReplayReport]:
        return [r for r in self.alone if r.verdict == "diverged"]


def split_indexers(paths: Sequence[str]) -> tuple[list[str], list[str]]:
    """(the indexer captures, the other paths), each in the order given."""
    found = [p for p in paths if file_mode(p) == "indexer"]
    return found, [p for p in paths if p not in found]


def judge_indexers(found: Sequence[str], decode_headers: Sequence, opts: ReplayOptions) -> Indexers:
    """Which indexer captures a sparse decode replay judges (``decode_headers``: refmla.disagg.plan
    Header of each decode capture), the others judged alone."""
    paired = set()
    for h in decode_headers:
        if isinstance(h.meta, SparseMeta):
            p = beside(h)
            if p is not None:
                paired.add(str(Path(p).resolve()))
    out = Indexers()
    for p in found:
        if str(Path(p).resolve()) in paired:
            out.paired.append(str(p))
        else:
            out.alone.append(replay_one(str(p), opts))
    return out


__all__ = ["Indexers", "judge_indexers", "split_indexers"]

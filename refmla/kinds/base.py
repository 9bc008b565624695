"""What the one replay (refmla.pipeline) asks of a capture kind: the hooks where dense, block-table
and sparse captures differ. Everything else (isolation, repeats, the exception ladder, judging the
parts, localization and explanation as aids, the verdict) is the pipeline's, written once."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from refmla.backends.base import Backend, BackendResult
from refmla.diagnosis import Diagnosis
from refmla.options import ReplayOptions
from refmla.results import BackendEntry, LseCheck, ReplayReport, SplitCheck


@dataclass
class Judged:
    """One backend's result judged at its own arithmetic: the output's comparison, the parts."""

    comparison: Any  # refmla.compare.Comparison
    arithmetic: Any  # the declaration it was judged at (refmla.arithmetic / refmla.sparse.arithmetic): to_json()
    splits: Optional[SplitCheck] = None
    lse: Optional[LseCheck] = None
    info: dict = field(default_factory=dict)  # what the entry's info says besides (rows not compared)


class Kind:
    """One capture kind's hooks (one subclass per kind, in its own module). ``name`` is the report's
    ``kind``; ``cap`` and ``opts`` the capture replayed and its options."""

    name: str = ""
    cap: Any
    opts: ReplayOptions

    def report(self) -> ReplayReport:
        """The report's head: capture, shape, metadata checks (a failed check: ``invalid``)."""
        raise NotImplementedError

    def begin(self, report: ReplayReport) -> None:
        """The reference and the control, once (after the checks passed): the report's noise floor."""

    def backend_names(self) -> list[str]:
        """reference and observed first, then the kernels replayed."""
        raise NotImplementedError

    def backend(self, name: str) -> Backend:
        raise NotImplementedError

    def judge(self, name: str, res: BackendResult) -> Judged:
        """``res`` against the reference, at the control of the arithmetic the backend declares, over
        the rows this kind compares."""
        raise NotImplementedError

    def localize(self, res: BackendResult, entry: BackendEntry, judged: Judged) -> Any:
        """Where a failing backend goes wrong (refmla.localize.types.Localization), or None."""
        return None

    def explain(self, res: BackendResult, judged: Judged, notes: dict) -> Any:
        """Which simple mistake explains the diverging output (this kind's hypothesis families)."""
        return None

    def diagnose(self, backends: dict[str, BackendEntry]) -> Diagnosis:
        raise NotImplementedError

    def agreeing(self, backends: dict[str, BackendEntry]) -> list[str]:
        """The kernels that passed (what the next steps after ``observed`` may cite)."""
        return [n for n, b in backends.items() if b.status == "pass" and n not in ("reference", "observed")]

    def finish(self, report: ReplayReport) -> None:
        """What the kind adds after the verdict (a verify table, the indexer capture beside it)."""


__all__ = ["Judged", "Kind"]

"""`refmla inspect`: what a capture holds (shapes, dtypes, meta) and what its metadata checks found.

One entry per capture, with the MR region-size check of its pool geometry (refmla.region_check: a
``finding`` exits 1, a ``warning`` -- within 5 % below the limit -- is reported and exits 0, a
capture without geometry is ``not_recorded``); a sparse decode capture's entry is built by
refmla.sparse.inspection's description (:func:`inspect_sparse`: the same entry with ``sparse`` added); with several captures each readable one also gets its series findings
(refmla.series) against the previous capture of its layer and rank.
A capture holding aiter's persistent work / reduce maps also gets its plan checked (refmla.plan: a
violation exits 1). A KV writer, merge or chunked-prefill capture (mode ``kv_write`` / ``merge`` /
``chunked_prefill``) gets its kind's description (refmla.kvwrite, refmla.merge).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch

from refmla.capture import CaptureError, read_capture
from refmla.capture.kinds import file_mode
from refmla.indexer.format import describe as describe_indexer
from refmla.indexer.io import read_indexer
from refmla.kvwrite.format import describe as describe_kv_write
from refmla.kvwrite.io import read_kv_write
from refmla.merge.chunked_format import describe as describe_chunked
from refmla.merge.format import describe as describe_merge
from refmla.merge.io import read_chunked, read_merge
from refmla.checks import check_capture
from refmla.flashmla_plan import check_flashmla_plan
from refmla.plan import PlanCheck, check_aiter_plan
from refmla.region_check import RegionCheck, check_region
from refmla.results import Finding, MetadataReport
from refmla.series import series_checks
from refmla.sparse.inspection import describe
from refmla.sparse.validation import read_sparse
from refmla.util import dtype_name, error_text


@dataclass
class InspectEntry:
    capture: str
    metadata: MetadataReport
    meta: Optional[dict] = None
    tensors: dict[str, dict] = field(default_factory=dict)  # name -> {"shape", "dtype"}
    error: Optional[str] = None  # unreadable: why, in one line
    series: Optional[list[Finding]] = None
    region: Optional[RegionCheck] = None  # the MR region-size check (readable captures)
    sparse: Optional[Any] = None  # sparse decode captures: refmla.sparse.inspection.SparseInspection
    plan: Optional[PlanCheck] = None  # the kernel's recorded launch plan checked (refmla.plan)
    described: Optional[dict] = None  # kv_write / merge captures: their kind's description (describe())

    @property
    def exit_code(self) -> int:
        """2 invalid, 1 any warning (metadata or series) or a region finding, else 0."""
        if not self.metadata.ok:
            return 2
        region_bad = self.region is not None and self.region.is_finding
        plan_bad = self.plan is not None and not self.plan.ok
        return 1 if self.metadata.warnings or region_bad or plan_bad or any(f.severity == "warning" for f in self.series or []) else 0

    def to_json(self) -> dict:
        d: dict[str, Any] = {"capture": self.capture}
        if self.error is not None:
            d["error"] = self.error
        else:
            d.update(meta=self.meta, tensors=self.tensors)
        d["metadata"] = self.metadata.to_json()
        if self.series is not None:
            d["series"] = [f.to_json() for f in self.series]
        if self.region is not None:
            d["region"] = self.region.to_json()
        if self.sparse is not None:
            d.update(kind="sparse_decode", sparse=self.sparse.to_json())
        if self.plan is not None:
            d["plan"] = self.plan.to_json()
        if self.described is not None:
            d.update(kind=(self.meta or {}).get("mode"), description=self.described)
        return d


# the kinds with tensors of their own, by meta mode: (reader, describe)
KINDS = {"kv_write": (read_kv_write, describe_kv_write), "merge": (read_merge, describe_merge),
         "chunked_prefill": (read_chunked, describe_chunked), "indexer": (read_indexer, describe_indexer)}


def _inspect_kind(path: str, read, describe) -> InspectEntry:
    cap = read(path)
    tensors = {n: {"shape": list(t.shape), "dtype": dtype_name(t.dtype)}
               for n, t in cap.__dict__.items() if isinstance(t, torch.Tensor)}  # fmt: skip
    md = MetadataReport(ok=True, warnings=list(cap.warnings))
    return InspectEntry(cap.path, md, meta=cap.meta.to_json(), tensors=tensors, described=describe(cap))


def recorded_plan(cap) -> Optional[PlanCheck]:
    """The check of the launch plan the capture recorded (aiter's work / reduce maps, FlashMLA's
    tile-scheduler metadata), None when it holds none."""
    if cap.flashmla_tile_scheduler_metadata is not None:
        return check_flashmla_plan(cap.flashmla_tile_scheduler_metadata, cap.flashmla_num_splits,
                                   cap.seq_lens.tolist(), cap.meta.extra["flashmla_sched_layout"])  # fmt: skip
    return check_aiter_plan(cap)


def inspect_one(path: str) -> InspectEntry:
    """One capture's entry; never raises: an unreadable capture, or one refmla fails on, is invalid."""
    try:
        kind = KINDS.get(file_mode(path))
        if kind is not None:
            return _inspect_kind(path, *kind)
        cap = read_capture(path)
        tensors = {n: {"shape": list(t.shape), "dtype": dtype_name(t.dtype)} for n, t in cap.tensors().items()}
        md = check_capture(cap)
        return InspectEntry(cap.path, md, meta=cap.meta.to_json(), tensors=tensors, region=check_region(cap.meta),
                            plan=recorded_plan(cap) if md.ok else None)  # fmt: skip
    except CaptureError as e:
        return InspectEntry(str(path), MetadataReport.invalid(str(e)), error=str(e))
    except Exception as e:  # one bad file must not end the run
        err = str(CaptureError(path, "inspect", error_text(e)))
        return InspectEntry(str(path), MetadataReport.invalid(err), error=err)


def inspect_captures(paths: Sequence[str]) -> list[InspectEntry]:
    """One entry per path; with several paths every readable one also gets its series findings."""
    entries = [inspect_one(str(p)) for p in paths]
    if len(paths) > 1:
        series = series_checks([str(p) for p in paths])
        for e in entries:
            if e.capture in series:
                e.series = series[e.capture]
    return entries


def inspect_exit_code(entries: list[InspectEntry]) -> int:
    """2 if any capture is invalid, else 1 if any warning (metadata or series), else 0."""
    return max((e.exit_code for e in entries), default=0)


def inspect_sparse(path: Any) -> InspectEntry:
    """One sparse capture's inspect entry; never raises: an unreadable one is invalid, in one line."""
    try:
        cap = read_sparse(path)
        tensors = {n: {"shape": list(t.shape), "dtype": dtype_name(t.dtype)} for n, t in cap.tensors().items()}
        return InspectEntry(cap.path, MetadataReport(ok=True, warnings=list(cap.warnings)), meta=cap.meta.to_json(),
                            tensors=tensors, region=cap.region(), sparse=describe(cap))  # fmt: skip
    except CaptureError as e:
        return InspectEntry(str(path), MetadataReport.invalid(str(e)), error=str(e))
    except Exception as e:  # one bad file must not end the run
        err = str(CaptureError(path, "inspect", error_text(e)))
        return InspectEntry(str(path), MetadataReport.invalid(err), error=err)



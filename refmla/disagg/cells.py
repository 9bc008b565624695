"""One row's three answers, read off the documents the existing commands produce:

    transfer   the request's entry of the diff-kv of its first decode capture (refmla.diffkv)
    metadata   its metadata findings in each decode replay (refmla.checks, run by the replay), its
               series findings across decode steps (refmla.series), the region checks (refmla.region_check)
    decode     its rows in each decode replay (refmla.pipeline): per backend pass / fail for this
               request, then refmla.diagnosis on those statuses
"""

from __future__ import annotations

from typing import Optional

from refmla.blame import blames_request
from refmla.diagnosis import Diagnosis, diagnose
from refmla.diffkv import RequestDiff
from refmla.disagg.report import DecodeCell, MetadataCell, TransferCell
from refmla.region_check import STATUSES, RegionCheck
from refmla.results import BackendEntry, Finding, ReplayReport


def transfer_cell(entry: Optional[RequestDiff], why: str = "", caches: Optional[dict] = None) -> TransferCell:
    """The request's diff-kv entry as a cell; ``None``: not paired (``why``). ``caches`` (a sparse
    pair): cache name -> (its diff-kv ``caches`` entry: label, ratio, ...; that cache's entry of the
    request); ``entry`` is the first mismatching one's."""
    cell = _transfer_cell(entry, why)
    if caches:
        info = caches[entry.cache][0]
        cell.cache, cell.cache_label, cell.ratio = entry.cache, info["label"], info.get("ratio")
        cell.caches = {name: {"label": i["label"], "status": e.status, "positions_compared": e.positions_compared,
                              "mismatched_positions": e.mismatched_positions, "first_mismatch": e.first_mismatch,
                              "first_page": e.first_page} for name, (i, e) in caches.items()}  # fmt: skip
        if cell.status == "faithful":  # every cache faithful: the positions of all of them
            cell.positions_compared = sum(e.positions_compared for _, e in caches.values())
    return cell


def _transfer_cell(entry: Optional[RequestDiff], why: str = "") -> TransferCell:
    if entry is None:
        return TransferCell("not_paired", note=why or "no prefill capture holds this rid")
    if not entry.paired:
        return TransferCell("not_paired", note=entry.note or entry.status)
    cell = TransferCell("faithful" if entry.faithful else "mismatch", entry.positions_compared,
                        entry.mismatched_positions, entry.first_mismatch, entry.first_page,
                        list(entry.mismatched_pages)[:64], summary=entry.summary, note=entry.note)  # fmt: skip
    if entry.reuse is not None:
        cell.reuse = entry.reuse.to_json()
    if entry.mismatches is not None:
        cell.decode_zero_rows, cell.sections = entry.mismatches.decode_zero_rows, entry.mismatches.sections
    run = entry.first_run
    if run is not None:
        cell.run = run.to_json()
    if entry.sources:  # where the mismatched rows' bytes are in the prefill captures
        cell.sources = [src.text(entry.rid) for src in entry.sources[:4]]
        cell.offset = entry.sources[0].shift
        other = next((src.rid for src in entry.sources if not src.same_request), None)
        cell.source_rid = other
    return cell


def request_index(report: ReplayReport, rid: str) -> Optional[int]:
    rids = (report.meta.rids if report.meta else None) or []
    return rids.index(rid) if rid in rids else None


def metadata_cell(rid: str, reports: list[ReplayReport], series: dict[str, list[Finding]],
                  regions: list[tuple[str, RegionCheck]]) -> MetadataCell:  # fmt: skip
    """The request's metadata and series findings in its decode captures; the worst region check."""
    cell = MetadataCell()
    for rep in reports:
        for f in [*rep.metadata.findings, *series.get(rep.capture, [])]:
            if f.rid != rid:
                continue
            (cell.problems if f.severity in ("warning", "error") else cell.notes).append((rep.capture, f))
    for path, check in regions:  # STATUSES is ordered worst first
        if cell.region is None or STATUSES.index(check.status) < STATUSES.index(cell.region.status):
            cell.region, cell.region_capture = check, path
    return cell


def request_statuses(report: ReplayReport, b: int) -> dict[str, str]:
    """Each backend's status for request ``b`` alone: a failing backend passes a request whose
    (row, head) errors are all within their allowance."""
    return {name: _status_for(entry, b) for name, entry in report.backends.items()}


def _status_for(entry: BackendEntry, b: int) -> str:
    """Decode: row b is request b; the failing part's own rows decide (refmla.blame); an index set's
    entry (the indexer beside a sparse decode): the requests whose set is wrong."""
    if entry.status != "fail":
        return entry.status
    sets = entry.info.get("index_sets")
    if sets is not None:
        return "fail" if b in sets.get("failing_requests", []) else "pass"
    return "fail" if blames_request(entry, b) else "pass"


def _indexer_diagnosis(report: ReplayReport, b: int) -> Diagnosis:
    """``upstream_indexer`` for request b: its own verdict of the index set the decode read."""
    entry = report.backends["indexer"]
    mine = [v for v in entry.info["index_sets"].get("failing", []) if v.get("request") == b]
    said = f"{mine[0]['n_missing']} entries missing, {mine[0]['n_extra']} that should not be there" if mine else "its set is wrong"
    decode = "the decode agrees over the entries it was handed" if report.backends.get("observed") is None or \
        report.backends["observed"].status == "pass" else "the decode diverges too"
    return Diagnosis("upstream_indexer", f"the indexer chose the wrong entries for this request ({said}; {decode})", ["indexer"])


def _explanation(report: ReplayReport, b: int, failing: list[str]) -> Optional[str]:
    for name in failing:
        e = report.backends[name].explanation
        if e is None:
            continue
        others = [x.get("request") for x in e.extra.get("requests", [])]
        if e.request == b or b in others or e.extra.get("scope") == "all requests":
            return f"{name}: {e.text()}"
    return None


def decode_cell(rid: str, reports: list[ReplayReport]) -> DecodeCell:
    """The request over its decode captures: the first step where a path diverges for it, diagnosed."""
    cell = DecodeCell("not_replayed")
    for rep in reports:
        b = request_index(rep, rid)
        if rep.verdict == "invalid":
            cell.verdict, cell.diagnosis, cell.capture = "invalid", "metadata", rep.capture
            cell.diagnosis_text = rep.error or "; ".join(rep.metadata.errors)
            return cell
        if b is None:
            continue
        statuses = request_statuses(rep, b)
        cell.steps += 1
        failing = [n for n, s in statuses.items() if s == "fail"]
        if failing or any(s == "error" for s in statuses.values()):
            cell.diverged_steps += 1
            if cell.verdict != "diverged":
                produced_by = rep.meta.backend if rep.meta else None
                d = _indexer_diagnosis(rep, b) if statuses.get("indexer") == "fail" else diagnose(statuses, produced_by=produced_by)
                cell.diagnosis, cell.diagnosis_text = d.name, d.text
                cell.verdict, cell.backends, cell.capture = "diverged", statuses, rep.capture
                cell.step = rep.meta.step if rep.meta else None
                cell.explanation = _explanation(rep, b, failing)
        elif cell.verdict == "not_replayed":
            cell.verdict, cell.backends, cell.capture = "agree", statuses, rep.capture
            cell.step, cell.diagnosis_text = (rep.meta.step if rep.meta else None), diagnose(statuses).text
    return cell

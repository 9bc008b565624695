"""One chunked-prefill capture judged link by link, as the shared :class:`refmla.results.ReplayReport`
(``kind`` / ``mode`` ``chunked_prefill``), backends by name:

    reference    the fp64 truth
    observed     the merged output (and lse) against the whole row: fp64 attention of each row over
                 its request's every prefix key and its causal new keys at once; the control every
                 piece's control merged step by step in fp32 (refmla.merge.mha.chained_control)
    new_tokens   the new tokens' piece against fp64 causal attention over their own keys
    chunk_I      chunk I's piece against fp64 attention over its keys (an empty chunk: out 0; its
                 lse is the merge's to judge)
    merge_I      merge step I (chunk I into what was merged before) against the fp64 merge of the
                 recorded pieces (refmla.merge.judge.merge_entry, with the merge hypotheses)

A failing piece is explained by refmla.merge.chunked_hypotheses (which request, rows, heads), a
failing merge by refmla.merge.hypotheses. The diagnosis names the first broken link:
``chunked_piece`` (a piece's attention), ``merge`` (a merge step), or ``chunked_row`` (every link
agrees yet the merged output is not the whole row: the chunks do not tile the prefix).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from refmla.compare import Comparison, Tolerance, compare
from refmla.merge.chunked_format import MODE, ChunkedCapture
from refmla.merge.chunked_hypotheses import explain_piece, label
from refmla.merge.format import MergeCapture, MergeMeta
from refmla.merge.judge import REFERENCE, lse_check, merge_entry
from refmla.merge.mha import chained_control, in_base, piece, whole_row
from refmla.merge.reference import control, reference
from refmla.results import BackendEntry, Finding, MetadataReport, NoiseFloor, ReplayReport, Shape
from refmla.util import dtype_name


def _where(cap: ChunkedCapture, c: Comparison) -> tuple[list[int], dict]:
    """The failing requests and, per request, its failing heads (from the output's rows)."""
    failed = c.row_failed if c.row_failed is not None else torch.zeros(cap.q.shape[:2], dtype=torch.bool)
    heads: dict[int, list[int]] = {}
    for b in range(cap.requests):
        h = failed[cap.qo[b]:cap.qo[b + 1]].any(0).nonzero()[:, 0].tolist()
        if h:
            heads[b] = h
    return sorted(heads), heads


def merge_step(cap: ChunkedCapture, i: int) -> MergeCapture:
    """Merge step i as a merge capture: chunk i (a) into what was merged before (b)."""
    before, after = cap.before(i), cap.step(i)
    meta = MergeMeta(mode="merge", merger=cap.meta.merger, lse_base=cap.meta.lse_base, layer_id=cap.meta.layer_id)
    return MergeCapture(path=cap.path, meta=meta, out_a=cap.chunk_out[i], lse_a=cap.chunk_lse[i], out_b=before[0],
                        lse_b=before[1], out=after[0], lse=after[1], len_a=cap.row_lens(i).int(),
                        len_b=cap.accumulated_lens(i).int())  # fmt: skip


def _piece_entry(cap: ChunkedCapture, which: int, tol: Tolerance, explain: bool) -> BackendEntry:
    t0 = time.perf_counter()
    got, lse = (cap.new_out, cap.new_lse) if which < 0 else (cap.chunk_out[which], cap.chunk_lse[which])
    ref, ctl = piece(cap, which), piece(cap, which, got.dtype)
    name, base = label(which), cap.meta.lse_base
    c = compare(name, got, ref[0], ctl[0], tol=tol, request_of_row=cap.request_of_row)
    lens = cap.row_lens(which) if which >= 0 else torch.ones(cap.q.shape[0], dtype=torch.long)
    keyed = (lens > 0)[:, None].expand_as(lse)  # an empty chunk's lse is judged at its merge
    want = in_base(ref[1], base)
    entry = BackendEntry.judged(c, info={"piece": "new" if which < 0 else "chunk", "chunk": None if which < 0 else which,
                                         "causal": "bottom_right" if which < 0 else None,
                                         "keys": (cap.extend_lens if which < 0 else cap.chunk_lens[which]).tolist()})  # fmt: skip
    entry.lse = lse_check(torch.where(keyed, lse.double(), want), want, in_base(ctl[1].double(), base), tol,
                          cap.request_of_row)  # fmt: skip
    entry.judge_parts()
    out_failed, heads = _where(cap, c)
    if entry.status == "fail":
        entry.info.update(failed_requests=sorted(set(out_failed) | set(entry.lse.failed_requests or [])),
                          rows={str(b): [cap.qo[b], cap.qo[b + 1] - 1] for b in out_failed}, heads={str(b): h for b, h in heads.items()})  # fmt: skip
        if explain:
            entry.explanation = explain_piece(cap, which, got, lse, out_failed, entry.lse.failed_requests or [], tol, heads)
    entry.seconds = round(time.perf_counter() - t0, 3)
    return entry


def _merge_entry(cap: ChunkedCapture, i: int, tol: Tolerance, explain: bool) -> BackendEntry:
    m = merge_step(cap, i)
    info = {"step": i, "chunk": i, "into": "new_tokens" if i == 0 else f"merge_{i - 1}", "merger": cap.meta.merger,
            "empty_rows": int((cap.row_lens(i) == 0).sum())}  # fmt: skip
    entry = merge_entry(f"merge_{i}", m, m.out, m.lse, reference(m), control(m), tol, explain, info, cap.request_of_row)
    if entry.status == "fail" and entry.comparison is not None and entry.comparison.row_failed is not None:
        rows = entry.comparison.row_failed.any(1).nonzero()[:, 0]
        info["failed_requests"] = sorted({int(b) for b in cap.request_of_row[rows]} | set(entry.lse.failed_requests or []))
    return entry


def _gaps(cap: ChunkedCapture) -> list[Finding]:
    return [Finding("chunk_coverage", "warning", f"request {g['request']}: prefix positions {g['start']}-{g['end'] - 1} "
                    f"{'in no chunk (never attended)' if g['what'] == 'uncovered' else 'in two chunks (attended twice)'}",
                    request=g["request"], numbers={"start": g["start"], "end": g["end"], "what": g["what"]})
            for g in cap.coverage_gaps()]  # fmt: skip


def _link_text(name: str, e: BackendEntry, cap: ChunkedCapture) -> str:
    why = f"; {e.explanation.text()}" if e.explanation is not None else "; no simple mistake reproduces it"
    if name.startswith("merge_"):
        i = int(name.split("_")[1])
        into = "the new tokens' piece" if i == 0 else f"merge step {i - 1}'s output"
        return f"merge step {i} (chunk {i} into {into}, {cap.meta.merger}) differs from the fp64 merge: {e.reason}{why}"
    what = "the new tokens' causal attention" if name == "new_tokens" else f"chunk {name.split('_')[1]}'s attention"
    where = ", ".join(f"request {b} rows {r[0]}-{r[1]} heads {_span(e.info['heads'].get(b, []))}"
                      for b, r in (e.info or {}).get("rows", {}).items())  # fmt: skip
    return f"{what} differs from fp64 attention over its keys ({where or 'lse only'}): {e.reason}{why}"


def _span(heads: list[int]) -> str:
    return f"{heads[0]}-{heads[-1]}" if len(heads) > 1 and heads == list(range(heads[0], heads[-1] + 1)) else ",".join(map(str, heads))


def judge_chunked(cap: ChunkedCapture, opts: Any = None) -> ReplayReport:
    """The report of a readable capture; ``opts`` a ReplayOptions (tol, explain)."""
    tol: Tolerance = getattr(opts, "tol", Tolerance())
    explain = getattr(opts, "explain", True)
    T, H, Dq = cap.q.shape
    ref, ctl = whole_row(cap), chained_control(cap)
    findings = [Finding("chunked_prefill", "warning", w) for w in cap.warnings] + _gaps(cap)
    obs = BackendEntry.judged(compare("observed", cap.out, ref[0], ctl[0], tol=tol, request_of_row=cap.request_of_row),
                              info={"attention": cap.meta.attention, "merger": cap.meta.merger, "what": "the whole row"})  # fmt: skip
    obs.lse = lse_check(cap.lse, ref[1], ctl[1], tol, cap.request_of_row)
    obs.judge_parts()
    entries = {"reference": REFERENCE, "observed": obs}
    for which in range(-1, cap.chunks):
        entries[label(which)] = _piece_entry(cap, which, tol, explain)
    for i in range(cap.chunks):
        entries[f"merge_{i}"] = _merge_entry(cap, i, tol, explain)
    c = compare("control", ctl[0], ref[0])
    shape = Shape(requests=cap.requests, rows=T, heads=H, head_dim=Dq, v_head_dim=int(cap.out.shape[-1]),
                  q_dtype=dtype_name(cap.q.dtype), kv_dtype=dtype_name(cap.chunk_k.dtype),
                  max_seq_len=int((cap.prefix_lens + cap.extend_lens).max()), dims={"chunks": cap.chunks})  # fmt: skip
    report = ReplayReport(capture=cap.path, verdict="agree", diagnosis=None, mode=MODE, kind=MODE, meta=cap.meta,  # type: ignore[arg-type]
                          metadata=MetadataReport(ok=True, warnings=[f.message for f in findings], findings=findings),
                          backends=entries, tolerance=tol, shape=shape, diagnosis_backends=[],
                          control=NoiseFloor(dtype_name(cap.out.dtype), c.max_abs_err, c.cos_diff))  # fmt: skip
    bad = [n for n, e in entries.items() if e.status in ("fail", "error")]
    gaps = [f for f in findings if f.check == "chunk_coverage"]
    if not bad and not gaps:
        report.diagnosis_text = (f"the chunked-prefix prefill agrees: {cap.chunks} chunk(s) and the new tokens' piece each with "
                                 f"fp64 attention over its keys, every merge with the fp64 merge, the merged output with the whole row")  # fmt: skip
        return report
    report.verdict = "diverged"
    links = [n for n in bad if n != "observed"]
    pieces = [n for n in links if not n.startswith("merge_")]
    first = pieces[0] if pieces else (links[0] if links else None)
    report.diagnosis_backends = bad
    if first is not None:
        report.diagnosis = "chunked_piece" if pieces else "merge"
        report.diagnosis_text = _link_text(first, entries[first], cap)
        if obs.status == "fail" and obs.explanation is None:
            obs.explanation = entries[first].explanation
        rest = [n for n in links if n != first]
        if rest:
            report.diagnosis_text += f" (also failing: {', '.join(rest)})"
    else:
        report.diagnosis = "chunked_row"
        why = "; ".join(f.message for f in gaps) or obs.reason
        report.diagnosis_text = ("every piece agrees with fp64 attention over its keys and every merge with the fp64 merge, "
                                 f"yet the merged output is not the whole row: {why}")  # fmt: skip
    return report


__all__ = ["judge_chunked", "merge_step"]

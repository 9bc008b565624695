"""A context-parallel step judged as one call: the fp64 reference over each request's whole
context, each rank's partial output on its shard (the reference restricted to the positions the
geometry gives it), each rank's combined heads as a merge of the recorded partials.

The control of each comparison is the same math in fp32 rounded to the recorded dtype (the one
comparator, refmla.compare); a failure is explained by refmla.cp.hypotheses.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

from refmla.capture import CaptureError
from refmla.compare import Tolerance, compare, judge_lse
from refmla.cp.hypotheses import attend_rows, explain_combine, explain_rank, merged
from refmla.merging import LN2
from refmla.cp.result import CombineEntry, CpReport, RankEntry
from refmla.cp.step import CpStep, read_step, steps_in


def replay_step(folder: Any, tol: Tolerance = Tolerance()) -> CpReport:
    """The report of the step in ``folder``; never raises for bad input (verdict ``invalid``)."""
    try:
        step = read_step(folder)
        return judge(step, tol)
    except CaptureError as e:
        return CpReport(str(folder), "invalid", error=str(e))


def replay_folder(folder: Any, tol: Tolerance = Tolerance()) -> list[CpReport]:
    """One report per step in ``folder`` (its captures grouped by layer and step, refmla.cp.step.steps_in);
    one ``invalid`` report when the folder or a capture in it cannot be read."""
    try:
        groups = steps_in(folder)
    except CaptureError as e:
        return [CpReport(str(folder), "invalid", error=str(e))]
    reports = []
    for label, caps in groups:
        try:
            reports.append(judge(read_step(folder, caps, label), tol))
        except CaptureError as e:
            reports.append(CpReport(label, "invalid", error=str(e)))
    return reports


def shard_attention(step: CpStep, r: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank r's attention over its shard, every request: out [B, H, Dv], lse [B, H] in ``dtype``."""
    cap = step.ranks[r]
    pool, sc = cap.kv_buffer[:, 0], cap.scales()
    parts = [attend_rows(cap.q[b], pool.index_select(0, rows), sc, dtype) for b, rows in enumerate(step.shard[r])]
    return torch.cat([o for o, _ in parts]), torch.cat([l for _, l in parts])


def judge(step: CpStep, tol: Tolerance) -> CpReport:
    report = CpReport(step.folder, "agree", step.world, step.interleave, int(step.total.numel()))
    report.findings = list(step.findings)
    named = {(f.rank, f.request) for f in report.findings if f.hypothesis == "cp_local_length"}
    for r in range(step.world):
        if r not in step.ranks:
            report.ranks.append(RankEntry(r, None, "absent", note="no capture of this rank"))
            continue
        report.ranks.append(_judge_rank(step, r, tol, report, named))
    report.combine = _judge_combine(step, tol, report)
    if report.findings or any(e.status == "fail" for e in report.ranks) or report.combine.status == "fail":
        report.verdict = "diverged"
    return report


def _judge_rank(step: CpStep, r: int, tol: Tolerance, report: CpReport, named: set) -> RankEntry:
    cap = step.ranks[r]
    entry = RankEntry(r, cap.path, "unjudged")
    if cap.out is None:
        entry.note = "no out recorded"
        return entry
    want, want_lse = shard_attention(step, r, torch.float64)
    ctl, ctl_lse = shard_attention(step, r, torch.float32)
    held = _held(step, r)  # an empty shard's row is not judged: the combine masks it (lse -inf)
    c = compare(f"rank {r}", cap.out, want, ctl.to(cap.out.dtype), tol=tol, row_mask=held)
    entry.comparison = c.to_json()
    bad = c.row_failed.any(-1) if c.row_failed is not None else held.clone()
    if cap.lse is not None:
        lj = judge_lse(lse_ln(cap), want_lse, ctl_lse, k=tol.k)
        entry.lse_bad = int((lj.bad & held[:, None]).sum())
        bad = bad | (lj.bad.any(-1) & held)
    entry.status = "fail" if bool(bad.any()) or not c.passed else "pass"
    for b in torch.nonzero(bad).flatten().tolist():
        f = explain_rank(step, r, b, tol)
        if f is None:
            entry.note = (entry.note + " " if entry.note else "") + f"request {b}: no context-parallel mistake reproduces it"
        elif not (f.hypothesis == "cp_local_length" and (r, b) in named):  # the metadata named it already
            report.findings.append(f)
    return entry


def _judge_combine(step: CpStep, tol: Tolerance, report: CpReport) -> CombineEntry:
    """Each rank's dcp_out (its heads of the combine) against the fp64 merge of the ranks' recorded
    partials; and the whole combine against the whole-context reference when every rank passed."""
    caps = step.ranks
    if step.missing() or any(c.dcp_out is None or _in_lse(c) is None or _in_out(c) is None for c in caps.values()):
        return CombineEntry("unjudged", note="the combine needs every rank's out, lse and dcp_out")
    outs = torch.stack([_in_out(caps[r]) for r in range(step.world)]).double()  # [W, B, H, Dv]
    lses = torch.stack([lse_ln(caps[r], _in_lse(caps[r])) for r in range(step.world)])  # [W, B, H] natural
    empty = ~torch.stack([_held(step, r) for r in range(step.world)])  # [W, B] as vLLM masks them:
    outs, lses = outs.masked_fill(empty[..., None, None], 0.0), lses.masked_fill(empty[..., None], -math.inf)
    want, ctl = merged(outs, lses, "ln", torch.float64), merged(outs, lses, "ln", torch.float32)
    terms = EACH_RANK_TERMS.get(step.any.meta.extra.get("dcp_combine"))
    if terms is not None:  # the combine's own rounding points: each rank's term, then their sum
        ctl = merged_each_rank_rounded(outs, lses, step.any.dcp_out.dtype if terms == "out" else torch.float32)
    Hr = caps[0].dcp_out.shape[1]
    status, worst = "pass", None
    for r in range(step.world):
        heads = slice(r * Hr, (r + 1) * Hr)
        got = caps[r].dcp_out
        c = compare(f"combine on rank {r}", got, want[:, heads], ctl[:, heads].to(got.dtype), tol=tol)
        if worst is None or not c.passed:
            worst = c.to_json()
        if not c.passed:
            status = "fail"
            f = explain_combine(step, r, outs, lses, heads, tol)
            if f is not None and not any(g.hypothesis == f.hypothesis and g.rank == f.rank for g in report.findings):
                report.findings.append(f)
    entry = CombineEntry(status, worst)
    if status == "pass" and all(e.status == "pass" for e in report.ranks) and not step.short:
        whole = _whole_reference(step)
        got = torch.cat([caps[r].dcp_out for r in range(step.world)], dim=1)
        c = compare("combine vs whole context", got, whole, ctl.to(got.dtype), tol=tol)
        entry.note = "the whole-context reference: " + ("pass" if c.passed else "FAIL")
        if not c.passed:
            entry.status = "fail"
    return entry


# the combines that scale each rank's partial and sum the terms across ranks (meta dcp_combine), and
# the dtype each term and the sum are held in: vLLM's in the output dtype, SGLang's MHA-style in fp32
EACH_RANK_TERMS = {"cp_lse_ag_out_rs": "out", "cp_lse_ag_out_ar": "out", "cp_lse_ag_out_rs_mha": "fp32"}


def merged_each_rank_rounded(outs: torch.Tensor, lses: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The combine at its rounding points (vLLM's ``cp_lse_ag_out_rs``, SGLang's
    ``cp_lse_ag_out_rs_mha``): each rank's partial scaled by exp(lse - the fp32 logsumexp) and held
    in ``dtype``, then the ranks' terms summed (the reduce-scatter / all-reduce) in ``dtype``, rank by
    rank. outs [W, B, H, Dv], lses [W, B, H] natural."""
    lse = lses.float()
    top = lse.amax(0)
    m = torch.where(torch.isinf(top), 0.0, top)
    total = torch.log(torch.exp(lse - m).sum(0)) + m  # [B, H]
    factor = torch.exp((lse - total).nan_to_num(nan=-math.inf))  # [W, B, H]; 0 for an empty shard
    terms = torch.where(factor[..., None] == 0, 0.0, outs.float() * factor[..., None]).to(dtype)
    acc = terms[0]
    for t in terms[1:]:
        acc = (acc.float() + t.float()).to(dtype)
    return acc.float()


def _in_out(cap) -> Optional[torch.Tensor]:
    """The partial out the combine was handed (``dcp_in_out`` where recorded, else the rank's ``out``)."""
    return cap.dcp_in_out if cap.dcp_in_out is not None else cap.out


def _in_lse(cap) -> Optional[torch.Tensor]:
    return cap.dcp_in_lse if cap.dcp_in_lse is not None else cap.lse


def lse_ln(cap, lse: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The rank's lse (or ``lse``, another of its lses) in natural log, fp64, from the base its
    producer documents (meta ``lse_base``: ``ln`` by default, ``log2`` for kernels that return it
    so, vLLM's ``lse_base_on_e`` False)."""
    lse = (cap.lse if lse is None else lse).double()
    return lse * LN2 if cap.meta.extra.get("lse_base") == "log2" else lse


def _held(step: CpStep, r: int) -> torch.Tensor:
    """[B] bool: the requests of which rank r holds at least one position."""
    return torch.tensor([rows.numel() > 0 for rows in step.shard[r]], dtype=torch.bool)


def _whole_reference(step: CpStep) -> Optional[torch.Tensor]:
    """out [B, H, Dv] fp64 of attention over each request's whole context."""
    cap = step.any
    sc = cap.scales()
    return torch.cat([attend_rows(cap.q[b], step.whole(b), sc, torch.float64)[0] for b in range(cap.q.shape[0])])


__all__ = ["judge", "replay_folder", "replay_step", "shard_attention"]

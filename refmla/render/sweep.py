"""A sweep report (refmla.sweep.report.SweepReport) as text: per backend a row per check, then
each finding with its shrunk case, its capture, the replay command and the triggering axis."""

from __future__ import annotations

from refmla.render.table import clip, table
from refmla.sweep.report import NOT_RUN, STATUSES, SweepReport


# the shrunk case's parameters a finding shows (dense: GoldenCase / TableCase; sparse: SparseSweepCase)
SHAPE_KEYS = ("cache", "seq_lens", "num_heads", "page_size", "num_kv_splits", "kv_dtype", "logit_cap",
              "draft_token_num", "table", "null", "topk", "sink", "topk_length")


def render_sweep(rep: SweepReport) -> str:
    cpm = rep.cases_per_minute
    pairs = ", ".join(f"{layout} {c}/{t} value pairs" for layout, (c, t) in rep.pairs.items()) or "no layout"
    lines = [f"refmla sweep: {len(rep.cases)} cases in {rep.walk_seconds:.0f} s (budget {rep.budget:g} s, seed "
             f"{rep.seed}, {cpm:.1f} cases/min), shrinking {rep.shrink_seconds:.0f} s; covered {pairs}"
             if cpm is not None else f"refmla sweep: no case ran (budget {rep.budget:g} s)"]  # fmt: skip
    if rep.bounds:
        lines.append("bounds walked: " + ", ".join(f"{k} {v}" for k, v in rep.bounds.items()))
    if rep.not_started or rep.cut_off:
        unstarted = sum(rep.not_started.values())
        lines.append(f"budget: {unstarted} point(s) not started (predicted past what was left), {rep.cut_off} case(s) "
                     f"cut off at its deadline (their unfinished checks: {NOT_RUN}, neither a pass nor a finding)")
    if rep.not_walked:
        lines.append(f"layouts not walked yet: {', '.join(rep.not_walked)}")
    for name, b in rep.backends.items():
        lines.append("")
        if not b.available:
            lines.append(f"{name}: unavailable: {b.reason}")
            continue
        total = b.kernel_seconds + b.reference_seconds
        share = f"{100 * b.reference_seconds / total:.0f}%" if total else "n/a"
        unrun = rep.asked and b.not_run and not b.findings
        verdict = "FAIL" if not b.passed else "DID NOT RUN on " + ", ".join(b.not_run) if unrun else "PASS"
        lines.append(f"{name}: {b.cases} cases, kernel {b.kernel_seconds:.1f} s, reference {b.reference_seconds:.1f} s "
                     f"({share} of the time) -- {verdict}")  # fmt: skip
        shown = [s for s in STATUSES if s != NOT_RUN or any(NOT_RUN in per for per in b.counts.values())]
        rows = [[check] + [str(per.get(s, 0)) for s in shown] for check, per in b.counts.items()]
        if rows:
            lines.append(table(rows, ["check", *shown]))
        for layout, why in b.skipped_layouts.items():
            said = "did not run" if layout in b.not_run else "not taken"
            lines.append(f"  {layout}: {said} ({clip(why, 100)})")
        for f in b.findings:
            lines.append(f"  FINDING {name} {f.check}: {f.failing_cases} failing case(s), first {f.layout} #{f.first_case}")
            lines.append(f"    {clip(f.detail, 200)}")
            if f.trigger:
                lines.append(f"    {f.trigger.text()}")
            if f.shrunk:
                shape = {k: f.shrunk[k] for k in SHAPE_KEYS if k in f.shrunk}
                lines.append(f"    shrunk ({len(f.shrink_steps)} steps): {shape}")
            if f.shrunk_detail:
                lines.append(f"    {clip(f.shrunk_detail, 200)}")
            if f.capture:
                lines.append(f"    capture: {f.capture} (replay: {f.replay_verdict})")
                lines.append(f"    {f.replay_command}")
    return "\n".join(lines)


__all__ = ["render_sweep"]

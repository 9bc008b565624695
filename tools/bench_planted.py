"""The diagnosis measured on faults refmla did not plant: tools/planting.py writes each faulty
output with its own attention loop (never refmla's reference, control or search), the replay
(reference + observed) judges it, and each case is one of

    named           the explanation (or one of its alternatives) names the planted hypothesis
                    with the planted detail (the final lse's units: the localization's cause)
    wrong           the explanation names another hypothesis, completely, and not the planted one
    localized-only  not named nor wrongly explained, but the localization names the planted request(s)
    unexplained     neither (the replay still diverges)
    below noise     the replay agrees (the plant, not the diagnosis, needs fixing)
    n/a             a rounding fault (MAY_AGREE: P.V accumulated in bf16) that stays within the tolerance
    false alarm     a clean output (planting.attention with no fault) that does not agree

    python tools/bench_diagnosis.py --independent            # Kimi-K2 / DeepSeek-V3 TP8, pages 1, 64, 256
    python tools/bench_diagnosis.py --independent --quick    # 4 heads, 4 short requests, pages 1 and 64
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import planting  # noqa: E402

from refmla.capture import read_capture, write_capture  # noqa: E402
from refmla.context import ReplayOptions  # noqa: E402
from refmla.batch import replay_many  # noqa: E402
from refmla.pipeline import replay_capture  # noqa: E402
from refmla.series import attach_series  # noqa: E402
from refmla.synthetic import make_inputs, make_meta, preset  # noqa: E402

FULL = {"kimi-k2-tp8 page 1": ("kimi-k2-tp8", {}), "kimi-k2-tp8 page 256": ("kimi-k2-tp8-page256", {}),
        "deepseek-v3-tp8 page 64": ("deepseek-v3-tp8", {}), "deepseek-v3-tp8 page 1": ("deepseek-v3-tp8", {"page_size": 1})}  # fmt: skip
SMALL = {"num_heads": 4, "seq_lens": (300, 200, 420, 150)}
QUICK = {"kimi-k2-tp8 page 1": ("kimi-k2-tp8", SMALL), "deepseek-v3-tp8 page 64": ("deepseek-v3-tp8", SMALL)}


# plants whose detail must be the explanation's own (another setting of the same hypothesis that fits
# as well, an alternative, does not count; another hypothesis the contract lists as the same
# arithmetic, an other_cause, does: split_missing over a split that is the missing page)
OWN_DETAIL = {"page_missing_faint"}
# rounding faults that may stay within the tolerance on a preset: "agree" there is n/a, not a miss
MAY_AGREE = {"pv_accum_bf16"}


def _named(entry, hypothesis: str, want: dict, own: bool = False) -> bool:
    e, loc = entry.explanation, entry.localization
    if hypothesis == "lse_units":
        return loc is not None and loc.cause is not None and loc.cause["detail"] == want
    if e is None:
        return False
    per_request = [(e.hypothesis, x["detail"]) for x in e.extra.get("requests", [])]  # each request's own detail
    others = [(a.hypothesis, a.detail) for a in ([] if own else e.alternatives) + e.other_causes]
    return any(h == hypothesis and all(d.get(k) == v for k, v in want.items())
               for h, d in [(e.hypothesis, e.detail)] + per_request + others)  # fmt: skip


def judge(report, plant: str, b: int, want: dict) -> str:
    entry = report.backends["observed"]
    if plant == "none":
        return "agree" if report.verdict == "agree" else "false alarm"
    if report.verdict == "agree":
        return "n/a" if plant in MAY_AGREE else "below noise"
    hypothesis = planting.PLANTS[plant][1]
    if _named(entry, hypothesis, want, own=plant in OWN_DETAIL):
        return "named"
    e = entry.explanation
    if e is not None and e.complete:  # a whole explanation naming another cause
        return "wrong"
    hit = {0, 1} if plant == "rows_permuted" else {0, b} if plant == "kv_swapped" else {b}
    loc = entry.localization
    return "localized-only" if loc is not None and hit & set(loc.requests) else "unexplained"


def run_case(folder: Path, spec, plant: str) -> tuple[str, str, float]:
    t = make_inputs(spec)
    b = spec.fault_request
    if plant == "none":
        out, lse, detail = *planting.attention(t["q"], t["kv_buffer"], t["kv_indptr"], t["kv_indices"],
                                               spec.kv_lora_rank, spec.sm_scale), {}  # fmt: skip
    else:
        out, lse, detail = planting.PLANTS[plant][0](t, spec, b)
    t["out"] = out.to(spec.dtype)
    if plant in ("none", "lse_log2", "lse_ln"):
        t["lse"] = lse.float()
    path = folder / f"{plant}.safetensors"
    write_capture(path, t, make_meta(spec), compact=False)
    t0 = time.perf_counter()
    report = replay_capture(read_capture(path), ReplayOptions(backends=["reference"]))
    keys = planting.PLANTS[plant][2] if plant != "none" else ()
    entry = report.backends["observed"]
    said = entry.explanation.text() if entry.explanation else (entry.localization.text() if entry.localization else "-")
    return judge(report, plant, b, {k: detail[k] for k in keys}), said, time.perf_counter() - t0


def stale_case(folder: Path, spec, fault: bool) -> tuple[str, str, float]:
    """Two steps of one layer and rank: step 7 clean, step 8 clean (``fault`` False) or computed with
    step 7's metadata (planting.stale_metadata); replayed as ``refmla replay`` does a folder
    (replay_many, then the series: stale_metadata is named there)."""
    t = make_inputs(spec)
    prev = planting.previous_step(t)
    prev["out"] = planting.attention(prev["q"], prev["kv_buffer"], prev["kv_indptr"], prev["kv_indices"],
                                     spec.kv_lora_rank, spec.sm_scale)[0].to(spec.dtype)  # fmt: skip
    if fault:
        out, _, detail = planting.stale_metadata(t, spec, prev)
    else:
        out, _ = planting.attention(t["q"], t["kv_buffer"], t["kv_indptr"], t["kv_indices"], spec.kv_lora_rank, spec.sm_scale)
    t["out"] = out.to(spec.dtype)
    paths = []
    for step, tensors in ((7, prev), (8, t)):
        meta = make_meta(spec)
        meta["step"] = step
        meta.pop("num_kv_splits", None)
        paths.append(str(folder / f"step{step}.safetensors"))
        write_capture(paths[-1], tensors, meta, compact=False)
    opts = ReplayOptions(backends=["reference"])
    t0 = time.perf_counter()
    reports = replay_many(paths, opts)
    attach_series(reports, opts)
    secs = time.perf_counter() - t0
    rep = reports[1]
    entry = rep.backends["observed"]
    said = entry.explanation.text() if entry.explanation else (entry.localization.text() if entry.localization else "-")
    if not fault:
        return ("agree" if all(r.verdict == "agree" for r in reports) else "false alarm"), said, secs
    if rep.verdict == "agree":
        return "below noise", said, secs
    e = entry.explanation
    if e is not None and e.hypothesis == "stale_metadata" and e.detail.get("step") == detail["step"]:
        return "named", said, secs
    return ("wrong" if e is not None and e.complete else "unexplained"), said, secs


def independent_main(quick: bool) -> int:
    configs = QUICK if quick else FULL
    tally: Counter = Counter()
    with tempfile.TemporaryDirectory() as tmp:
        for label, (name, over) in configs.items():
            spec = preset(name, **over)
            for plant in ("none", *planting.PLANTS):
                outcome, said, secs = run_case(Path(tmp), spec, plant)
                tally[outcome] += 1
                print(f"{label:24s} {plant:16s} {outcome:15s} {secs:6.1f}s  {said[:110]}", flush=True)
            for fault in (False, True):  # two steps of a series: stale_metadata
                outcome, said, secs = stale_case(Path(tmp), spec, fault)
                tally[outcome] += 1
                name = "stale_metadata" if fault else "none (2 steps)"
                print(f"{label:24s} {name:16s} {outcome:15s} {secs:6.1f}s  {said[:110]}", flush=True)
    faults = sum(v for k, v in tally.items() if k not in ("agree", "false alarm", "n/a"))
    print(f"{tally['named']}/{faults} named, {tally['localized-only']} localized-only, {tally['unexplained']} "
          f"unexplained, {tally['wrong']} wrong, {tally['below noise']} below noise, "
          f"{tally['false alarm']} false alarms of {tally['agree'] + tally['false alarm']} clean, "
          f"{tally['n/a']} n/a (a rounding fault within the tolerance)")  # fmt: skip
    return 0 if tally["named"] == faults and not tally["false alarm"] else 1

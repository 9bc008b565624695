"""The launch-plan families of issue 31 named on faults planted by tools/planting.py (its own
attention loop, its own split schedule and merge: never refmla's reference, control or search):
heads folded and unfolded wrongly (folds 2, 4 and 8: mixed, transposed, zero, duplicated), a split
repeated, a split merged into another request, the partials read at another stride or written at
a wider one (aiter #3910), a split lse
overflowing without its max, P.V accumulated in bf16; and a missing page whose first quarter
carries no mass reported page-aligned. Small shapes (4 heads, 4 requests up to 420
tokens): tools/bench_diagnosis.py --independent runs them on the full presets."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tools"))

import bench_planted  # noqa: E402

import planting  # noqa: E402

from refmla.capture import read_capture, write_capture  # noqa: E402
from refmla.context import ReplayOptions  # noqa: E402
from refmla.pipeline import replay_capture  # noqa: E402
from refmla.synthetic import make_inputs, make_meta, preset  # noqa: E402

SMALL = preset("kimi-k2-tp8", **bench_planted.SMALL)  # 4 heads; request 2 has 3 splits
PAGED = preset("kimi-k2-tp8-page256", num_heads=4, seq_lens=(300, 200, 700, 150))

CASES = [(SMALL, p) for p in ("heads_folded_zero", "heads_folded_mixed", "heads_folded_transposed",
                               "heads_folded_duplicated", "split_repeated", "split_misrouted", "partials_misaddressed",
                               "partials_written_wide",
                               "split_lse_overflow")]
CASES.append((PAGED, "page_missing_faint"))
CASES.append((SMALL, "page_missing_faint"))  # page 1 is request 2's split 1 here: split_missing, the page under other_causes


@pytest.mark.parametrize("spec,plant", CASES, ids=[f"{s.name}-{p}" for s, p in CASES])
def test_planted_launch_fault_is_named_with_its_detail(tmp_path: Path, spec, plant):
    outcome, said, _ = bench_planted.run_case(tmp_path, spec, plant)
    assert outcome == "named", said


def test_a_fold_of_8_is_named_at_16_heads(tmp_path: Path):
    """128 -> 16 style: at DeepSeek-V3's 16 heads the planter folds 8x (pseudo-rows of 2 heads) and
    writes pseudo-row 0 back everywhere; named with that fold, not a smaller one."""
    spec = preset("deepseek-v3-tp8", seq_lens=bench_planted.SMALL["seq_lens"])
    assert spec.num_heads == 16
    outcome, said, _ = bench_planted.run_case(tmp_path, spec, "heads_folded_duplicated")
    assert outcome == "named" and "fold=8" in said, said


def test_pv_accumulated_in_bf16_is_numerics_when_the_other_path_passes(tmp_path: Path, monkeypatch):
    """Issue 31's held-out miss: a split kernel that accumulates P.V in bf16 (tools/planting.py's own
    blockwise loop) at DeepSeek-V3 TP8 page 64, where it leaves the tolerance (on the small shapes
    it stays inside), is named numerics(pv_accum_bf16), and with the extend path passing on the
    same inputs the diagnosis is numerics, not observed."""
    monkeypatch.setenv("REFMLA_EXTEND_IMPL", "torch")  # the pure-PyTorch extend: no interpreted kernel
    spec = preset("deepseek-v3-tp8")
    t = make_inputs(spec)
    out, _, detail = planting.pv_accum_bf16(t, spec, spec.fault_request)
    t["out"] = out.to(spec.dtype)
    path = tmp_path / "pv_accum_bf16.safetensors"
    write_capture(path, t, make_meta(spec), compact=False)
    report = replay_capture(read_capture(path), ReplayOptions(backends=["extend"]))
    observed = report.backends["observed"]
    assert observed.status == "fail" and report.backends["extend"].status == "pass", report.diagnosis_text
    e = observed.explanation
    assert e is not None and e.complete and e.hypothesis == "numerics" and e.detail == detail, e and e.text()
    assert report.diagnosis == "numerics" and "pv_accum_bf16" in report.diagnosis_text, report.diagnosis_text


def test_a_clean_output_agrees(tmp_path: Path):
    outcome, said, _ = bench_planted.run_case(tmp_path, SMALL, "none")
    assert outcome == "agree", said


@pytest.mark.parametrize("fault", [False, True], ids=["clean-steps", "stale-metadata"])
def test_a_graph_replayed_with_the_previous_steps_metadata_is_named_from_the_series(tmp_path: Path, fault):
    """Two steps of one layer and rank, replayed as a folder: step 8's output computed with step 7's
    indptr / indices / split counts is stale_metadata(step=7); two clean steps agree."""
    outcome, said, _ = bench_planted.stale_case(tmp_path, SMALL, fault)
    assert outcome == ("named" if fault else "agree"), said


def test_a_faint_missing_page_that_is_a_whole_split_is_split_missing_with_the_page_as_another_cause(tmp_path: Path):
    """At SMALL, page 1 is request 2's split 1: the faint missing page reads as that split missing
    (the primary), and the page's own range is kept under other_causes, with its bounds."""
    from refmla.capture import read_capture

    outcome, said, _ = bench_planted.run_case(tmp_path, SMALL, "page_missing_faint")
    assert outcome == "named", said
    report = replay_capture(read_capture(tmp_path / "page_missing_faint.safetensors"), ReplayOptions(backends=["reference"]))
    e = report.backends["observed"].explanation
    assert e.hypothesis == "split_missing", e.text()
    ranges = [a.detail for a in e.other_causes if a.hypothesis == "kv_range_missing"]
    assert ranges and {"start", "end"} <= set(ranges[0]), e.text()

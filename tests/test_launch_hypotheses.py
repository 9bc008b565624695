"""The launch-plan families of issue 31 named on faults planted by tools/planting.py (its own
attention loop, its own split schedule and merge: never refmla's reference, control or search):
heads folded and unfolded wrongly, a split repeated, a split merged into another request, the
partials read at another stride, a split lse overflowing without its max; and a missing page whose
first quarter carries no mass reported page-aligned. Small shapes (4 heads, 4 requests up to 420
tokens): tools/bench_diagnosis.py --independent runs them on the full presets."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tools"))

import bench_planted  # noqa: E402

from refmla.synth import preset  # noqa: E402

SMALL = preset("kimi-k2-tp8", **bench_planted.SMALL)  # 4 heads; request 2 has 3 splits
PAGED = preset("kimi-k2-tp8-page256", num_heads=4, seq_lens=(300, 200, 700, 150))

CASES = [(SMALL, p) for p in ("heads_folded_zero", "heads_folded_mixed", "heads_folded_transposed", "split_repeated",
                               "split_misrouted", "partials_misaddressed", "split_lse_overflow")]
CASES.append((PAGED, "page_missing_faint"))


@pytest.mark.parametrize("spec,plant", CASES, ids=[f"{s.name}-{p}" for s, p in CASES])
def test_planted_launch_fault_is_named_with_its_detail(tmp_path: Path, spec, plant):
    outcome, said, _ = bench_planted.run_case(tmp_path, spec, plant)
    assert outcome == "named", said


def test_a_clean_output_agrees(tmp_path: Path):
    outcome, said, _ = bench_planted.run_case(tmp_path, SMALL, "none")
    assert outcome == "agree", said


@pytest.mark.parametrize("fault", [False, True], ids=["clean-steps", "stale-metadata"])
def test_a_graph_replayed_with_the_previous_steps_metadata_is_named_from_the_series(tmp_path: Path, fault):
    """Two steps of one layer and rank, replayed as a folder: step 8's output computed with step 7's
    indptr / indices / split counts is stale_metadata(step=7); two clean steps agree."""
    outcome, said, _ = bench_planted.stale_case(tmp_path, SMALL, fault)
    assert outcome == ("named" if fault else "agree"), said

"""The fault classes of issue 21 part 3, planted by tools/planting.py (its own attention loop,
never refmla's reference) on DeepSeek-V3 (page 64) and Kimi-K2 (page 1) TP8 shards, each named by
its hypothesis with its detail; the final lse in log2 units named by the localization."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import planting  # noqa: E402

from refmla.capture import read_capture, write_capture  # noqa: E402
from refmla.context import ReplayOptions  # noqa: E402
from refmla.replay import replay_capture  # noqa: E402
from refmla.synth import make_inputs, make_meta, preset  # noqa: E402

SPECS = {
    "deepseek-v3-tp8-page64": preset("deepseek-v3-tp8", num_heads=4, seq_lens=(300, 200, 420, 150)),
    "kimi-k2-tp8": preset("kimi-k2-tp8", num_heads=4, seq_lens=(300, 200, 420, 150)),
}
NAMED = ["seq_len_short", "newest_kv_zero", "pages_read_off", "other_rows_read", "rows_permuted"]


def replay_planted(tmp_path, spec_name: str, plant: str):
    spec = SPECS[spec_name]
    t = make_inputs(spec)
    fn, hypothesis, keys = planting.PLANTS[plant]
    out, lse, detail = fn(t, spec, spec.fault_request)
    t["out"] = out.to(spec.dtype)
    if plant.startswith("lse"):  # the others are judged on their out (an lse would fail too)
        t["lse"] = lse.float()
    path = tmp_path / f"{plant}.safetensors"
    write_capture(path, t, make_meta(spec), compact=False)
    report = replay_capture(read_capture(path), ReplayOptions(backends=["reference"]))
    return report.backends["observed"], hypothesis, {k: detail[k] for k in keys}


def _names(e) -> list[tuple[str, dict]]:
    return [(e.hypothesis, e.detail)] + [(a.hypothesis, a.detail) for a in e.alternatives + e.other_causes]


@pytest.mark.parametrize("spec_name", list(SPECS))
@pytest.mark.parametrize("plant", NAMED)
def test_each_class_is_named_with_its_detail(tmp_path, spec_name, plant):
    entry, hypothesis, want = replay_planted(tmp_path, spec_name, plant)
    if plant == "other_rows_read" and SPECS[spec_name].page_size == 1:
        pytest.skip("page_size 1: a 'page' is one row; other_rows_read searches pages of page_size > 1")
    assert entry.status == "fail" and entry.explanation is not None, entry.reason
    named = [(h, d) for h, d in _names(entry.explanation) if h == hypothesis]
    assert named, entry.explanation.text()
    assert any(all(d.get(k) == v for k, v in want.items()) for _, d in named), entry.explanation.text()


def test_newest_row_unwritten_is_offered_with_seq_len_off_by_minus_one(tmp_path):
    entry, _, _ = replay_planted(tmp_path, "kimi-k2-tp8", "newest_kv_zero")
    names = {h for h, _ in _names(entry.explanation)}
    assert "newest_kv_unwritten" in names and ("seq_len_off_by", {"delta": -1}) in _names(entry.explanation)


def test_final_lse_in_log2_units_is_named(tmp_path):
    entry, _, _ = replay_planted(tmp_path, "kimi-k2-tp8", "lse_log2")
    assert entry.failed_parts == ["lse"] and entry.comparison.passed
    loc = entry.localization
    assert loc.cause == {"hypothesis": "lse_units", "detail": {"units": "log2"}, "requests": [2]}
    assert "the final lse in log2 units" in loc.text()


def test_a_scale_applied_twice_says_so(tmp_path):
    entry, _, _ = replay_planted(tmp_path, "kimi-k2-tp8", "sm_scale_twice")
    e = entry.explanation
    assert e.hypothesis == "wrong_sm_scale" and "applied twice" in e.extra["why"], e.to_json()
    assert abs(e.detail["ratio"] - SPECS["kimi-k2-tp8"].sm_scale) < 1e-9

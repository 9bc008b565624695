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
NAMED = ["seq_len_short", "newest_kv_zero", "pages_read_off", "other_rows_read", "rows_permuted", "page_missing",
         "kv_zero_block"]


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


@pytest.mark.parametrize("spec_name", list(SPECS))
def test_a_missing_page_on_a_split_bound_names_both_causes(tmp_path, spec_name):
    """Page 1 = positions 64..127 = split 1 of the schedule: a page that never arrived and a split
    left out of the merge are the same arithmetic; both are named, the split first."""
    entry, _, _ = replay_planted(tmp_path, spec_name, "page_missing")
    e = entry.explanation
    assert e.hypothesis == "split_missing" and e.detail == {"split": 1}, e.text()
    assert [(a.hypothesis, a.detail, a.request) for a in e.other_causes] == [
        ("kv_range_missing", {"start": 64, "end": 128, "how": "dropped"}, 2)]
    assert e.to_json()["other_causes"][0]["detail"] == {"start": 64, "end": 128, "how": "dropped"}


def test_a_sub_page_zeroing_is_named_at_its_positions(tmp_path):
    """Positions 32..95 zeroed at page size 64 straddle pages 0 and 1: no whole-page range fits, so
    the range inside the pages is searched; the roundest range within noise is reported."""
    entry, _, _ = replay_planted(tmp_path, "deepseek-v3-tp8-page64", "kv_zero_block")
    e = entry.explanation
    assert e.hypothesis == "kv_range_missing" and (e.detail["start"], e.detail["end"]) == (32, 96), e.text()
    assert "zeroed" in e.detail["how"] and e.extra["granularity"].startswith("positions: no range of whole pages")


def test_a_single_row_of_another_request_is_found_at_page_size_1(tmp_path):
    """page_size 1: one position holding request 0's position 1 (each side alone moves the output
    by less than the row tolerance; the pair fails the cosine check): every pair is screened."""
    entry, _, want = replay_planted(tmp_path, "kimi-k2-tp8", "other_rows_read")
    e = entry.explanation
    assert e is not None and e.hypothesis == "other_rows_read" and e.detail == want, entry.reason
    assert e.seconds < 10, e.seconds


def test_the_pairs_screened_past_the_limit_keep_each_heavy_side(monkeypatch):
    """Past PAIR_LIMIT the (own page, source) pairs are those with the heaviest own page or source:
    bounded, never a page standing for itself, and every pair with a heavy side kept."""
    import torch

    from refmla.hypotheses import misplaced

    monkeypatch.setattr(misplaced, "PAIR_LIMIT", 4000)
    effect = torch.rand(1000, generator=torch.Generator().manual_seed(1))
    effect[[7, 900]] = 5.0  # a heavy own page (7) and a heavy source (900)
    own, src = torch.arange(0, 100), torch.arange(0, 1000)
    js, ts = misplaced._pairs(effect, own, src)
    pairs = set(zip(js.tolist(), ts.tolist()))
    assert len(js) <= 4000 and all(j != t for j, t in pairs)
    assert {(7, t) for t in range(1000) if t != 7} <= pairs and {(j, 900) for j in range(100)} <= pairs
    js, ts = misplaced._pairs(effect, torch.arange(0, 10), torch.arange(0, 30))  # under the limit: all
    assert len(js) == 10 * 30 - 10

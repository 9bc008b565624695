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
from refmla.pipeline import replay_capture  # noqa: E402
from refmla.synthetic import make_inputs, make_meta, preset  # noqa: E402

SPECS = {
    "deepseek-v3-tp8-page64": preset("deepseek-v3-tp8", num_heads=4, seq_lens=(300, 200, 420, 150)),
    "kimi-k2-tp8": preset("kimi-k2-tp8", num_heads=4, seq_lens=(300, 200, 420, 150)),
}
NAMED = ["seq_len_short", "newest_kv_zero", "newest_kv_stale", "pages_read_off", "whole_request_read", "kv_swapped",
         "other_rows_read", "rows_permuted", "page_missing", "kv_zero_block"]


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


def _per_request(e) -> list[tuple[str, dict]]:
    return [(e.hypothesis, x["detail"]) for x in e.extra.get("requests", [])]


@pytest.mark.parametrize("spec_name", list(SPECS))
@pytest.mark.parametrize("plant", NAMED)
def test_each_class_is_named_with_its_detail(tmp_path, spec_name, plant):
    entry, hypothesis, want = replay_planted(tmp_path, spec_name, plant)
    assert entry.status == "fail" and entry.explanation is not None, entry.reason
    named = [(h, d) for h, d in _names(entry.explanation) + _per_request(entry.explanation) if h == hypothesis]
    assert named, entry.explanation.text()
    assert any(all(d.get(k) == v for k, v in want.items()) for _, d in named), entry.explanation.text()


def test_newest_row_unwritten_is_offered_with_seq_len_off_by_minus_one(tmp_path):
    entry, _, _ = replay_planted(tmp_path, "kimi-k2-tp8", "newest_kv_zero")
    names = {h for h, _ in _names(entry.explanation)}
    assert "newest_kv_unwritten" in names and ("seq_len_off_by", {"delta": -1}) in _names(entry.explanation)


@pytest.mark.parametrize("plant,units", [("lse_log2", "log2"), ("lse_ln", "ln")])
def test_final_lse_in_the_other_units_is_named(tmp_path, plant, units):
    entry, _, _ = replay_planted(tmp_path, "kimi-k2-tp8", plant)
    assert entry.failed_parts == ["lse"] and entry.comparison.passed
    loc = entry.localization
    assert loc.cause == {"hypothesis": "lse_units", "detail": {"units": units}, "requests": [2]}
    assert f"the final lse in {units} units" in loc.text()


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


def _replay_full(tmp_path, name: str, over: dict, plant):
    """A planted fault on a whole preset (tools/planting.py's loop), replayed: the observed entry."""
    spec = preset(name, **over)
    t = make_inputs(spec)
    out, _, detail = plant(t, spec, spec.fault_request)
    t["out"] = out.to(spec.dtype)
    path = tmp_path / "c.safetensors"
    write_capture(path, t, make_meta(spec), compact=False)
    return replay_capture(read_capture(path), ReplayOptions(backends=["reference"])).backends["observed"], detail


def test_one_light_row_of_another_request_is_found_past_the_pair_limit(tmp_path):
    """DeepSeek-V3 TP8 at page size 1: request 2's position 2 holds request 0's position 1, neither
    made salient. 1,024 own positions x 1,854 pool rows is past PAIR_LIMIT: every pair is ranked by
    one GEMM (the pairs of the heaviest sides alone missed it: the bench's localized-only case)."""
    from refmla.hypotheses import misplaced

    spec = preset("deepseek-v3-tp8", page_size=1)
    assert spec.seq_lens[spec.fault_request] * sum(spec.seq_lens) > misplaced.PAIR_LIMIT
    entry, detail = _replay_full(tmp_path, "deepseek-v3-tp8", {"page_size": 1},
                                 lambda t, s, b: planting.other_rows_read(t, s, b, salient=False))  # fmt: skip
    e = entry.explanation
    assert e is not None and e.hypothesis == "other_rows_read", entry.reason
    assert e.detail == {k: detail[k] for k in ("page", "from_request", "from_page")}, e.text()


def test_a_zeroed_run_inside_one_256_row_page_is_named_and_localized(tmp_path):
    """Kimi-K2 at page size 256: positions 32..95 of request 2 zeroed, inside page 0. No whole page
    fits and the best block ranges lie elsewhere: every range of positions is ranked (the request
    is short enough), named at its positions; the localization finds the same run."""
    entry, detail = _replay_full(tmp_path, "kimi-k2-tp8-page256", {}, planting.kv_zero_block)
    e = entry.explanation
    assert e is not None and e.hypothesis == "kv_range_missing", entry.reason
    assert (e.detail["start"], e.detail["end"]) == (detail["start"], detail["end"]) == (32, 96), e.text()
    assert "at every position" in e.extra["granularity"]
    (span,) = [s for s in entry.localization.spans if s.request == 2]
    assert (span.start, span.end, span.pages) == (32, 96, (0, 0)), entry.localization.text()


def test_the_nearest_pairs_hold_the_planted_pair(monkeypatch):
    """_nearest_pairs ranks every (own page, source page) pair by one GEMM a block of own pages at a
    time: the pair whose swap gives the target exactly is kept, never a page for itself, at most
    ``keep`` pairs, with one own page per block (the blocks' bests merged) as with all at once."""
    import torch

    from refmla.hypotheses import misplaced

    g = torch.Generator().manual_seed(5)
    H, Dv, n = 3, 16, 60
    S = torch.rand(H, n, generator=g, dtype=torch.float64) + 0.1  # [H, pages]
    W = torch.randn(n, H, Dv, generator=g, dtype=torch.float64) * S.T[..., None]  # [pages, H, Dv]
    own, src = torch.arange(0, 25), torch.arange(0, n)
    S_b, W_b = S[:, own].sum(-1), W[own].sum(0)
    j, t = 7, 41
    target = (W_b - W[j] + W[t]) / (S_b - S[:, j] + S[:, t])[:, None]
    tol = torch.full((H,), 1e-3, dtype=torch.float64)
    from refmla import nearest

    for chunk in (2**22, n):
        monkeypatch.setattr(nearest, "BLOCK_VALUES", chunk)  # n: one own page a block
        js, ts = misplaced._nearest_pairs(S, W, S_b, W_b, target, tol, own, src, keep=10)
        pairs = list(zip(js.tolist(), ts.tolist()))
        assert (j, t) == pairs[0] if chunk > 1 else (j, t) in pairs, pairs
        assert len(pairs) <= 10 and all(a != b for a, b in pairs)


def test_a_stale_newest_row_is_recovered_from_the_heads_outputs():
    """fit_row: a newest row of other values, with its outputs written here by an explicit softmax,
    is recovered from the heads' outputs alone: its latent part to fp64 rounding, its logits (the
    rope part is min-norm: fewer heads than rope dims) to the same."""
    import torch

    from refmla.hypotheses.stale import fit_row
    from refmla.reference import Scales, attend

    g = torch.Generator().manual_seed(2)
    H, L, D, Dv = 8, 50, 24, 16
    sc = Scales(Dv, 0.4)
    q, kv = torch.randn(H, D, generator=g, dtype=torch.float64), torch.randn(L, D, generator=g, dtype=torch.float64)
    stale = torch.randn(D, generator=g, dtype=torch.float64) * 2
    rows = torch.cat([kv[:-1], stale[None]])
    out = torch.softmax(q @ rows.T * 0.4, -1) @ rows[:, :Dv]  # [H, Dv]
    row = fit_row(q, *attend(q, kv[:-1], sc), out, sc)
    assert row is not None and torch.allclose(row[:Dv], stale[:Dv], atol=1e-8), (row[:Dv] - stale[:Dv]).abs().max()
    assert torch.allclose(q @ row, q @ stale, atol=1e-8)
    o1, lse1 = attend(q, kv[:-1], sc)
    assert fit_row(q, o1, lse1, o1, sc) is None  # nothing moved: no row of positive weight


def test_two_requests_reading_each_others_rows_are_named_swapped(tmp_path):
    entry, _, _ = replay_planted(tmp_path, "kimi-k2-tp8", "kv_swapped")
    e = entry.explanation
    assert e.hypothesis == "other_request_read" and e.complete, e.text()
    assert {x["request"]: x["detail"]["from_request"] for x in e.extra["requests"]} == {0: 2, 2: 0}
    assert e.extra["swapped"] == [[0, 2]]

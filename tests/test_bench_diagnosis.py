"""tools/bench_diagnosis.py: the judging (named, detail, false alarm) and one small end-to-end run."""

from __future__ import annotations

import pytest

from helpers import load_tool

bench = load_tool("bench_diagnosis")


def _row(expect, verdict, hypothesis=None, planted=None, explained=None):
    row = bench.Row(preset="p", page_size=1, fault="f", expect=expect, status="error", verdict=verdict,
                    hypothesis=hypothesis, planted=planted or {}, explained=explained or {})  # fmt: skip
    bench.judge(row)
    return row


def test_detail_compares_shared_keys_only():
    assert bench.compare_detail({"fault": "x", "request": 2, "delta": -1}, {"request": 2, "delta": -1}) == (
        True, ["request", "delta"])  # fmt: skip
    assert bench.compare_detail({"request": 2, "delta": -1}, {"request": 2, "delta": -3})[0] is False
    assert bench.compare_detail({"ratio": 0.5515}, {"ratio": 0.5514927}) == (True, ["ratio"])
    assert bench.compare_detail({"ratio": 0.55}, {"ratio": 0.60})[0] is False


def test_an_explanation_that_says_either_matches_each_but_nothing_else():
    assert bench.compare_detail({"how": "zeroed"}, {"how": "zeroed or dropped"}) == (True, ["how"])
    assert bench.compare_detail({"how": "dropped"}, {"how": "zeroed or dropped"})[0] is True
    assert bench.compare_detail({"how": "shifted"}, {"how": "zeroed or dropped"})[0] is False
    assert bench.compare_detail({"how": "zeroed or dropped"}, {"how": "zeroed"})[0] is False
    assert bench.compare_detail({"split": 1}, {"delta": 1}) == (None, [])
    # a planted head mapping (a list) against the explanation's sentence and its list of heads
    assert bench.compare_detail({"mapping": [0, 0, 1]}, {"mapping": "padding ...", "heads": [0, 0, 1]})[0] is True
    assert bench.compare_detail({"mapping": [0, 0, 1]}, {"mapping": "padding ...", "heads": [0, 1, 1]})[0] is False


@pytest.mark.parametrize(
    "expect, verdict, hyp, status",
    [
        (None, "agree", None, "pass"),
        (None, "diverged", "seq_len_off_by", "false_alarm"),
        (None, "diverged", None, "false_alarm"),
        ("seq_len_off_by", "diverged", "seq_len_off_by", "named"),
        ("seq_len_off_by", "diverged", "kv_range_missing", "wrong"),
        ("seq_len_off_by", "diverged", None, "missed"),
        ("seq_len_off_by", "agree", None, "missed"),
    ],
)
def test_judge(expect, verdict, hyp, status):
    assert _row(expect, verdict, hyp).status == status


def test_a_wrong_detail_or_a_false_alarm_fails_the_summary():
    good = _row("seq_len_off_by", "diverged", "seq_len_off_by", {"delta": -1}, {"delta": -1})
    wrong_detail = _row("seq_len_off_by", "diverged", "seq_len_off_by", {"delta": -1}, {"delta": -3})
    alarm = _row(None, "diverged", "wrong_sm_scale")
    assert bench.summary([good])[1] is True
    assert bench.summary([good, wrong_detail])[1] is False
    line, ok = bench.summary([good, alarm])
    assert not ok and "1 false alarms" in line


def test_a_small_run_end_to_end(capsys):
    code = bench.main(["--preset", "hostile", "--page-size", "16", "--fault", "none", "--fault", "kv_range_zero",
                       "--fault", "benign_splits_16"])  # fmt: skip
    out = capsys.readouterr().out
    assert "2/2 named" not in out  # one fault, two correct kernels
    assert "1/1 named, 0 false alarms (2 correct kernels" in out, out
    assert code == 0


def test_a_rounding_change_within_tolerance_is_not_a_miss():
    """A numerics fault that may stay within the tolerance (MAY_AGREE) and agrees is n/a, not missed;
    one that must diverge and agrees is missed."""
    row = bench.Row(preset="p", page_size=1, fault="pv_accum_bf16", expect="numerics", status="error", verdict="agree")
    bench.judge(row)
    assert row.status == "n/a" and row.ok
    row = bench.Row(preset="p", page_size=1, fault="qk_accum_bf16", expect="numerics", status="error", verdict="agree")
    bench.judge(row)
    assert row.status == "missed"


def test_the_vllm_leg_names_a_fault_only_with_its_request_and_detail(tmp_path, monkeypatch):
    """The vLLM leg (--independent) on one capture tools/planting_vllm.py writes: the null block read
    for page 1 of request 1, with an offline path agreeing, is named and diagnosed observed; the
    same answer judged against another request or another page is not."""
    monkeypatch.setenv("REFMLA_EXTEND_IMPL", "torch")  # the offline path, without the interpreter
    pv = load_tool("planting_vllm")

    from refmla.capture import write_capture
    from refmla.context import ReplayOptions

    spec = pv.VllmSpec(block=16, seq_lens=(1030, 77, 283), heads=2)
    t, meta, detail = pv.capture(spec, "null_block_for_page")
    path = write_capture(tmp_path / "null.safetensors", t, meta, compact=False)
    report = bench.replay_file(path, ReplayOptions(backends=["extend"]))
    outcome, said = bench._vllm_outcome(report, pv, "null_block_for_page", detail, spec.fault_request)
    assert outcome == "named", said
    assert bench._vllm_outcome(report, pv, "null_block_for_page", detail, 0)[0] == "wrong"
    assert bench._vllm_outcome(report, pv, "null_block_for_page", {**detail, "page": 2}, 1)[0] == "wrong"

"""Each kernel judged by its own arithmetic (issue 27), on vLLM-layout captures refmla did not write.

tools/planting_vllm.py writes them with its own plain loop: a shuffled block table padded with
vLLM's null block (NaN in it and past each sequence's end), vLLM's uniform split schedule and its
batch-wide split count (2 splits: the longest request is past 1024 tokens), bf16 or fp8 e4m3 KV
with k_scale, and ``out`` from an fp64 loop over the block table rounded once to bf16. A clean
capture agrees by default (vLLM's own kernel among the backends) and through vllm_triton, SGLang's
triton (on its own 32-token schedule) and extend; the five block-table mistakes are named with
their detail; a fault on ``observed`` is diagnosed ``observed``.
"""

from __future__ import annotations


import pytest

from helpers import load_tool
from refmla.arithmetic import SGLANG_TRITON, UNSPLIT, VLLM_TRITON, Arithmetic, producer_arithmetic
from refmla.backends import get_backend
from refmla.capture import read_capture, write_capture
from refmla.context import ReplayOptions
from refmla.pipeline import replay_capture

pv = load_tool("planting_vllm")

SMALL = {"seq_lens": (1030, 77, 283), "heads": 2}  # 2 vLLM splits on the longest request
CLEAN = {"seq_lens": (1030, 45)}  # the clean replays run every kernel under the interpreter: fewer tokens


def _capture(tmp_path, block: int, fp8: bool, plant: str = "none", **over):
    spec = pv.VllmSpec(block=block, fp8=fp8, **{**SMALL, **over})
    t, meta, detail = pv.capture(spec, plant)
    path = write_capture(tmp_path / f"{plant}-{block}-{fp8}.safetensors", t, meta, compact=False)
    return read_capture(path), detail


def _vllm_ready() -> None:
    ok, why = get_backend("vllm_triton").availability()
    if not ok:
        pytest.skip(f"vllm_triton unavailable: {why}")


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("block", [16, 64])
def test_a_clean_vllm_capture_agrees_by_default_and_through_each_kernel(tmp_path, block, fp8):
    _vllm_ready()
    cap, _ = _capture(tmp_path, block, fp8, **CLEAN)
    assert cap.meta.split_schedule == "uniform" and set(cap.num_kv_splits.tolist()) == {2}
    report = replay_capture(cap, ReplayOptions(explain=False))
    assert report.verdict == "agree", report.diagnosis_text
    declared = {"vllm_triton": ("uniform", "keep", "to_q_dtype"), "triton": ("sglang", "latent_to_pool", "upcast"),
                "extend": ("none", "whole_to_pool", "new_to_q_dtype")}  # docs/contract.md section 5  # fmt: skip
    for name, (schedule, q_round, dequant) in declared.items():
        entry = report.backends[name]  # vllm_triton: in the default list for a vLLM capture
        assert entry.status == "pass", (name, entry.reason)
        want = {"split_schedule": schedule, "q_round": q_round, "dequant": dequant, "lse_base": "ln"}
        if name == "triton":  # its stage-1 online softmax, the BLOCK_N it launched with
            want["p_block"] = entry.info["block_n"]
        assert entry.info["arithmetic"] == want, name
    assert report.backends["vllm_triton"].splits.status == "pass"  # its partials on its own uniform schedule
    assert report.backends["triton"].splits.status == "pass"  # SGLang's on its 32-token one
    assert report.backends["observed"].info["arithmetic"]["split_schedule"] == "uniform"


def test_judged_on_the_captures_schedule_sglangs_partials_would_fail(tmp_path):
    """The false alarm this replaces: SGLang's partials against vLLM's uniform split reference."""
    from refmla.context import ReplayContext
    from refmla.splits import compare_splits

    cap, _ = _capture(tmp_path, 16, False, **CLEAN)
    res = get_backend("triton").run(cap, ReplayOptions())
    ctx = ReplayContext(cap, ReplayOptions())
    assert compare_splits(ctx, res, SGLANG_TRITON).status == "pass"
    assert compare_splits(ctx, res, producer_arithmetic(cap)).status == "fail"  # the capture's (vLLM's) schedule


@pytest.mark.parametrize(("plant", "block", "fp8"), [
    ("table_read_one_on", 16, False),
    ("row_pointer_off", 64, True),
    ("pages_shift_partial", 16, True),
    ("other_request_rows", 64, False),
    ("null_block_for_page", 16, False),
])  # fmt: skip
def test_block_table_mistakes_are_named_with_their_detail(tmp_path, plant, block, fp8):
    cap, detail = _capture(tmp_path, block, fp8, plant)
    entry = replay_capture(cap, ReplayOptions(backends=["reference"])).backends["observed"]
    _, hypothesis, keys = pv.PLANTS[plant]
    e = entry.explanation
    assert e is not None and e.complete, entry.localization.text() if entry.localization else entry.reason
    assert e.hypothesis == hypothesis and e.request == 1, e.text()
    assert {k: e.detail[k] for k in keys} == {k: detail[k] for k in keys}, e.text()
    assert not entry.info.get("hypothesis_errors"), entry.info["hypothesis_errors"]


@pytest.mark.parametrize("plant", ["pages_shift_partial", "null_block_for_page"])
def test_a_page_of_garbage_rows_is_named_at_deepseek_v3s_16_heads(tmp_path, plant):
    """The page read from the null block (large finite garbage) makes the request's output ten
    times the reference's, and its bf16 rounding with it: screened against the reference's own
    allowance the right candidate looked 4x off and the fault ended unexplained at 16 heads."""
    cap, detail = _capture(tmp_path, 16, False, plant, heads=16, seq_lens=(1030, 283, 600, 77))
    entry = replay_capture(cap, ReplayOptions(backends=["reference"])).backends["observed"]
    _, hypothesis, keys = pv.PLANTS[plant]
    e = entry.explanation
    assert e is not None and e.complete and e.hypothesis == hypothesis, entry.localization.text()
    assert {k: e.detail[k] for k in keys} == {k: detail[k] for k in keys}, e.text()


def test_a_fault_on_observed_is_diagnosed_observed(tmp_path):
    _vllm_ready()
    cap, _ = _capture(tmp_path, 16, True, "null_block_for_page")
    report = replay_capture(cap, ReplayOptions(backends=["vllm_triton"]))
    assert report.backends["vllm_triton"].status == "pass"
    assert report.diagnosis == "observed", report.diagnosis_text
    assert report.backends["observed"].explanation.hypothesis == "null_block_read"


def test_a_split_left_out_of_vllms_uniform_schedule_is_named_without_a_crash(tmp_path):
    """split_missing once crashed on this schedule (IndexError: index 7 is out of bounds for
    dimension 1 with size 2: SGLang's 32-token splits placed over vLLM's 2 partials); the planted
    split is vLLM's own: request 0's positions past ceil(1030 / 2) = 515 left out, by our loop."""
    import torch

    spec = pv.VllmSpec(block=16, fp8=False, **SMALL)
    t = pv.make(spec)
    per = -(-spec.seq_lens[0] // pv.num_kv_splits(spec))
    out, lse = pv.attention(t, spec, {0: pv.rows_of(t, spec, 0)[:per]})
    t["out"], t["lse"] = out.to(torch.bfloat16), lse.float()
    cap = read_capture(write_capture(tmp_path / "split.safetensors", t, pv.meta(spec), compact=False))
    entry = replay_capture(cap, ReplayOptions(backends=["reference"])).backends["observed"]
    assert not entry.info.get("hypothesis_errors"), entry.info["hypothesis_errors"]
    e = entry.explanation
    assert e is not None and e.complete, entry.localization.text() if entry.localization else entry.reason
    assert (e.hypothesis, e.detail, e.request) == ("split_missing", {"split": 1}, 0), e.text()


def test_a_family_that_raises_is_its_error_and_the_search_goes_on(tmp_path, monkeypatch):
    from refmla import hypotheses

    def broken(s):
        raise IndexError("index 7 is out of bounds for dimension 1 with size 2")

    monkeypatch.setitem(hypotheses.SEARCHES, "seq_len_off_by", broken)
    cap, _ = _capture(tmp_path, 16, False, "other_request_rows")
    entry = replay_capture(cap, ReplayOptions(backends=["reference"])).backends["observed"]
    assert "IndexError" in entry.info["hypothesis_errors"]["seq_len_off_by"]
    assert entry.explanation is not None and entry.explanation.hypothesis == "other_request_read"


def test_declarations():
    with pytest.raises(ValueError, match="lse_base"):
        Arithmetic(lse_base="log10")
    assert VLLM_TRITON.split_block == 1 and SGLANG_TRITON.split_block == 32 and UNSPLIT.split_block is None


@pytest.mark.parametrize("documented", [True, False])
def test_the_lse_is_compared_in_the_base_its_producer_documents(tmp_path, documented):
    """A producer whose lse is log2 and says so (meta lse_base) passes; one that does not say so is named."""
    import math

    spec = pv.VllmSpec(block=16, fp8=False, **SMALL)
    t, meta, _ = pv.capture(spec)
    t["lse"] = t["lse"] / math.log(2)
    if documented:
        meta["lse_base"] = "log2"
    cap = read_capture(write_capture(tmp_path / "lse.safetensors", t, meta, compact=False))
    report = replay_capture(cap, ReplayOptions(backends=["reference"]))
    entry = report.backends["observed"]
    assert entry.info["arithmetic"]["lse_base"] == ("log2" if documented else "ln")
    if documented:
        assert report.verdict == "agree", report.diagnosis_text
    else:
        assert entry.lse.status == "fail"
        assert entry.localization.cause["detail"] == {"units": "log2"}, entry.localization.text()


@pytest.mark.parametrize("fault", [False, True], ids=["clean-steps", "stale-metadata"])
def test_a_graph_replayed_with_the_previous_steps_block_table_is_stale_metadata(tmp_path, fault):
    """vLLM #36611 on vLLM's own layout: two steps of one layer and rank (our loop), step 8's queries
    attended under step 7's block table and lengths (each request one token shorter) is
    stale_metadata(step=7), replayed as ``refmla replay DIR`` does; two clean steps agree."""
    import math

    import torch

    from refmla.batch import replay_many
    from refmla.series import attach_series

    spec = pv.VllmSpec(block=16, fp8=False, **SMALL)
    now = pv.make(spec)
    prev = {**now, "seq_lens": now["seq_lens"] - 1, "q": torch.roll(now["q"], 1, dims=1)}  # the step before
    before = pv.VllmSpec(block=16, fp8=False, seq_lens=tuple(L - 1 for L in spec.seq_lens), heads=spec.heads)
    prev["out"] = pv.attention(prev, before)[0].to(torch.bfloat16)
    rows = {b: pv.rows_of(now, spec, b, L=before.seq_lens[b]) for b in range(len(spec.seq_lens))}
    now["out"] = pv.attention(now, spec, rows if fault else None)[0].to(torch.bfloat16)
    assert math.isfinite(float(now["out"].float().abs().sum()))
    paths = []
    for step, t in ((7, prev), (8, now)):
        meta = {**pv.meta(spec), "step": step, "layer_id": 3, "tp_rank": 0}
        paths.append(str(write_capture(tmp_path / f"step{step}.safetensors", t, meta, compact=False)))
    opts = ReplayOptions(backends=["reference"])
    reports = replay_many(paths, opts)
    attach_series(reports, opts)
    if not fault:
        assert [r.verdict for r in reports] == ["agree", "agree"], [r.diagnosis_text for r in reports]
        return
    e = reports[1].backends["observed"].explanation
    assert e is not None and e.hypothesis == "stale_metadata" and e.detail == {"step": 7}, e and e.text()
    assert e.extra["seq_lens_used"] == list(before.seq_lens)

"""No false alarm on a correct kernel that is not SGLang's (refmla/synthetic/benign.py).

Each benign variant writes a capture whose ``out`` a correct kernel computed with its own
rounding: another split count, aiter's fp32 einsum reference, compiled flex_attention. Replay
must agree (exit 0) on every preset. The variants must also really differ from the control the
tolerance is built on, or these tests would prove nothing.
"""

from __future__ import annotations

import pytest
import torch

from refmla import reference as ref
from refmla.scales import Scales
from refmla.attended import Attended
from refmla.backends import get_backend
from refmla.capture import read_capture
from refmla.context import ReplayOptions
from refmla.pipeline import replay_file
from refmla.synthetic import EXPECT, FAULTS, PRESETS, make_inputs, preset, synth_capture
from refmla.synthetic.benign import MAX_SPLITS, fp32_einsum

BENIGN = [f for f in FAULTS if EXPECT[f] is None and f != "benign_flex"]  # none, splits, fp32 einsum
FLEX_OK, FLEX_WHY = get_backend("flex").availability()


def _agree(tmp_path, name: str, fault: str):
    path = tmp_path / f"{name}-{fault}.safetensors"
    synth_capture(path, preset(name), fault)
    rep = replay_file(path, ReplayOptions(backends=[]))
    obs = rep.backends["observed"]
    assert obs.status == "pass", f"false alarm: {obs.reason}"
    assert rep.verdict == "agree" and rep.exit_code == 0
    return path


def test_every_split_count_and_the_einsum_are_registered_as_correct():
    assert {f"benign_splits_{n}" for n in range(1, MAX_SPLITS + 1)} | {"benign_fp32_einsum", "benign_flex"} <= {
        f for f in FAULTS if EXPECT[f] is None
    }


FAST = ["none", "benign_splits_1", "benign_splits_2", f"benign_splits_{MAX_SPLITS}", "benign_fp32_einsum"]


@pytest.mark.parametrize("fault", FAST)
def test_benign_variant_agrees_on_the_hostile_preset(tmp_path, fault):
    _agree(tmp_path, "hostile", fault)


def _multi_query(name: str) -> bool:
    """An extend or verify preset: several query tokens per request, no split-KV schedule."""
    return bool(PRESETS[name].new_tokens or PRESETS[name].draft_token_num)


def _plantable(name: str, fault: str) -> bool:
    """Split counts need a split schedule: not on an extend or verify capture (tested below)."""
    return not (fault.startswith("benign_splits_") and _multi_query(name))


@pytest.mark.slow
@pytest.mark.parametrize("name, fault", [(n, f) for n in PRESETS for f in BENIGN if _plantable(n, f)])
def test_benign_variant_agrees_on_every_preset(tmp_path, name, fault):
    """Every correct kernel registered (here and elsewhere, e.g. the numerics family's). A variant
    of split-KV arithmetic cannot be planted on an extend or verify capture, nor a causal-only
    kernel on a tree: those refusals are asserted."""
    try:
        _agree(tmp_path, name, fault)
    except ValueError as e:  # split arithmetic, or a causal-only kernel on a tree: refused, with the reason
        assert _multi_query(name) and ("split" in str(e) or "custom_mask" in str(e)), e


@pytest.mark.slow
@pytest.mark.skipif(not FLEX_OK, reason=f"flex unavailable: {FLEX_WHY}")
@pytest.mark.parametrize("name", list(PRESETS))
def test_flex_capture_agrees_on_every_preset(tmp_path, name):
    if PRESETS[name].topk > 1:  # causal only: a tree capture is refused, with the reason
        with pytest.raises(ValueError, match="custom_mask"):
            _agree(tmp_path, name, "benign_flex")
        return
    _agree(tmp_path, name, "benign_flex")


@pytest.mark.parametrize("fault", ["benign_splits_1", "benign_splits_16", "benign_fp32_einsum"])
def test_a_benign_output_is_not_the_control_itself(tmp_path, fault):
    """The variant rounds differently from the control (the ``none`` capture): a real test."""
    a, b = tmp_path / "none.safetensors", tmp_path / "v.safetensors"
    synth_capture(a, preset("kimi-k2-tp8"), "none")
    synth_capture(b, preset("kimi-k2-tp8"), fault)
    out_a, out_b = read_capture(a).out, read_capture(b).out
    assert out_a.dtype == out_b.dtype == torch.bfloat16
    assert int((out_a != out_b).sum()) > 100


@pytest.mark.parametrize("name", ["hostile", "kimi-k2-tp8-extend"])
def test_fp32_einsum_is_the_reference_to_fp32_precision(name):
    """aiter's style computes the same attention (causal extend and zero-length requests included)."""
    spec = preset(name)
    t = make_inputs(spec)
    sc = Scales(spec.kv_lora_rank, spec.sm_scale)
    out = fp32_einsum(t["q"], t["kv_buffer"], t["kv_indptr"], t["kv_indices"], t.get("qo_indptr"), sc, torch.float32)
    want = ref.mla_ref(t["q"], t["kv_buffer"], Attended.from_tensors(t), sc)[0]
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=1e-4)


def test_more_splits_than_the_capture_allows_is_not_planted(tmp_path):
    with pytest.raises(ValueError, match="max_kv_splits"):
        synth_capture(tmp_path / "x.safetensors", preset("hostile", max_kv_splits=4), "benign_splits_5")
    with pytest.raises(ValueError, match="extend"):
        synth_capture(tmp_path / "y.safetensors", preset("kimi-k2-tp8-extend"), "benign_splits_1")

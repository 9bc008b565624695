"""A kernel that only rounds differently is named as such (issue 11, part 2): the ``numerics``
hypotheses and diagnosis, the control's rounding variants, and the planted numerics faults."""

from __future__ import annotations

import json

import pytest
import torch

from refmla.capture import read_capture, write_capture
from refmla.cli import main as cli
from refmla.context import ReplayContext, ReplayOptions
from refmla.attended import Attended
from refmla.control import Rounding, mla_control_split, store_as
from refmla.scales import Scales
from refmla.diagnosis import diagnose
from refmla.hypotheses import explain_failure
from refmla.hypotheses.numerics import BY_NAME
from refmla.synthetic import SynthSpec, make_inputs, make_meta, preset, synth_capture
from refmla.synthetic.faults import EXPECT, FAULTS
from refmla.synthetic import MAY_AGREE
from refmla.synthetic.rounding import outlier_channel

NUMERIC_FAULTS = [f for f in FAULTS if EXPECT[f] == "numerics"]
BENIGN_NUMERIC = [f for f in FAULTS if f in BY_NAME and EXPECT[f] is None]


@pytest.fixture(autouse=True)
def torch_extend(monkeypatch):
    monkeypatch.setenv("REFMLA_EXTEND_IMPL", "torch")


def explain(path):
    cap = read_capture(path)
    ctx = ReplayContext(cap, ReplayOptions(backends=[]))
    cmp = ctx.compare("observed", cap.out, row_mask=~ctx.empty_rows())
    return cmp, (None if cmp.passed else explain_failure(ctx, cap.out, cmp))


# --------------------------------------------------------------------------------------------
# The stores
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_store_toward_zero_is_the_largest_magnitude_below(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(20000, generator=g) * torch.exp2(torch.randint(-6, 6, (20000,), generator=g).float())
    y = store_as(x, dtype, "toward_zero")
    assert y.dtype == dtype
    assert bool((y.double().abs() <= x.double().abs()).all())  # never away from zero
    assert bool((torch.sign(y) == torch.sign(x)).all() | (y == 0).all())
    up = (y.view(torch.int16) + 1).view(dtype)  # one ulp further from zero overshoots
    assert bool((up.double().abs() > x.double().abs()).all())
    rne = x.to(dtype)
    assert 0.3 < float((y != rne).double().mean()) < 0.7  # about half the elements differ


def test_store_half_away_breaks_ties_away_from_zero():
    one = torch.tensor([1.0, -1.0])
    half_ulp = 2.0**-8  # bf16 at 1: ulp 2^-7
    x = one + one.sign() * half_ulp  # exactly between 1 and 1 + ulp: RNE goes to 1 (even)
    assert torch.equal(x.to(torch.bfloat16).float(), one)
    assert torch.equal(store_as(x, torch.bfloat16, "half_away").float(), one + one.sign() * 2 * half_ulp)
    z = torch.tensor([1.0 + 3 * half_ulp])  # a tie above an odd value: both rules round up
    assert torch.equal(store_as(z, torch.bfloat16, "half_away"), z.to(torch.bfloat16))


def test_standard_rounding_is_the_control():
    spec = preset("hostile")
    t = make_inputs(spec)
    args = (t["q"], t["kv_buffer"], Attended.from_tensors(t), t["num_kv_splits"], Scales(512, spec.sm_scale), torch.bfloat16)
    a = mla_control_split(*args)[0]
    b = mla_control_split(*args, Rounding())[0]
    assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    c = mla_control_split(*args, Rounding(store="toward_zero"))[0]
    assert not torch.equal(a.view(torch.int16), c.view(torch.int16))


# --------------------------------------------------------------------------------------------
# Planted numerics are named; within tolerance they pass
# --------------------------------------------------------------------------------------------

PRESETS = ["kimi-k2-tp8", "deepseek-v3-tp8", "hostile"]


@pytest.mark.parametrize("name", PRESETS)
@pytest.mark.parametrize("fault", NUMERIC_FAULTS)
def test_planted_numerics_are_named(tmp_path, name, fault):
    path = tmp_path / f"{fault}.safetensors"
    planted = synth_capture(path, preset(name), fault)
    cmp, e = explain(path)
    if cmp.passed:
        assert fault in MAY_AGREE, f"{fault} on {name} is within tolerance"
        return
    assert e is not None, cmp.reasons
    assert (e.hypothesis, e.detail) == ("numerics", {"variant": planted["variant"]}), e.text()
    assert e.residual_ratio <= 1.0
    tried = {t["variant"]: t for t in e.extra["variants_tried"]}
    assert tried[planted["variant"]]["confirmed"] and planted["variant"] in tried
    assert all("residual_ratio" in t for t in tried.values())


@pytest.mark.parametrize("name", PRESETS)
@pytest.mark.parametrize("fault", BENIGN_NUMERIC)
def test_benign_rounding_passes(tmp_path, name, fault):
    path = tmp_path / f"{fault}.safetensors"
    synth_capture(path, preset(name), fault)
    cmp, _ = explain(path)
    assert cmp.passed, cmp.reasons


def test_split_variants_need_splits(tmp_path):
    with pytest.raises(ValueError, match="num_kv_splits"):
        synth_capture(tmp_path / "x.safetensors", preset("kimi-k2-tp8-extend"), "merge_log2_as_ln")


def test_data_fault_near_the_tolerance_is_not_numerics(tmp_path):
    """A dropped last token that barely fails: the wider allowance of a coarser control would let
    a rounding variant pass it, but the untouched requests keep the standard noise."""
    spec = preset("kimi-k2-tp8", seq_lens=(611, 257, 300, 33))
    path = tmp_path / "drop.safetensors"
    synth_capture(path, spec, "seq_len_off_by")
    cmp, e = explain(path)
    assert not cmp.passed and e.hypothesis == "seq_len_off_by"


# --------------------------------------------------------------------------------------------
# The diagnosis
# --------------------------------------------------------------------------------------------


def test_diagnosis_numerics_only_when_every_failure_is_numeric():
    st = {"reference": "pass", "observed": "fail", "triton": "fail", "extend": "pass"}
    rtz = ("numerics", {"variant": "out_round_toward_zero"})
    d = diagnose(st, explained={"observed": rtz, "triton": rtz})
    assert (d.name, d.backends) == ("numerics", ["observed", "triton"])
    assert "different rounding (out_round_toward_zero); no data or metadata fault" in d.text
    assert diagnose(st, explained={"observed": rtz}).name == "decode"  # triton unexplained
    assert diagnose(st, explained={"observed": rtz, "triton": ("seq_len_off_by", {"delta": -1})}).name == "decode"
    assert diagnose(st).name == "decode"  # callers that pass no explanations: as before


def rtz_capture(tmp_path, triton_out: bool):
    """SGLang Triton's decode on a pool with an outlier channel, its bf16 store truncating: the
    real kernel run with an fp32 output and truncated (``triton_out``), or the control truncated."""
    spec = SynthSpec(name="small-rtz", num_heads=8, seq_lens=(45, 200, 64), page_size=16, seed=5)
    path = tmp_path / f"rtz-{triton_out}.safetensors"
    if not triton_out:
        synth_capture(path, spec, "out_round_toward_zero")
        return path
    from refmla.backends.triton import TritonLaunch, run_triton_decode
    from refmla.synthetic.faults import Planting

    t = make_inputs(spec)
    outlier_channel(Planting(spec, t))
    out32 = run_triton_decode(t["q"], t["kv_buffer"], t["kv_indptr"], t["kv_indices"], t["num_kv_splits"],
                              Scales(spec.kv_lora_rank, spec.sm_scale), TritonLaunch(out_dtype=torch.float32))[0]  # fmt: skip
    t["out"] = store_as(out32, torch.bfloat16, "toward_zero")
    write_capture(path, t, make_meta(spec), compact=False)
    return path


def replay_rtz(capsys, path):
    code = cli(["replay", str(path), "--json", "--backend", "extend"])
    report = json.loads(capsys.readouterr().out)
    obs = report["backends"]["observed"]
    assert code == 1 and report["verdict"] == "diverged"  # a rounding change outside tolerance is news
    assert obs["status"] == "fail" and "cosine difference" in obs["reason"]  # the symptom
    assert report["backends"]["extend"]["status"] == "pass"
    assert report["diagnosis"] == "numerics" and report["diagnosis_backends"] == ["observed"]
    assert "different rounding (out_round_toward_zero); no data or metadata fault" in report["diagnosis_text"]
    e = obs["explanation"]
    assert e["hypothesis"] == "numerics" and e["detail"] == {"variant": "out_round_toward_zero"}
    assert any(t["variant"] == "out_through_fp16" and not t["confirmed"] for t in e["variants_tried"])
    assert cli(["replay", str(path), "--backend", "extend"]) == 1
    text = capsys.readouterr().out
    assert "diagnosis numerics" in text and "numerics(variant=out_round_toward_zero)" in text


def test_truncating_store_is_numerics_end_to_end(tmp_path, capsys):
    replay_rtz(capsys, rtz_capture(tmp_path, triton_out=False))


@pytest.mark.slow
def test_sglang_triton_with_truncating_store_is_numerics(tmp_path, capsys):
    """The issue's case: SGLang's own Triton decode kernel (interpreted here), its bf16 store
    rounding toward zero: within ~1 ulp everywhere, failing on one row's cosine."""
    pytest.importorskip("triton")
    replay_rtz(capsys, rtz_capture(tmp_path, triton_out=True))


def test_unexplained_failure_lists_the_numerics_ruled_out(tmp_path, capsys):
    """Noise on one row: nothing explains it, and the report says which rounding variants were
    tried, with their residuals, and that none fits."""
    spec = preset("kimi-k2-tp8")
    t = make_inputs(spec)
    from refmla.synthetic import faulty_output

    out, _ = faulty_output(spec, t, "none")
    g = torch.Generator().manual_seed(0)
    out[1, 3] += (0.05 * torch.randn(out.shape[-1], generator=g)).to(out.dtype)
    t["out"] = out
    write_capture(tmp_path / "noise.safetensors", t, make_meta(spec), compact=False)
    code = cli(["replay", str(tmp_path / "noise.safetensors"), "--json", "--backend", "extend"])
    obs = json.loads(capsys.readouterr().out)["backends"]["observed"]
    assert code == 1 and obs["status"] == "fail" and "explanation" not in obs
    tried = obs["info"]["numerics_tried"]
    assert {t["variant"] for t in tried} >= {"out_round_toward_zero", "qk_accum_bf16", "merge_log2_as_ln"}
    assert not any(t["confirmed"] for t in tried) and all(t["residual_ratio"] > 0 for t in tried)


@pytest.mark.parametrize("ratio", [1.002, 1.005])
def test_small_structured_fault_is_named_exactly_not_as_noise(tmp_path, ratio):
    """sm_scale off by 0.2 %: its error is as large as bf16 accumulation noise, but the scale
    reproduces it exactly, and is named (the accumulation variants come last)."""
    from refmla.synthetic.faults import Planting

    spec = preset("deepseek-v3-tp8")
    t = make_inputs(spec)
    t["out"] = Planting(spec, t).run(sm_scale=spec.sm_scale * ratio).to(spec.dtype)
    write_capture(tmp_path / "scale.safetensors", t, make_meta(spec), compact=False)
    cmp, e = explain(tmp_path / "scale.safetensors")
    assert not cmp.passed and e.hypothesis == "wrong_sm_scale", e and e.text()
    assert e.detail["ratio"] == pytest.approx(ratio, rel=2e-3)

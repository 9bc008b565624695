"""The block-table faults, planted by synth's own loop, each named by its hypothesis with its detail."""

from __future__ import annotations

import pytest

from refmla.capture import read_capture
from refmla.context import ReplayOptions
from refmla.pipeline import replay_capture
from refmla.synthetic import EXPECT, preset, synth_capture

FAULTS = ("read_past_block_table", "padded_row_nan", "null_block_read", "pages_as_tokens", "kv_scale_inconsistent")
DETAIL = {  # what the explanation must say, from what was planted
    "read_past_block_table": lambda p: {"delta": p["delta"]},
    "padded_row_nan": lambda p: {"padded_requests": [p["padded_request"]], "nan_requests": [p["request"]]},
    "null_block_read": lambda p: {"page": p["page"], "null_block": p["null_block"]},
    "pages_as_tokens": lambda p: {"read": p["read"]},
    "kv_scale_inconsistent": lambda p: {"scale": p["scale"], "applied": p["applied"]},
}


@pytest.mark.parametrize("preset_name", ["deepseek-v3-tp8", "hostile"])
@pytest.mark.parametrize("fault", FAULTS)
def test_planted_fault_is_named_with_its_detail(tmp_path, fault, preset_name):
    path = tmp_path / f"{fault}.safetensors"
    planted = synth_capture(path, preset(preset_name), fault)
    cap = read_capture(path)
    assert cap.block_table is not None  # a block-table capture
    report = replay_capture(cap, ReplayOptions(backends=[]))
    obs = report.backends["observed"]
    assert obs.status == "fail" and obs.explanation is not None, obs.reason
    assert obs.explanation.hypothesis == EXPECT[fault]
    for key, value in DETAIL[fault](planted).items():
        assert obs.explanation.detail[key] == value, obs.explanation.detail
    if "request" in planted:
        assert obs.explanation.request == planted["request"]


def test_a_correct_kernel_on_a_block_table_capture_agrees(tmp_path):
    """The same table and null block with no fault: nothing is named (no false alarm)."""
    from refmla.synthetic import faults, make_inputs
    from refmla.synthetic.blocktable_faults import with_table
    from refmla.capture import write_capture
    from refmla.synthetic import make_meta

    spec = preset("deepseek-v3-tp8")
    t = make_inputs(spec)
    with_table(faults.Planting(spec, t))
    t["out"], _ = faults.faulty_output(spec, t, "none")
    cap = read_capture(write_capture(tmp_path / "ok.safetensors", t, make_meta(spec), compact=False))
    report = replay_capture(cap, ReplayOptions(backends=[]))
    assert report.verdict == "agree", report.backends["observed"].reason

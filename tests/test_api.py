"""The Python API (issue 29): refmla.synth / refmla.replay / refmla.regions are what the command
line calls; the same capture gives the same answer through either."""

from __future__ import annotations

import json

import pytest

import refmla
from refmla.api import ALL_PRESETS
from refmla.capture import read_capture
from refmla.cli import main
from refmla.compare import Tolerance


def test_replay_of_a_path_or_a_capture_is_the_command_lines_replay(tmp_path, capsys):
    path = tmp_path / "x.safetensors"
    planted = refmla.synth(path, "kimi-k2-tp8", fault="kv_range_zero")
    assert planted == {"fault": "kv_range_zero", "request": 2, "start": 32, "end": 64}
    by_path = refmla.replay(path, backends=["reference"], tol=Tolerance(k=3.0), explain=True)
    by_capture = refmla.replay(read_capture(path), backends=["reference"], tol=Tolerance(k=3.0))
    assert main(["replay", str(path), "--backend", "reference", "--k", "3", "--json"]) == 1
    cli = json.loads(capsys.readouterr().out)
    for report in (by_path, by_capture):
        assert (report.verdict, report.diagnosis) == (cli["verdict"], cli["diagnosis"])
        assert (report.verdict, report.diagnosis) == ("diverged", "observed_unconfirmed")  # no offline kernel asked
        assert report.tolerance.k == 3.0 == cli["tolerance"]["k"]
        ex = report.backends["observed"].explanation
        assert ex.hypothesis == cli["backends"]["observed"]["explanation"]["hypothesis"] == "kv_range_missing"
        assert ex.detail == cli["backends"]["observed"]["explanation"]["detail"]
        assert (ex.request, ex.detail["start"], ex.detail["end"]) == (2, 32, 64)  # what was planted


@pytest.mark.parametrize("preset,fault,hypothesis", [("kv-write-fp8", "scale_missing", "kv_scale_not_applied"),
                                                     ("merge-cp-log2", "lse_base", "merge_lse_base")])  # fmt: skip
def test_synth_writes_every_kind_the_command_line_does(tmp_path, preset, fault, hypothesis):
    assert preset in ALL_PRESETS
    refmla.synth(tmp_path / "a.safetensors", preset_name=preset, fault=fault)
    assert main(["synth", str(tmp_path / "b.safetensors"), "--preset", preset, "--fault", fault]) == 0
    a, b = (refmla.replay(tmp_path / f"{n}.safetensors") for n in "ab")
    assert a.to_json()["backends"]["observed"] == b.to_json()["backends"]["observed"]
    assert a.backends["observed"].explanation.hypothesis == hypothesis


def test_bad_arguments_raise_value_error_with_the_command_lines_line(tmp_path, capsys):
    with pytest.raises(ValueError, match="unknown preset 'nope'; choose from .*kv-write-fp8.*merge-cp-log2"):
        refmla.synth(tmp_path / "x.safetensors", "nope")
    assert main(["synth", str(tmp_path / "x.safetensors"), "--preset", "nope"]) == 2
    assert "kv-write-fp8" in capsys.readouterr().err
    with pytest.raises(ValueError, match="layer applies to the sparse presets"):
        refmla.synth(tmp_path / "x.safetensors", "merge-cp-log2", layer=3)
    with pytest.raises(ValueError, match="--tokens"):
        refmla.regions(model="kimi-k2", tokens=0)


@pytest.mark.parametrize("content", [None, b"junk"], ids=["missing", "unreadable"])
def test_replay_of_a_bad_file_raises_value_error_with_the_command_lines_line(tmp_path, capsys, content):
    """Bad input raises ValueError (a CaptureError) as documented, never an ``invalid`` report."""
    path = tmp_path / "x.safetensors"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(ValueError) as raised:
        refmla.replay(path)
    assert isinstance(raised.value, refmla.capture.CaptureError)
    assert main(["replay", str(path), str(path)]) == 2  # several captures: the CLI's line per invalid capture
    line = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("refmla: error:")][0]
    assert line == f"refmla: error: {raised.value}"

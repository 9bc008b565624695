"""Series only where a series exists: captures chain across steps only when they carry layer_id,
tp_rank and step; the others get no series check, said once."""

import dataclasses
import json
from pathlib import Path

from hostile import SMALL, run_cli, write_small
from refmla.series import series_checks

GOLDEN = Path(__file__).resolve().parent.parent / "golden"


def _no_series(t, m):
    for key in ("layer_id", "tp_rank", "step", "rids"):
        m.pop(key)  # as goldens and hand-made captures are


def _two_unrelated(tmp_path):
    """Two captures of unrelated batches, neither with a layer, rank or step (old code chained them)."""
    other = dataclasses.replace(SMALL, seq_lens=(97, 130), num_kv_splits=(4, 4))
    return [str(write_small(tmp_path / "a.safetensors", _no_series)),
            str(write_small(tmp_path / "b.safetensors", _no_series, spec=other))]


def test_captures_without_a_step_are_not_chained(tmp_path):
    assert series_checks(_two_unrelated(tmp_path)) == {}


def test_replay_of_unrelated_captures_prints_no_series_finding_and_says_so_once(tmp_path):
    paths = _two_unrelated(tmp_path)
    code, out, _ = run_cli("replay", *paths, "--backend", "observed", "--no-explain")
    summary = out[out.index("summary by layer"):]
    assert code == 0 and "0 series finding(s)" in summary
    assert [ln for ln in out.splitlines() if "in no series" in ln] == [
        "series   2 of 2 capture(s) in no series, not checked across steps (a series is the dense captures of one "
        "layer and rank that carry layer_id, tp_rank and step)"]
    code, out, _ = run_cli("replay", *paths, "--backend", "observed", "--no-explain", "--json")
    assert all("series" not in r for r in json.loads(out))


def test_a_real_series_is_still_checked(tmp_path):
    """Steps 0 and 1 of one layer and rank, the second not grown by one: the finding stays."""
    def step1(t, m):
        m["step"] = 1
    paths = [str(write_small(tmp_path / "s0.safetensors")), str(write_small(tmp_path / "s1.safetensors", step1))]
    found = series_checks(paths)
    assert [f.check for f in found[paths[1]]] == ["seq_len_step", "seq_len_step"]


def test_inspect_golden_exits_0_with_no_series_findings():
    code, out, _ = run_cli("inspect", str(GOLDEN))
    assert code == 0, out[-2000:]
    assert "FINDINGS" not in out and "seq_len_step" not in out
    assert sum("in no series" in ln for ln in out.splitlines()) == 1

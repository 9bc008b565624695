"""A misplaced NaN / Inf is a failure on every surface: the comparator's failed_rows, the table's
max_abs_err, the JSON, the plot, the summary of many captures and the per-request blame disagg uses.

The NaN is planted by overwriting the capture's ``out`` tensor directly (no refmla fault code)."""

import json
import math

import pytest
import torch

from hostile import run_cli, write_small
from refmla.blame import failing_requests
from refmla.compare import compare
from refmla.results import BackendEntry

HEADS, DV = 2, 512  # tests/hostile.py's SMALL capture: 2 requests, 2 heads, Dv 512


def _nan_request0(t, m):
    t["out"][0] = math.nan  # request 0's whole output is NaN, as a kernel merging an empty split writes


def _truth(R=4, H=HEADS, seed=0):
    g = torch.Generator().manual_seed(seed)
    truth = torch.randn(R, H, DV, generator=g, dtype=torch.float64)
    return truth, truth.to(torch.bfloat16)


def test_nonfinite_rows_count_as_failed_rows():
    truth, control = _truth()
    bad = control.clone()
    bad[0] = math.nan
    c = compare("k", bad, truth, control)
    assert not c.passed
    assert c.failed_rows == HEADS and c.nonfinite_rows == HEADS and c.nan_mismatch == HEADS * DV
    assert c.err_text() == f"nan ({HEADS * DV} non-finite)"
    assert f"({HEADS} of {4 * HEADS} (request, head) rows)" in c.reasons[0]
    inf = control.clone()
    inf[1, 0, 3] = math.inf
    c = compare("k", inf, truth, control)
    assert (c.failed_rows, c.nonfinite_rows, c.err_text()) == (1, 1, "inf (1 non-finite)")
    assert c.to_json()["failed_rows"] == 1 and c.to_json()["nonfinite_rows"] == 1


def test_blame_names_a_nan_request_beside_an_over_allowance_one():
    """disagg fails a request for a backend only for its failing rows: the NaN request is one."""
    truth, control = _truth()
    bad = control.clone()
    bad[0] = math.nan
    bad[2, 1, 7] += 0.5  # request 2 over its allowance
    entry = BackendEntry.judged(compare("observed", bad, truth, control), {})
    assert failing_requests(entry) == {"out": {0, 2}}


@pytest.fixture
def nan_capture(tmp_path):
    return write_small(tmp_path / "nan.safetensors", _nan_request0)


def test_table_prints_the_nonfinite_count_not_the_noise(nan_capture):
    code, out, _ = run_cli("replay", str(nan_capture), "--backend", "observed", "--no-explain")
    assert code == 1
    row = next(ln for ln in out.splitlines() if ln.startswith("observed"))
    assert f"nan ({HEADS * DV} non-finite)" in row and "FAIL" in row


def test_json_failed_rows_counts_the_nan_rows(nan_capture):
    code, out, _ = run_cli("replay", str(nan_capture), "--backend", "observed", "--no-explain", "--json")
    obs = json.loads(out)["backends"]["observed"]
    assert code == 1 and obs["status"] == "fail"
    assert obs["failed_rows"] == HEADS and obs["nonfinite_rows"] == HEADS and obs["nan_mismatch"] == HEADS * DV


def test_folder_summary_names_the_nan_failure(nan_capture, tmp_path):
    write_small(tmp_path / "clean.safetensors")
    code, out, _ = run_cli("replay", str(tmp_path), "--backend", "observed", "--no-explain")
    summary = out[out.index("summary by layer"):]
    assert code == 1 and f"observed nan ({HEADS * DV} non-finite)" in summary


def test_plot_draws_nonfinite_rows_as_the_worst(nan_capture):
    pytest.importorskip("matplotlib")
    from refmla import plots
    from refmla.api import replay
    from refmla.capture import read_capture

    report = replay(nan_capture, backends=["observed"], explain=False)
    errors = plots._error_matrices(read_capture(nan_capture), report)
    err, allowed, nonfinite = errors["observed"]
    v = plots.heat_values(err, allowed, nonfinite)
    assert v.err[0].min() == v.err.max() and v.ratio[0].min() == v.ratio.max() > 1  # request 0: the top
    assert v.failing >= HEADS and v.nonfinite == HEADS
    fig = plots._heatmap_figure(read_capture(nan_capture), report, errors)
    titles = [ax.get_title() for ax in fig.axes]
    assert any(f"{v.failing} of {2 * HEADS} rows fail ({HEADS} non-finite)" in t for t in titles)


def test_verify_paths_table_prints_the_nonfinite_count(tmp_path):
    """The verify-vs-decode table of a verify capture whose production output holds a NaN row."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from refmla.api import synth

    path = tmp_path / "v.safetensors"
    synth(path, "kimi-k2-tp8-mtp")
    with safe_open(str(path), "pt") as f:
        tensors, header = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
    tensors["out"][0] = math.nan  # one query token's output, every head
    save_file(tensors, str(path), metadata=header)
    code, out, _ = run_cli("replay", str(path), "--backend", "reference")
    table = out[out.index("verify vs plain decode"):]
    row = next(ln for ln in table.splitlines() if ln.startswith("verify (production)"))
    n = tensors["out"].shape[1] * tensors["out"].shape[2]
    assert code == 1 and f"nan ({n} non-finite)" in row

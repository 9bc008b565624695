"""tools/gpu_check.py runs on a machine without a GPU too: the reference and observed outputs of the
goldens checked, every GPU kernel reported skipped with why, the timing step skipped."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "tools" / "gpu_check.py"


def test_help_documents_the_run():
    r = subprocess.run([sys.executable, str(TOOL), "--help"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0
    for word in ("--wheels", "--budget-s", "HBM", "H200", "flashmla", "vllm_triton", "fa3_mla", "flex", "--sweep-s",
                 "--sweep-backend", "sizes gpu"):
        assert word in r.stdout, word


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: the real check runs the kernels")
def test_on_cpu_every_gpu_kernel_is_skipped_with_why(tmp_path):
    golden = tmp_path / "golden"
    golden.mkdir()
    for name in ("kimi-h8-len1-31-32-33.safetensors", "dsv3-h16-verify-q4-tree.safetensors"):
        (golden / name).write_bytes((ROOT / "golden" / name).read_bytes())
    out = tmp_path / "gc.json"
    r = subprocess.run([sys.executable, str(TOOL), "--golden-dir", str(golden), "--out", str(out)],
                       capture_output=True, text=True, timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    result = json.loads(out.read_text())
    rows = result["goldens"]
    assert {(x["golden"], x["backend"], x["status"]) for x in rows if x["backend"] in ("reference", "observed")} == {
        (g, b, "pass") for g in ("kimi-h8-len1-31-32-33.safetensors", "dsv3-h16-verify-q4-tree.safetensors")
        for b in ("reference", "observed")
    }
    kernels = [x for x in rows if x["backend"] not in ("reference", "observed")]
    assert kernels and all(x["status"] == "skipped" and x["reason"].startswith("no GPU here") for x in kernels)
    assert result["reference_timing"] == {"status": "skipped", "reason": "no GPU"}
    assert "flashmla" in r.stdout and "why skipped" in r.stdout
    assert result["sweep"]["status"] == "skipped" and "no GPU" in result["sweep"]["reason"] and "sweep: skipped" in r.stdout


def test_the_sweep_step_prints_the_figures_to_quote(tmp_path):
    """The sweep step as it runs on a GPU, here at the CPU's sizes on a named backend: its cases,
    cases per minute per backend and findings, in the JSON and on stdout, within its budget."""
    golden = tmp_path / "golden"
    golden.mkdir()
    out = tmp_path / "gc.json"
    argv = [sys.executable, str(TOOL), "--golden-dir", str(golden), "--out", str(out), "--sweep-s", "6",
            "--sweep-backend", "reference", "--sweep-out", str(tmp_path / "sweep")]  # fmt: skip
    r = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    sweep = json.loads(out.read_text())["sweep"]
    assert sweep["status"] == "ran" and sweep["cases"] > 0 and sweep["findings"] == []
    assert sweep["bounds"]["profile"] == "cpu" and sweep["walk_seconds"] <= 6 * 1.1 + 30
    ref = sweep["backends"]["reference"]
    assert ref["cases"] == sweep["cases"] and ref["cases_per_minute"] > 0
    assert f"sweep: {sweep['cases']} cases" in r.stdout and "cases/min" in r.stdout

"""`refmla disagg` says one thing: on a kernel that dropped KV in production (only the production
output diverges over KV that arrived intact), the class ``compute`` and its sentence agree -- the
compute that failed is production's own kernel call, not the transfer -- and the diagnosis column
does not repeat itself (``observed: observed``)."""

from __future__ import annotations

from pathlib import Path

from refmla.context import ReplayOptions
from refmla.disagg import run_disagg
from refmla.render.disagg import render_disagg
from refmla.synthetic.disagg import disagg_preset, synth_disagg


def _files(root: Path, side: str) -> list[str]:
    return sorted(str(p) for p in (root / side).glob("*.safetensors"))


def test_kernel_dropped_class_and_sentence_agree(tmp_path):
    planted = synth_disagg(tmp_path, disagg_preset("disagg-small"), "kernel_dropped")["expect"]
    report = run_disagg(_files(tmp_path, "prefill"), _files(tmp_path, "decode"), ReplayOptions(backends=["extend"]))
    row = next(r for r in report.rows if r.fault != "none")
    assert (row.rid, row.fault, row.decode.diagnosis, row.transfer.status) == (planted["rid"], "compute", "observed", "faithful")
    assert "production's decode call diverged" in row.sentence and "not in the transfer" in row.sentence
    assert "KV not yet transferred" not in row.sentence  # the transfer was checked: faithful
    assert report.sentence.startswith("fault in the compute: 1 of ") and "production's decode call" in report.sentence
    text = render_disagg(report)
    assert "observed: observed" not in text
    line = next(ln for ln in text.splitlines() if ln.startswith(planted["rid"]) and "COMPUTE" in ln)
    assert "observed: production only" in line

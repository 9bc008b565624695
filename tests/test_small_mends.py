"""Smaller mends a new user met: help that describes the options, one wording for a missing file,
the layout mismatch named, progress lines in the order given."""

import io
from pathlib import Path

from hostile import run_cli
from refmla.disagg.plan import plan_disagg
from refmla.progress import Progress
from refmla.synthetic.disagg import disagg_preset, synth_disagg
from refmla.synthetic.disagg_sparse import synth_sparse_disagg, sparse_disagg_preset


def test_golden_generate_help_describes_out_and_suite():
    code, out, _ = run_cli("golden", "generate", "--help")
    assert code == 0
    assert "--out OUT             the folder to write into" in out
    assert "quick: the 13 cases checked in under golden/" in out


def test_disagg_of_missing_files_says_no_such_file_as_replay_does(tmp_path):
    a, b = str(tmp_path / "nope1"), str(tmp_path / "nope2")
    code, _, err = run_cli("disagg", a, b)
    assert code == 2
    assert [ln for ln in err.splitlines() if ln.startswith("refmla: error:")] == [
        f"refmla: error: {a}: file: no such file", f"refmla: error: {b}: file: no such file"]
    _, _, replay_err = run_cli("replay", a)
    assert f"refmla: error: {a}: file: no such file" in replay_err


def test_dense_prefill_against_a_sparse_decode_names_the_layouts(tmp_path):
    synth_disagg(tmp_path / "dense", disagg_preset("disagg-small"), "none")
    synth_sparse_disagg(tmp_path / "v4", sparse_disagg_preset("disagg-v4"), "none")
    code, _, err = run_cli("diff-kv", str(tmp_path / "dense" / "prefill"), str(tmp_path / "v4" / "decode"))
    lines = [ln for ln in err.splitlines() if ln.startswith("refmla: error:")]
    assert code == 2 and len(lines) == 1
    assert "meta key 'mode'" in lines[0] and "dense (MLA latent pool)" in lines[0] and "sparse (DeepSeek V3.2 / V4" in lines[0]
    assert "no prefill capture of its layer and rank" not in lines[0]
    plan = plan_disagg(sorted(str(p) for p in (tmp_path / "dense" / "prefill").glob("*.safetensors")),
                       sorted(str(p) for p in (tmp_path / "v4" / "decode").glob("*.safetensors")))  # fmt: skip
    assert any("the two sides' KV layouts differ" in n for n in plan.notes)  # disagg says so too


def test_progress_lines_come_in_the_order_given_whatever_finishes_first():
    out = io.StringIO()
    p = Progress(3, stream=out)
    for label, i in (("c", 2), ("a", 0), ("b", 1)):  # finished out of order, as worker processes do
        p.step(label, i)
    p.close()
    assert out.getvalue() == "[1/3] a\n[2/3] b\n[3/3] c\n"

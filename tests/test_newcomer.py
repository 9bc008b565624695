"""What a newcomer ran into (issue 29): exit codes a CI job can trust, swapped disagg sides, diff-kv
on folders, one region line per distinct region, a masking fault's headline, synth's help, a
closed stdout, a capture run that writes nothing, the README's runnable blocks."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest

from refmla.cli import main
from refmla.cli.common import EXIT_NOT_RUN, unrun_exit, worst_exit
from refmla.diagnosis import diagnose, diagnose_verify
from refmla.disagg.report import DisaggReport
from refmla.region_check import check_region
from refmla.results import BackendEntry
from refmla.sparse.presets import PRESETS as SPARSE_PRESETS
from refmla.synthetic import preset, synth_capture
from refmla.synthetic.disagg import DisaggSpec, synth_disagg
from refmla.api import synth as synth_capture_api

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    out = tmp_path_factory.mktemp("pair")
    synth_disagg(out / "clean", DisaggSpec())
    synth_disagg(out / "shifted", DisaggSpec(), "run_shifted")
    return out


def test_a_named_backend_that_does_not_run_exits_3_with_one_line(tmp_path, capsys):
    from refmla.backends import get_backend

    if get_backend("aiter").availability()[0]:
        pytest.skip("aiter runs here: it is not skipped")
    path = tmp_path / "x.safetensors"
    synth_capture(path, preset("kimi-k2-tp8"))
    assert main(["replay", str(path), "--backend", "aiter", "--no-explain"]) == EXIT_NOT_RUN  # no aiter here
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "backend aiter was asked for and did not run" in err[0] and str(path) in err[0]
    assert main(["replay", str(path), "--backend", "aiter", "--allow-skip", "--no-explain"]) == 0
    assert capsys.readouterr().err == ""
    sparse = tmp_path / "s.safetensors"  # a sparse decode capture: the same rule
    synth_capture_api(sparse, "deepseek-v4-flash-tp8-swa")
    assert main(["replay", str(sparse), "--backend", "aiter_sparse", "--no-explain"]) == EXIT_NOT_RUN
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "backend aiter_sparse was asked for and did not run" in err[0]


class _Report:
    capture = "c.safetensors"
    backends = {"aiter": BackendEntry("skipped", reason="aiter is not installed"), "triton": BackendEntry("pass")}


def test_the_default_backend_set_skips_quietly_and_the_worst_code_wins(capsys):
    assert unrun_exit([_Report()], None, False) == 0 and capsys.readouterr().err == ""  # no --backend
    assert unrun_exit([_Report()], ["triton"], False) == 0  # the one asked for ran
    assert unrun_exit([_Report()], ["aiter"], False) == EXIT_NOT_RUN
    assert worst_exit(0, 3) == 3 and worst_exit(3, 1) == 1 and worst_exit(1, 2, 3) == 2 and worst_exit() == 0


def test_swapped_disagg_sides_exit_2_naming_disagg_mode(pair, capsys):
    assert main(["disagg", str(pair / "clean" / "decode"), str(pair / "clean" / "prefill")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "disagg_mode is 'decode'" in err[0] and "swapped" in err[0]


def test_diff_kv_takes_folders(pair, capsys):
    assert main(["diff-kv", str(pair / "clean" / "prefill"), str(pair / "clean" / "decode"), "--json"]) == 0
    docs = json.loads(capsys.readouterr().out)
    assert len(docs) == 4 and all(d["ok"] for d in docs)  # each decode capture against its layer and rank
    assert main(["diff-kv", str(pair / "shifted" / "prefill"), str(pair / "shifted" / "decode")]) == 1
    assert capsys.readouterr().out.count("decode   ") == 4


def test_one_region_line_per_distinct_region():
    from refmla.capture import parse_meta
    from refmla.render.disagg import render_disagg

    meta = parse_meta({"mode": "decode", "backend": "triton", "kv_lora_rank": 512, "qk_rope_head_dim": 64,
                       "sm_scale": 0.1, "logit_cap": 0.0, "page_size": 1, "kv_pool_rows": 4_000_000,
                       "kv_pool_row_bytes": 1152})  # fmt: skip
    check = check_region(meta)
    report = DisaggReport([], "transfer", "x", ["p"], ["d"], regions=[("decode", f"d{i}", check) for i in range(16)])
    lines = [ln for ln in render_disagg(report).splitlines() if ln.startswith("region")]
    assert len(lines) == 1 and "and 15 more capture(s)" in lines[0]


def test_a_masking_explanation_is_not_called_a_transfer_problem():
    explained = {"observed": ("causal_alignment", {"alignment": "top-left"})}
    statuses = {"reference": "pass", "observed": "fail", "extend": "pass", "triton_decode_per_query": "pass"}
    for how in (diagnose, diagnose_verify):
        d = how(statuses, produced_by="aiter", explained=explained)
        assert "masking mistake" in d.text and "causal_alignment(alignment=top-left)" in d.text
        assert "not yet transferred" not in d.text and "not yet written" not in d.text
    state = diagnose(statuses, produced_by="aiter", explained={"observed": ("kv_range_missing", {})})
    assert "KV not yet transferred" in state.text  # a state-shaped explanation keeps the state sentence


def test_a_verify_capture_with_a_masking_fault_replayed(tmp_path, monkeypatch):
    from refmla.capture import read_capture
    from refmla.context import ReplayOptions
    from refmla.pipeline import replay_capture

    monkeypatch.setenv("REFMLA_EXTEND_IMPL", "torch")
    path = tmp_path / "v.safetensors"
    synth_capture(path, preset("kimi-k2-tp8-mtp", seq_lens=(300, 41, 130, 35)), "causal_top_left")
    rep = replay_capture(read_capture(path), ReplayOptions(backends=["extend"])).to_json()
    assert rep["backends"]["observed"]["explanation"]["hypothesis"] == "causal_alignment"
    assert "masking mistake" in rep["diagnosis_text"] and "not yet transferred" not in rep["diagnosis_text"]


def test_synth_help_lists_presets_and_faults_sparse_too(capsys):
    with pytest.raises(SystemExit):
        main(["synth", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for name in ["kimi-k2-tp8", "kimi-k2-tp8-mtp", *SPARSE_PRESETS, "kv_range_zero", "causal_top_left", "sink_omitted"]:
        assert name in text, name
    assert main(["synth", "x.safetensors", "--preset", "nope"]) == 2
    err = capsys.readouterr().err
    assert all(p in err for p in SPARSE_PRESETS) and "kimi-k2-tp8" in err


class _ClosedPipe:
    def write(self, text):
        raise BrokenPipeError(32, "Broken pipe")

    def flush(self):
        pass


def test_a_closed_stdout_blames_nothing(pair, monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdout", _ClosedPipe())
    code = main(["diff-kv", str(pair / "clean" / "prefill" / "L0-R0-c0.safetensors"),
                 str(pair / "clean" / "decode" / "L0-R0-s0.safetensors"), "--json"])  # fmt: skip
    assert code == 141 and capsys.readouterr().err == ""


def test_a_capture_run_that_writes_nothing_says_why(tmp_path, capsys):
    assert main(["capture", "run", "--out", str(tmp_path / "caps"), "--", sys.executable, "-c", "pass"]) == 0
    err = capsys.readouterr().err
    assert "0 capture file(s)" in err and "nothing was captured" in err
    for why in ("--modes decode", "--modes decode,verify", "--disable-cuda-graph", "--max-files 128", "hook not installed"):
        assert why in err, why


def test_the_readme_marks_its_cpu_blocks_and_the_checker_runs_them(tmp_path):
    sys.path.insert(0, str(ROOT / "tools"))
    import check_quickstart as q

    blocks = q.readme_blocks((ROOT / "README.md").read_text())
    assert len(blocks) >= 4 and all(q.dollar_commands(b.text) or b.lang == "bash" for b in blocks)
    shown = [cmd for b in blocks for cmd, out in q.dollar_commands(b.text) if out]  # each shows its output
    assert any("refmla regions --model deepseek-v4-flash --tokens 23448064" in c for c in shown)
    assert any(c.startswith("refmla replay demo/") for c in shown) and any("refmla disagg" in c for c in shown)
    assert any("--preset deepseek-v4-flash-tp8" in c for c in shown)  # the V4 example, checked whole
    docs = [b for p in q.pages(str(ROOT / "README.md"))[1:] for b in q.readme_blocks(Path(p).read_text())]
    assert "python" in [b.lang for b in docs]  # the Python API's example runs too
    bin_dir = tmp_path / "bin"  # `refmla` on PATH as `make demo` leaves it
    bin_dir.mkdir()
    shim = bin_dir / "refmla"
    shim.write_text(f"#!/bin/sh\nPYTHONPATH={ROOT}{os.pathsep}$PYTHONPATH exec {sys.executable} -m refmla \"$@\"\n")
    shim.chmod(0o755)
    regions = next(b for b in blocks if "refmla regions" in b.text)
    assert q.block_problems(regions, str(bin_dir), str(tmp_path)) == []  # printed whole, as the README shows
    wrong = q.Block(1, "bash", "refmla regions --model deepseek-v4-flash --tokens 23448064   # exit 0: wrong")
    assert "exited 1 (expected [0])" in q.block_problems(wrong, str(bin_dir), str(tmp_path))[0]


def test_a_named_backend_that_does_not_run_fails_disagg_too(pair, capsys):
    from refmla.backends import get_backend

    if get_backend("aiter").availability()[0]:
        pytest.skip("aiter runs here: it is not skipped")
    sides = [str(pair / "clean" / "prefill"), str(pair / "clean" / "decode")]
    assert main(["disagg", *sides, "--backend", "aiter"]) == EXIT_NOT_RUN  # a clean pair: only the skip fails it
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("refmla:")]  # not the progress lines
    assert len(err) == 4 and all("backend aiter was asked for and did not run" in line for line in err)  # per capture
    assert main(["disagg", *sides, "--backend", "aiter", "--allow-skip"]) == 0
    assert "refmla:" not in capsys.readouterr().err


def test_the_readme_says_verify_calls_need_their_mode():
    from refmla.hook.config import HookConfig

    assert HookConfig(out_dir="x").modes == frozenset({"decode"})  # the default captures no verify call ...
    verify = (ROOT / "docs" / "verify.md").read_text()
    assert "--modes decode,verify" in verify  # ... so the page that says they are captured says how
    readme = (ROOT / "README.md").read_text()
    capture = readme[readme.index("**1. Capture on both nodes.**"):readme.index("**2. Replay the decode captures**")]
    assert "--modes\n  decode,verify" in capture or "--modes decode,verify" in capture


def test_the_readme_says_what_a_prefill_node_captures():
    """The default captures nothing on a prefill node, and MHA prefill is never captured: the capture
    step says which options capture what there (and the hook's skip line is the one it quotes)."""
    from refmla.hook.config import HookConfig

    assert "extend" not in HookConfig(out_dir="x").modes
    readme = (ROOT / "README.md").read_text()
    capture = readme[readme.index("**1. Capture on both nodes.**"):readme.index("**2. Replay the decode captures**")]
    for said in ("--modes extend", "kvwrite", "MHA prefill is not captured", "not an absorbed-MLA call",
                 "--disaggregation-mode prefill", "--disaggregation-mode decode"):
        assert said in capture, said
    hook = (ROOT / "refmla" / "hook" / "extract.py").read_text()
    assert 'Skip(f"not an absorbed-MLA call' in hook
    assert "## On each node of a disaggregated deployment" in (ROOT / "docs" / "capture.md").read_text()


def test_the_readme_names_every_diagnosis_class():
    """Every class of docs/contract.md section 6 (and of refmla.diagnosis) is in the README's table."""
    from refmla import diagnosis

    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("**Diagnoses**"):readme.index("**Glossary**")]
    contract = (ROOT / "docs" / "contract.md").read_text()
    section = contract[contract.index("## 6. Diagnosis classes"):contract.index("## 7. Exit codes")]
    classes = {ln.split("`")[1] for ln in section.splitlines() if ln.startswith("| `")}
    classes |= {m.group(1) for ln in diagnosis.__doc__.splitlines() if (m := re.match(r"    (\w+)  ", ln))}
    assert "observed_unconfirmed" in classes and len(classes) >= 17
    assert [c for c in sorted(classes) if f"`{c}`" not in table] == []


def test_every_install_line_of_refmla_leaves_the_engines_packages_alone():
    """README and docs/ install refmla one way: pip install --no-deps -e (the image's torch stays)."""
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    lines = [(doc.name, ln.strip()) for doc in docs for ln in doc.read_text().splitlines()
             if "pip install" in ln and ("/path/to/refmla" in ln or ln.split("#")[0].strip().endswith("-e ."))]
    assert len(lines) >= 4
    assert [x for x in lines if "pip install --no-deps -e " not in x[1]] == []

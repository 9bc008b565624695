"""tools/check_quickstart.py compares the README's printed blocks whole: the masking rule of its
docstring (what may differ between machines) and a stale block (what must fail)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import check_quickstart as q  # noqa: E402

REGIONS = "refmla regions --model deepseek-v4-flash --tokens 8551168"


@pytest.fixture
def bin_dir(tmp_path):
    """`refmla` and `python` on PATH as `make demo` leaves them, running this tree."""
    d = tmp_path / "bin"
    d.mkdir()
    shim = d / "refmla"
    shim.write_text(f"#!/bin/sh\nPYTHONPATH={ROOT}{os.pathsep}$PYTHONPATH exec {sys.executable} -m refmla \"$@\"\n")
    shim.chmod(0o755)
    (d / "python").symlink_to(sys.executable)
    return str(d)


@pytest.mark.parametrize("shown, printed", [
    ("replay took 24.6 s, search 0.72 s", "replay took 31 s, search 1.4 s"),  # times
    ("sglang 0.5.23 torch 2.13.0+cpu", "sglang 0.5.24 torch 2.14.1+rocm6.4"),  # versions
    ("wrote /tmp/refmla-readme-ab12/x.safetensors", "wrote /tmp/refmla-readme-zz99/x.safetensors"),  # paths
    ("max abs err 0.00765, cos=1e-05", "max abs err 0.00768, cos=1.0e-05"),  # decimals within 1 %
    ("backend    status   note", "backend  status  note   "),  # column widths
    ("---------  -------  ----", "------  ---------  ------------------"),  # a table's rule: 3 columns
    ("req 1 head 6  sglang 0.5.23 sglang.kernels.ops.decode_...", "req 1 head 6 sglang 0.5.230 sglang.kernels.ops.deco..."),
    ("flashmla_sparse  skipped  -  -  -  not importable: ...", "flashmla_sparse skipped - - - not importable: libcuda.so.1 x"),
])  # fmt: skip
def test_what_varies_between_machines_is_masked(shown, printed):
    assert q.same_line(shown, printed)


@pytest.mark.parametrize("shown, printed", [
    ("observed   FAIL     0.31", "observed   pass     0.31"),  # a status
    ("16 of 300 positions differ", "17 of 300 positions differ"),  # an integer is exact
    ("2189099008 bytes", "2189099009 bytes"),
    ("max abs err 0.00765", "max abs err 0.0078"),  # 2 % off
    ("max abs err 0.31", "max abs err nan (4096 non-finite)"),  # a number that became words
    ("---------  -------", "---------  -------  ----"),  # a column more
    ("diagnosis observed: only the production output diverges", "diagnosis observed: only production diverges"),
    ("verdict  diverged", "verdict  diverged  (1 of 4)"),  # words added at the end
    ("req 1 head 6  sglang.kernels.decode_...", "req 2 head 6  sglang.kernels.decode_attention"),  # before the cut
])  # fmt: skip
def test_what_a_stale_example_changes_is_not_masked(shown, printed):
    assert not q.same_line(shown, printed)


def test_a_whole_block_must_print_every_line_and_no_more():
    shown = ["a 1", "", "b 2"]
    assert q.output_problems("here", "cmd", shown, ["a 1", "", "b 2", ""]) == []  # trailing blank lines
    assert "printed 4 line(s), the README shows 3 (first unmatched: 'c 3')" in \
        q.output_problems("here", "cmd", shown, ["a 1", "", "b 2", "c 3"])[0]  # fmt: skip
    assert "printed 1 line(s), the README shows 3 (first unmatched: '')" in \
        q.output_problems("here", "cmd", shown, ["a 1", ""])[0]  # fmt: skip (trailing blank lines dropped)
    assert "printed line 3 'b 3', the README shows 'b 2'" in q.output_problems("here", "cmd", shown, ["a 1", "", "b 3"])[0]


def test_a_printed_block_runs_and_a_stale_one_fails(bin_dir, tmp_path):
    """The real command: its output pasted passes; one number or one line changed fails."""
    printed = q._run(REGIONS, {**os.environ, "PATH": bin_dir + os.pathsep + os.environ["PATH"]}, str(tmp_path)).stdout
    assert "registers above SGLang's clamp" in printed
    fresh = q.Block(1, "", f"$ {REGIONS}   # exit 0\n{printed}")
    assert q.block_problems(fresh, bin_dir, str(tmp_path)) == []
    stale = q.Block(7, "", fresh.text.replace("8388096 tokens", "8388352 tokens", 1))
    problems = q.block_problems(stale, bin_dir, str(tmp_path))
    assert len(problems) == 1 and problems[0].startswith(f"README line 7: `{REGIONS}` printed line 2 ")
    shorter = q.Block(7, "", "\n".join(fresh.text.splitlines()[:-1]))
    assert "printed 4 line(s), the README shows 3" in q.block_problems(shorter, bin_dir, str(tmp_path))[0]
    wrong_exit = q.Block(7, "", fresh.text.replace("# exit 0", "# exit 1"))
    assert "exited 0 (expected [1])" in q.block_problems(wrong_exit, bin_dir, str(tmp_path))[0]


def test_update_writes_what_ran_and_then_the_readme_passes(bin_dir, tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\n<!-- cpu -->\n```\n$ {REGIONS}\nstale output\n```\n\nafter\n")
    refmla = os.path.join(bin_dir, "refmla")
    n, problems = q.readme_problems(str(readme), refmla)
    assert n == 1 and len(problems) == 1 and "stale output" in problems[0]
    n, _ = q.readme_problems(str(readme), refmla, update=True)
    text = readme.read_text()
    assert "stale output" not in text and "registers above SGLang's clamp" in text and text.endswith("```\n\nafter\n")
    assert q.readme_problems(str(readme), refmla) == (1, [])


def test_the_scratch_folder_holds_the_demo_capture_at_its_path(bin_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "demo").mkdir()
    (tmp_path / "demo" / "c.safetensors").write_bytes(b"x")
    readme = tmp_path / "README.md"
    readme.write_text("<!-- cpu -->\n```\n$ cat demo/c.safetensors && echo\nx\n```\n")
    assert q.readme_problems(str(readme), os.path.join(bin_dir, "refmla"), "demo/c.safetensors") == (1, [])


def test_the_docs_pages_beside_the_readme_are_run_too_and_named(bin_dir, tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text("<!-- cpu -->\n```\n$ echo 1.000 in 3 s\n1.004 in 9 s\n```\n")
    (tmp_path / "docs" / "b.md").write_text("x\n\n<!-- cpu -->\n```bash\nexit 2   # exit 0\n```\n")
    (tmp_path / "docs" / "a.md").write_text("<!-- cpu -->\n```python\nprint(2.0 / 3)  # 0.667\n```\n")
    n, problems = q.readme_problems(str(tmp_path / "README.md"), os.path.join(bin_dir, "refmla"))
    assert n == 3 and len(problems) == 1 and problems[0].startswith("docs/b.md line 4: `exit 2` exited 2")
    (tmp_path / "docs" / "a.md").write_text("<!-- cpu -->\n```python\nprint(2.0 / 3)  # 0.7\n```\n")
    _, problems = q.readme_problems(str(tmp_path / "README.md"), os.path.join(bin_dir, "refmla"))
    assert "docs/a.md line 2: printed '0.6666666666666666', the README says '0.7'" in problems

"""A kernel outside refmla (refmla.kernel's interface, docs/own-kernel.md): the example in
examples/my_kernel, loaded by path, by module and through an entry point, is judged by replay, the
goldens, the sweep and the kernel-regression suite like refmla's own backends; each of three bugs
planted in a copy of it (tests/own_kernel_kit.py, not by refmla) is found by the sweep and named
by replay; a callable that does not meet the interface is one line, exit 2.

The example runs in the Triton interpreter here: shapes are the golden suite's small ones and the
sweeps are narrowed to 4 heads, short batches and a few cases.
"""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

import refmla.api as api
from refmla.backends import named
from refmla.arithmetic import UNSPLIT
from refmla.kernel import InterfaceError, KernelOutputs, declare
from refmla.sweep import SweepConfig, run_sweep

from own_kernel_kit import EXAMPLE, GOLDEN, SPEC, SOURCE, cli, entry_point_dir, planted

pytestmark = [pytest.mark.filterwarnings("ignore::RuntimeWarning"), pytest.mark.slow]

SMALL = GOLDEN / "kimi-h8-len1-31-32-33.safetensors"  # 4 requests of 1, 31, 32, 33 tokens, 4 splits, 8 heads
PAGED = GOLDEN / "kimi-h8-len255-256-257-page16.safetensors"


@pytest.fixture
def example(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.syspath_prepend(str(EXAMPLE))
    from my_kernel.decode import decode

    return decode


def sweep(spec: str, out, layout: str, cases: int, space: tuple = ()):
    cfg = SweepConfig(backends=[spec], budget=120, max_cases=cases, layouts=(layout,), space=["heads=4", "batch=1,2,3", *space],
                      checks=("reference",), repeat=2, max_shrink=3, out=str(out))  # fmt: skip
    return run_sweep(cfg).backends[spec]


# --------------------------------------------------------------------------------------------
# the clean example, every way of naming it
# --------------------------------------------------------------------------------------------


def test_clean_example_passes_replay_by_the_api(example):
    report = api.replay(SMALL, backends={"mine": example}, explain=False, repeat=2)
    e = report.backends["mine"]
    assert e.status == "pass", e.reason
    assert e.info["repeat"]["runs"] == 2 and e.info["repeat"]["deterministic"]  # run twice, bit for bit
    assert e.info["arithmetic"]["split_schedule"] == "sglang"  # judged at the arithmetic it declares
    assert e.lse is not None and e.lse.status == "pass"  # its lse is judged
    assert e.splits is not None and e.splits.status == "pass"  # and its split partials
    assert e.info["layout"] == "block_table" and "page-size-1" in e.info["layout_source"]  # converted
    assert "mine" not in named.entry_point_names() and not named.is_registered("mine")  # only for the call


def test_clean_example_by_module_and_by_file_on_the_command_line():
    file_spec = f"{SOURCE.relative_to(EXAMPLE.parents[1])}:decode"
    p = cli("replay", str(PAGED), "--backend", SPEC, "--backend", file_spec, "--json", "--no-explain")
    assert p.returncode == 0, p.stderr
    entries = json.loads(p.stdout)["backends"]
    assert entries[SPEC]["status"] == entries[file_spec]["status"] == "pass"


def test_entry_point_doctor_golden_check_and_defaults(tmp_path):
    eps = entry_point_dir(tmp_path)
    doctor = cli("doctor", "--json", path=(eps,))
    assert doctor.returncode == 0, doctor.stderr
    row = next(r for r in json.loads(doctor.stdout) if r["backend"] == "my_kernel")
    assert row["usable"] and row["engine"] == "my-kernel" and row["kernel"] == SPEC and row["entry_point"]
    check = cli("golden", "check", str(SMALL), str(PAGED), "--json", path=(eps,))  # the default set includes it
    assert check.returncode == 0, check.stderr
    mine = [r for r in json.loads(check.stdout) if r["backend"] == "my_kernel"]
    assert [r["status"] for r in mine] == ["pass", "pass"]


def test_entry_point_found_in_this_process(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(entry_point_dir(tmp_path)))
    monkeypatch.syspath_prepend(str(EXAMPLE))
    named.refresh()
    try:
        from refmla.pipeline import backend_names
        from refmla.options import ReplayOptions

        assert "my_kernel" in backend_names(ReplayOptions(), "decode")
    finally:
        monkeypatch.undo()
        named.refresh()


def test_clean_example_passes_a_short_sweep(tmp_path):
    os.environ.setdefault("TRITON_INTERPRET", "1")
    b = sweep(f"{SOURCE}:decode", tmp_path, "block_table", 2)
    assert b.available and not b.findings, [f.detail for f in b.findings]
    assert b.counts["reference"].get("pass", 0) == 2


def test_clean_example_passes_the_kernel_regression_suite():
    import subprocess
    import sys

    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([str(EXAMPLE.parents[1]), str(EXAMPLE)]))
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/kernel_regression/test_golden.py",
                        "--backend", SPEC, "-k", "len1-31"], capture_output=True, text=True, env=env,
                       cwd=EXAMPLE.parents[1], timeout=900)  # fmt: skip
    assert p.returncode == 0 and "1 passed" in p.stdout, p.stdout[-2000:]


# --------------------------------------------------------------------------------------------
# three bugs planted in copies of it: found by the sweep, named by replay
# --------------------------------------------------------------------------------------------


def test_split_boundary_found_and_named(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    spec = planted("split_boundary", tmp_path)
    b = sweep(spec, tmp_path / "sweep", "decode", 3)
    assert any(f.check == "reference" for f in b.findings)
    e = api.replay(SMALL, [spec]).backends[spec]
    assert e.status == "fail"
    # the requests whose last split holds one token (1 and 33 tokens), their partials right, the merge wrong
    assert e.localization.requests == [0, 3] and e.localization.stage == "stage2", e.localization.text()
    assert e.explanation is not None


def test_lse_base_found_and_named(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    spec = planted("lse_base", tmp_path)
    b = sweep(spec, tmp_path / "sweep", "decode", 2)
    assert any(f.check == "reference" and "lse" in f.detail for f in b.findings)
    e = api.replay(SMALL, [spec]).backends[spec]
    assert e.status == "fail" and e.comparison.passed  # the output is right, the lse is not
    assert e.localization.cause == {"hypothesis": "lse_units", "detail": {"units": "log2"}, "requests": [0, 1, 2, 3]}


def test_page_offset_found_and_named(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    spec = planted("page_offset", tmp_path)
    b = sweep(spec, tmp_path / "sweep", "block_table", 2, ("page=16,64",))  # a real block table: the walk starts at its edges
    found = [f for f in b.findings if f.check == "reference" and f.capture]
    assert found and found[0].replay_verdict == "diverged"
    assert found[0].shrunk["page_size"] > 1  # a real block table, pages of many rows
    e = api.replay(found[0].capture, [spec]).backends[spec]
    assert e.status == "fail" and e.localization.stage == "stage1"  # the positions it reads, not the merge
    assert e.explanation is not None and e.explanation.hypothesis in (
        "block_table_read_off", "kv_range_missing", "pages_read_off", "null_block_read", "other_rows_read")


# --------------------------------------------------------------------------------------------
# qlen > 1: the example declares a causal verify (modes decode + verify), not a tree
# --------------------------------------------------------------------------------------------

VERIFY = GOLDEN / "kimi-h8-verify-q3.safetensors"  # 3 drafts a request, a chain (causal)
TREE = GOLDEN / "dsv3-h16-verify-q4-tree.safetensors"


def test_clean_example_passes_the_causal_verify_goldens_and_skips_the_tree(example):
    for path in (VERIFY, GOLDEN / "kimi-h8-verify-q2-page16.safetensors"):
        e = api.replay(path, backends={"mine": example}, explain=False).backends["mine"]
        assert e.status == "pass", (path.name, e.reason)
        assert e.lse is not None and e.lse.status == "pass"
    e = api.replay(TREE, backends={"mine": example}, explain=False).backends["mine"]
    assert e.status == "skipped" and "tree_mask=False" in e.reason
    decode_only = declare(layout="block_table")(lambda inp: example(inp))  # what it does not declare is not run
    e = api.replay(VERIFY, backends={"d": decode_only}, explain=False).backends["d"]
    assert e.status == "skipped" and "declares modes decode; the capture is verify mode" in e.reason


def test_causal_bug_found_by_the_verify_sweep_and_named(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    spec = planted("causal", tmp_path)
    b = sweep(spec, tmp_path / "sweep", "verify", 2, ("qlen=2",))  # a chain of two drafts
    found = [f for f in b.findings if f.check == "reference" and f.capture]
    assert found and found[0].replay_verdict == "diverged" and found[0].shrunk["mode"] == "verify"
    e = api.replay(VERIFY, [spec]).backends[spec]
    assert e.status == "fail" and e.explanation is not None
    assert (e.explanation.hypothesis, e.explanation.detail) == ("causal_alignment", {"alignment": "none"}), e.explanation.text()


# --------------------------------------------------------------------------------------------
# the interface: what is not a kernel of it is a usage error; what a kernel does is its verdict
# --------------------------------------------------------------------------------------------


def wrong_dtype(inp):  # the goldens' out is fp32
    return inp.out.to(torch.float16).zero_()


def returns_nothing(inp):
    inp.out.zero_()


def raises(inp):
    raise RuntimeError("tile 3 of 4 not implemented")


def test_wrong_output_and_signature_are_interface_errors():
    with pytest.raises(InterfaceError, match=r"returned out float16 \[4, 8, 512\]; expected float32 \[4, 8, 512\]"):
        api.replay(SMALL, backends={"k": wrong_dtype}, explain=False)
    with pytest.raises(InterfaceError, match=r"returned None; expected a refmla.kernel.KernelOutputs"):
        api.replay(SMALL, backends={"k": returns_nothing}, explain=False)
    with pytest.raises(InterfaceError, match=r"cannot be called with one argument"):
        api.replay(SMALL, backends={"k": lambda q, kv: None}, explain=False)
    bad_lse = lambda inp: KernelOutputs(out=inp.out.zero_(), lse=inp.lse[:, :1])  # noqa: E731
    with pytest.raises(InterfaceError, match=r"returned lse float32 \[4, 1\]; expected a floating \[4, 8\]"):
        api.replay(SMALL, backends={"k": bad_lse}, explain=False)


def test_a_kernel_that_raises_or_crashes_is_its_error(tmp_path):
    report = api.replay(SMALL, backends={"r": raises}, explain=False)
    assert report.backends["r"].status == "error" and "tile 3 of 4" in report.backends["r"].reason
    assert report.verdict == "diverged"
    # a crash needs the kernel's own process: the command line's (the suite runs kernels in-process)
    (tmp_path / "seg.py").write_text("import os, signal\n\ndef decode(inp):\n    os.kill(os.getpid(), signal.SIGSEGV)\n")
    p = cli("replay", str(SMALL), "--backend", f"{tmp_path}/seg.py:decode", "--json", "--no-explain")
    assert p.returncode == 1, p.stderr
    entry = json.loads(p.stdout)["backends"][f"{tmp_path}/seg.py:decode"]
    assert entry["status"] == "error" and "killed by SIGSEGV" in entry["reason"]


def test_interface_error_on_the_command_line_is_one_line_exit_2(tmp_path):
    (tmp_path / "k.py").write_text("import torch\n\ndef decode(inp):\n    return inp.out.to(torch.float16)\n")
    p = cli("replay", str(SMALL), "--backend", f"{tmp_path}/k.py:decode")
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "returned out float16 [4, 8, 512]; expected float32 [4, 8, 512]" in lines[0], p.stderr
    p = cli("sweep", "--backend", f"{tmp_path}/k.py:decode", "--budget", "30", "--layout", "decode", "--space", "heads=4",
            "--out", str(tmp_path / "sw"))  # fmt: skip
    assert p.returncode == 2 and "returned out float16" in p.stderr.strip().splitlines()[-1], p.stderr[-800:]
    p = cli("replay", str(SMALL), "--backend", "no_such_pkg.mod:decode")
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "cannot import no_such_pkg.mod" in p.stderr


# --------------------------------------------------------------------------------------------
# the other direction: a token-slot kernel on a block-table capture
# --------------------------------------------------------------------------------------------


@declare(layout="token_slots", arithmetic=UNSPLIT)  # one pass, no split
def slots_decode(inp):
    """Plain PyTorch decode over token slots, fp32 (written here from the math, not refmla's reference)."""
    Dv = inp.kv_lora_rank
    for b in range(inp.q.shape[0]):
        rows = inp.kv_indices[int(inp.kv_indptr[b]) : int(inp.kv_indptr[b + 1])]
        kv = inp.kv_buffer[rows, 0].float()  # [L, D]
        s = inp.q[b].float() @ kv.T * (inp.sm_scale * inp.k_scale)  # [H, L]
        if inp.logit_cap > 0:
            s = inp.logit_cap * torch.tanh(s / inp.logit_cap)
        inp.out[b] = (torch.softmax(s, -1) @ kv[:, :Dv] * inp.v_scale).to(inp.out.dtype)
        inp.lse[b] = torch.logsumexp(s, -1)
    return KernelOutputs(out=inp.out, lse=inp.lse)


def test_a_token_slot_kernel_reads_a_block_table_capture_through_its_token_rows():
    from refmla.sweep.cases import capture_of, case_of
    from refmla.sweep.space import Walk, restrict

    point = next(iter(Walk("block_table", restrict("block_table", ["heads=4", "batch=3", "page=16"]), 0)))
    cap = capture_of(case_of("block_table", point, 0, 0))
    assert cap.block_table is not None and cap.meta.page_size == 16
    e = api.replay(cap, backends={"slots": slots_decode}, explain=False).backends["slots"]
    assert e.status == "pass", e.reason
    assert e.info["layout_source"] == "the capture's token rows of its block_table"
    broken = declare(arithmetic=UNSPLIT)(lambda inp: slots_decode(dataclasses.replace(inp, kv_indices=inp.kv_indices.flip(0))))
    assert api.replay(cap, backends={"slots": broken}, explain=False).backends["slots"].status == "fail"

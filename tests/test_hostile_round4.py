"""The fourth round of hostile inputs, one test per class it closes.

    a user's file   no writer replaces a file refmla cannot prove it wrote (refmla.atomic: its marker,
                    or an empty file): golden generate (DIR/ and DIR/sparse/, manifests and cases),
                    synth, synth-disagg, plots (replay, diff-kv, disagg); the sweep writes beside it
    cut generate    SIGTERM while the sparse goldens are written leaves no manifest.json at all
    --plot          every capture kind disagg handles draws or says in one line why not
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import ROOT
from hostile import default_signals, error_lines, run_cli, write_small
from test_signals import wait_for
from refmla.atomic import NOT_OURS, WriteError, write_bytes, written_by_refmla

USER = b"the user's own bytes\n"


def one_error(err: str, *needles: str) -> str:
    lines = [ln for ln in error_lines(err) if ln.startswith("refmla: error:")]
    assert len(lines) == 1, error_lines(err)
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def users(path: Path, data: bytes = USER) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


# --- what refmla may replace ------------------------------------------------------------------


@pytest.mark.parametrize("data", [USER, b'{"format": "not-refmla/1"}', b"\x89PNG\r\n\x1a\n" + b"\0" * 32,
                                  b"\x08\0\0\0\0\0\0\0{\"a\": 1}"])  # fmt: skip
def test_a_file_without_refmlas_marker_is_refused_one_line(tmp_path, data):
    target = users(tmp_path / "f.safetensors", data)
    with pytest.raises(WriteError) as e:
        write_bytes(target, b"new")
    assert NOT_OURS in str(e.value) and str(target) in str(e.value) and "\n" not in str(e.value)
    assert target.read_bytes() == data


def test_an_empty_file_or_one_refmla_wrote_is_replaced(tmp_path):
    empty = users(tmp_path / "empty.json", b"")
    write_bytes(empty, b'{"format": "refmla.x/1"}')
    assert written_by_refmla(empty)
    write_bytes(empty, b'{"format": "refmla.x/1", "again": 1}')  # its own: replaced
    assert b"again" in empty.read_bytes()
    cap = write_small(tmp_path / "c.safetensors")  # a capture written by hand, with refmla's format
    assert written_by_refmla(cap)


# --- golden generate ----------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["sparse/manifest.json", "sparse/dsv32-dsa-h16.safetensors", "h64-logit-cap30.safetensors",
                                   "indexer/manifest.json", "indexer/indexer-v4-c4-h64.safetensors",
                                   "dcp/manifest.json",
                                   "dcp/kimi-k2-tp8-dcp2-len37-16-1-5/rank1.safetensors"])  # fmt: skip
def test_golden_generate_keeps_a_users_file(tmp_path, where):
    out = tmp_path / "golden"
    mine = users(out / where)
    code, stdout, err = run_cli("golden", "generate", "--out", str(out))
    assert code == 2, err
    one_error(err, str(mine))
    assert mine.read_bytes() == USER
    written = [p for p in out.rglob("*") if p.is_file() and p != mine]
    assert written == [], written  # refused before anything was written


SLOW_SPARSE = """
import sys, time
import refmla.golden.sparse as sparse
real = sparse.write_case
def slow(name, out):
    entry = real(name, out)
    for _ in range(6000):  # the sparse goldens are being written when the signal comes: Python runs
        time.sleep(0.1)    # between short waits, as real work does (one 600 s C call could hold a
    return entry           # handler pending past the test's wait)
sparse.write_case = slow
from refmla.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_sigterm_while_the_sparse_goldens_are_written_leaves_no_manifest(tmp_path):
    out = tmp_path / "golden"
    env = dict(os.environ, PYTHONPATH=str(ROOT), TRITON_INTERPRET="1")
    argv = [sys.executable, "-c", SLOW_SPARSE, "golden", "generate", "--out", str(out)]
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                            preexec_fn=default_signals)
    try:
        assert wait_for(lambda: any((out / "sparse").glob("*.safetensors")), 240), "the sparse goldens never started"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 143, err.decode()[-2000:]
    assert not (out / "manifest.json").exists() and not (out / "sparse" / "manifest.json").exists()


# --- synth ----------------------------------------------------------------------------------------


def test_synth_keeps_a_users_file_and_replaces_its_own(tmp_path):
    mine = users(tmp_path / "mine.safetensors")
    code, _, err = run_cli("synth", str(mine))
    assert code == 2
    one_error(err, str(mine), "refmla did not write it")
    assert mine.read_bytes() == USER
    ours = tmp_path / "ours.safetensors"
    assert run_cli("synth", str(ours))[0] == 0
    assert run_cli("synth", str(ours), "--fault", "wrong_sm_scale")[0] == 0  # its own: replaced


def test_synth_disagg_keeps_a_users_file(tmp_path):
    mine = users(tmp_path / "pair" / "decode" / "L1-R0-s1.safetensors")
    code, _, err = run_cli("synth-disagg", str(tmp_path / "pair"))
    assert code == 2
    one_error(err, str(mine))
    assert mine.read_bytes() == USER


# --- plots ----------------------------------------------------------------------------------------


def test_replay_plot_keeps_a_users_png(tmp_path):
    pytest.importorskip("matplotlib")
    cap = write_small(tmp_path / "c.safetensors")
    plots = tmp_path / "plots"
    mine = users(plots / "c.heatmap.png", b"\x89PNG\r\n\x1a\n" + b"\0" * 40)
    code, out, err = run_cli("replay", str(cap), "--backend", "reference", "--plot", str(plots))
    assert code == 2 and "verdict  agree" in out  # the report is not the cost of a refused plot
    one_error(err, str(mine))
    assert mine.read_bytes() == b"\x89PNG\r\n\x1a\n" + b"\0" * 40
    os.unlink(mine)
    assert run_cli("replay", str(cap), "--backend", "reference", "--plot", str(plots))[0] == 0
    assert run_cli("replay", str(cap), "--backend", "reference", "--plot", str(plots))[0] == 0  # its own: replaced
    assert written_by_refmla(mine)


def test_diff_kv_plot_keeps_a_users_png(tmp_path):
    pytest.importorskip("matplotlib")
    from test_diffkv import pair

    def corrupt(pool, slots):
        pool[slots[0][20:40], 0, 1] += 1.0

    p, d, _ = pair(tmp_path, decode_mutate=corrupt)
    mine = users(tmp_path / "plots" / "diffkv.decode.png")
    code, out, err = run_cli("diff-kv", p, d, "--plot", str(tmp_path / "plots"))
    assert code == 2 and "MISMATCH" in out
    one_error(err, str(mine))
    assert mine.read_bytes() == USER


# --- the sweep's shrunk captures --------------------------------------------------------------------


def test_the_sweep_writes_its_shrunk_capture_beside_a_users_file(tmp_path, monkeypatch):
    import refmla.backends as backends
    import sweep_standins
    from refmla.sweep import SweepConfig, run_sweep

    monkeypatch.setitem(backends._CACHE, "triton", sweep_standins.RaisesAt8Heads())
    mine = [users(tmp_path / f"triton-reference-decode-{i}.safetensors") for i in range(2)]
    rep = run_sweep(SweepConfig(backends=["triton"], budget=600, out=str(tmp_path), max_cases=2, layouts=["decode"],
                                space=["heads=8", "batch=1", "length=page+1", "page=16", "kv=bfloat16", "cap=0",
                                       "splits=1", "table=shuffled", "null=nan"], max_shrink=2))  # fmt: skip
    (f,) = rep.findings
    assert all(p.read_bytes() == USER for p in mine)
    assert f.capture and Path(f.capture).name.endswith(".2.safetensors") and written_by_refmla(f.capture), f


# --- disagg --plot: drawn, or said why not, for every kind of capture disagg handles ------------------


def plot_lines(err: str) -> list[str]:
    return [ln for ln in error_lines(err) if "--plot" in ln]


@pytest.fixture(scope="module")
def disagg_pairs(tmp_path_factory):
    """preset, fault -> the folder of a synthetic prefill / decode pair (refmla synth-disagg)."""
    made = {}

    def make(preset: str, fault: str = "none") -> Path:
        if (preset, fault) not in made:
            folder = tmp_path_factory.mktemp("pair") / f"{preset}-{fault}"
            assert run_cli("synth-disagg", str(folder), "--preset", preset, "--fault", fault)[0] == 0
            made[preset, fault] = folder
        return made[preset, fault]

    return make


@pytest.mark.parametrize("preset", ["disagg-small", "disagg-v32"])  # dense decode side, sparse decode side
def test_disagg_plot_of_a_clean_pair_says_there_is_nothing_to_draw(disagg_pairs, tmp_path, preset):
    pytest.importorskip("matplotlib")
    folder = disagg_pairs(preset)
    plots = tmp_path / "plots"
    code, out, err = run_cli("disagg", str(folder / "prefill"), str(folder / "decode"), "--backend", "reference",
                             "--plot", str(plots))  # fmt: skip
    assert code == 0, err
    (line,) = plot_lines(err)
    assert "nothing drawn: every row is clean" in line and str(plots) in line
    assert not list(plots.rglob("*.png"))


def test_disagg_plot_of_a_sparse_transfer_fault_draws_it(disagg_pairs, tmp_path):
    pytest.importorskip("matplotlib")
    folder = disagg_pairs("disagg-v4", "compressed_page_missing")
    plots = tmp_path / "plots"
    code, out, err = run_cli("disagg", str(folder / "prefill"), str(folder / "decode"), "--backend", "reference",
                             "--plot", str(plots))  # fmt: skip
    assert code == 1 and "TRANSFER" in out, err
    assert plot_lines(err) == [] and [p.name for p in plots.rglob("*.png")] == ["diffkv.L2-R0-s0.png"], err


def test_disagg_plot_says_which_faulty_rows_it_cannot_draw(disagg_pairs, tmp_path):
    """A KV writer's capture on the prefill side (made by tests/test_disagg_writer.py's plain loop):
    its row's fault is the writer's, which no plot draws: said in one line naming the row."""
    pytest.importorskip("matplotlib")
    from refmla.disagg.plan import read_header
    from test_disagg_writer import writer_capture

    folder = disagg_pairs("disagg-small")
    first = read_header(str(sorted((folder / "prefill").glob("*.safetensors"))[0]))
    writer = tmp_path / "writer.safetensors"
    writer_capture(writer, first.rids, first.layer, forget_scale=True)
    plots = tmp_path / "plots"
    code, out, err = run_cli("disagg", str(folder / "prefill"), str(writer), "--decode", str(folder / "decode"),
                             "--backend", "reference", "--plot", str(plots))  # fmt: skip
    assert code == 1, err
    (line,) = plot_lines(err)
    assert "not drawn" in line and f"layer {first.layer}" in line and "row(s) with a fault" in line, line


def test_a_refused_disagg_plot_costs_no_report(disagg_pairs, tmp_path):
    pytest.importorskip("matplotlib")
    folder = disagg_pairs("disagg-v4", "compressed_page_missing")
    target = users(tmp_path / "plots")  # a file, not a folder
    code, out, err = run_cli("disagg", str(folder / "prefill"), str(folder / "decode"), "--backend", "reference",
                             "--plot", str(target))  # fmt: skip
    assert code == 2 and "TRANSFER" in out and "verdict" in out
    one_error(err, str(target))
    assert target.read_bytes() == USER

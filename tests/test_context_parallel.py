"""Decode context parallelism: a step's rank captures, written the way vLLM's DCP path lays the
shards by tools/planting_dcp.py (a plain loop of its own, never refmla's reference), replayed as
one call by refmla.cp: clean steps agree, each planted mistake is named with its rank and
positions, and nothing else is named."""

from __future__ import annotations

import json

import pytest
import torch

from helpers import load_tool
from refmla.capture import dcp
from refmla.cp.judge import replay_step

pd = load_tool("planting_dcp")
SEQ = (600, 302, 77, 5)  # the last one shorter than a round of 4 x 16: ranks with empty shards
CONFIGS = {"dcp2-i1": pd.DcpSpec(world=2, interleave=1, block=16, seq_lens=SEQ),
           "dcp4-i16": pd.DcpSpec(world=4, interleave=16, block=64, seq_lens=SEQ)}  # fmt: skip


def _replay(tmp_path, spec, plant, skip_rank=None):
    step = pd.make_step(spec)
    want = plant(step)
    report = replay_step(pd.write(step, tmp_path / "step", skip_rank=skip_rank))
    return step, want, report


@pytest.mark.parametrize("config", CONFIGS)
def test_clean_step_agrees(tmp_path, config):
    _, _, report = _replay(tmp_path, CONFIGS[config], pd.clean)
    assert report.verdict == "agree", report.text()
    assert [r.status for r in report.ranks] == ["pass"] * CONFIGS[config].world
    assert report.combine.status == "pass" and "whole-context reference: pass" in report.combine.note
    assert report.exit_code == 0 and json.loads(json.dumps(report.to_json()))["verdict"] == "agree"


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("plant", sorted(pd.PLANTS))
def test_each_planted_mistake_is_named_with_rank_and_positions(tmp_path, config, plant):
    step, want, report = _replay(tmp_path, CONFIGS[config], pd.PLANTS[plant])
    assert report.verdict == "diverged" and report.exit_code == 1
    got = {(f.hypothesis, f.rank, f.request): f for f in report.findings}
    assert set(got) == {(h, r, b) for h, r, b, _ in want}, report.text()  # named, and nothing else
    for h, r, b, positions in want:
        f = got[(h, r, b)]
        if positions is not None:
            assert f.positions == positions
        else:  # a combine mistake: every request's positions, or the dropped rank's shard
            spec = CONFIGS[config]
            expect = ([[[0, L]] for L in spec.seq_lens] if h == "cp_combine_lse_base" else
                      [pd.runs(p) for p in step["ranks"][r]["positions"]])  # fmt: skip
            assert f.detail["positions_by_request"] == expect


@pytest.mark.parametrize("plant", ["clean", "combine_lse_base", "local_length_masked"])
def test_ranks_that_return_a_log2_lse(tmp_path, plant):
    """Ranks whose kernel returns a log2 lse (meta lse_base log2, vLLM's lse_base_on_e False) and a
    combine that reads it so agree; a combine that reads it as natural (vLLM #43919) is named."""
    spec = pd.DcpSpec(world=4, interleave=1, block=64, seq_lens=SEQ, lse_base="log2")
    step, want, report = _replay(tmp_path, spec, pd.PLANTS.get(plant, pd.clean))
    assert {(f.hypothesis, f.rank, f.request) for f in report.findings} == {(h, r, b) for h, r, b, _ in want}
    assert report.verdict == ("agree" if plant == "clean" else "diverged"), report.text()
    if plant == "combine_lse_base":
        assert {f.detail["merge"] for f in report.findings} == {"log2_as_ln"}


@pytest.mark.parametrize("config", CONFIGS)
def test_a_rank_without_its_capture_is_a_missing_shard(tmp_path, config):
    spec = CONFIGS[config]
    step, _, report = _replay(tmp_path, spec, pd.clean, skip_rank=1)
    assert report.verdict == "diverged"
    assert [(f.hypothesis, f.rank) for f in report.findings] == [("cp_shard_missing", 1)]
    assert report.findings[0].detail["positions_by_request"] == [pd.runs(p) for p in step["ranks"][1]["positions"]]
    assert [r.status for r in report.ranks] == ["pass" if r != 1 else "absent" for r in range(spec.world)]
    assert report.combine.status == "unjudged"


def test_geometry_matches_vllm(monkeypatch):
    """refmla's shard geometry is vLLM's: get_dcp_local_seq_lens per rank, and the positions a
    rank holds are the plain loop's."""
    from refmla.backends.vllm_compat import vllm_triton_on_cpu

    vllm_triton_on_cpu()  # vLLM imported the way that keeps its Triton kernels usable by later tests
    utils = pytest.importorskip("vllm.v1.attention.backends.utils")
    L = torch.tensor([0, 1, 5, 16, 17, 63, 64, 65, 300, 1030])
    for W, I in ((2, 1), (4, 16), (8, 64), (2, 3)):
        for r in range(W):
            got = dcp.local_lens(L, W, r, I)
            assert torch.equal(got, utils.get_dcp_local_seq_lens(L, W, r, I).long())
            spec = pd.DcpSpec(world=W, interleave=I)
            for n, total in zip(got.tolist(), L.tolist()):
                assert dcp.positions(r, n, W, I).tolist() == pd.shard_positions(spec, r, total)
                p = torch.tensor(pd.shard_positions(spec, r, total), dtype=torch.long)
                assert torch.equal(dcp.local_row(p, W, I), torch.arange(n)) and bool((dcp.owner(p, W, I) == r).all())


def test_unusable_steps_are_invalid_naming_file_and_key(tmp_path):
    assert "not a folder" in replay_step(tmp_path / "nope").error
    spec = CONFIGS["dcp2-i1"]
    step = pd.make_step(spec)
    pd.clean(step)
    folder = pd.write(step, tmp_path / "twice")
    (folder / "rank1.safetensors").rename(folder / "rank1-copy.safetensors")
    pd.write(step, folder)
    report = replay_step(folder)
    assert report.verdict == "invalid" and report.exit_code == 2 and "'dcp_rank'" in report.error


def test_cli_replay_cp_exit_codes_and_json(tmp_path):
    """`refmla replay-cp`: 0 on a clean step, 1 naming the mistake, 2 with one line on a bad folder."""
    import subprocess
    import sys

    spec = pd.DcpSpec(world=2, interleave=1, block=16, seq_lens=(77, 5))
    runs = {}
    for name, plant in (("clean", pd.clean), ("offset", pd.PLANTS["geometry_offset"])):
        step = pd.make_step(spec)
        plant(step)
        folder = pd.write(step, tmp_path / name)
        runs[name] = subprocess.run([sys.executable, "-m", "refmla", "replay-cp", str(folder), "--json"],
                                    capture_output=True, text=True, timeout=600)  # fmt: skip
    assert runs["clean"].returncode == 0, runs["clean"].stderr[-2000:]
    assert json.loads(runs["clean"].stdout)["verdict"] == "agree"
    assert runs["offset"].returncode == 1
    (f,) = json.loads(runs["offset"].stdout)["findings"]
    assert (f["hypothesis"], f["rank"], f["request"]) == ("cp_shard_geometry", 1, 0)
    bad = subprocess.run([sys.executable, "-m", "refmla", "replay-cp", str(tmp_path / "missing")],
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "folder" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.parametrize("change, key", [
    ({"dcp_interleave_size": None}, "'dcp_interleave_size'"),
    ({"dcp_rank": 2}, "'dcp_rank'"),
    ({"dcp_tot_seq_lens": [77]}, "'dcp_tot_seq_lens'"),
    ({"dcp_world_size": None, "dcp_rank": None, "dcp_interleave_size": None}, "'dcp_world_size'"),
])  # fmt: skip
def test_bad_dcp_meta_is_refused_naming_the_key(tmp_path, change, key, monkeypatch):
    """A rank capture whose DCP keys are incomplete or out of range is not written (nor read)."""
    from refmla.capture import CaptureError, write_capture

    spec = pd.DcpSpec(world=2, interleave=1, block=16, seq_lens=(77, 5))
    step = pd.make_step(spec)
    pd.clean(step)
    captured = {}
    import refmla.capture as capture_mod

    def grab(path, tensors, meta):
        captured.setdefault("first", (path, tensors, meta))

    monkeypatch.setattr(capture_mod, "write_capture", grab)
    pd.write(step, tmp_path / "s")
    path, tensors, meta = captured["first"]
    meta = {k: v for k, v in {**meta, **change}.items() if v is not None}
    with pytest.raises(CaptureError, match=key):
        write_capture(path, tensors, meta)


def test_a_hook_folder_of_several_steps_is_split_by_layer_and_step(tmp_path):
    """The hook writes every layer and step of every rank into one folder: replay-cp judges each
    (layer, step) as its own step; a mistake in one is named there only."""
    from refmla.capture import read_capture, write_capture
    from refmla.cp.judge import replay_folder

    spec = pd.DcpSpec(world=2, interleave=1, block=16, seq_lens=(77, 5))
    for step_no, plant in ((7, pd.clean), (8, pd.PLANTS["geometry_offset"])):
        step = pd.make_step(spec)
        plant(step)
        pd.write(step, tmp_path / f"s{step_no}")
        for f in (tmp_path / f"s{step_no}").iterdir():  # the same files, renamed and re-stamped with their step
            cap = read_capture(f)
            tensors = {k: v for k, v in cap.tensors().items() if k not in ("kv_indptr", "kv_indices", "orig_kv_indices")}
            write_capture(tmp_path / "all" / f"{f.stem}-s{step_no}.safetensors", tensors, {**cap.meta.to_json(), "step": step_no})
    reports = replay_folder(tmp_path / "all")
    assert [r.folder.endswith(f"(layer 3, step {n})") for r, n in zip(reports, (7, 8))] == [True, True]
    assert [r.verdict for r in reports] == ["agree", "diverged"]
    assert [(f.hypothesis, f.rank) for f in reports[1].findings] == [("cp_shard_geometry", 1)]


@pytest.mark.parametrize("change, key", [("rank_past_world", "'dcp_rank'"), ("other_heads", "'q'")])
def test_ranks_that_cannot_be_one_step_are_invalid(tmp_path, change, key):
    """A rank numbered past the agreed world, or a rank with other heads: exit 2 naming the file and key."""
    from refmla.capture import read_capture, write_capture

    spec = pd.DcpSpec(world=2, interleave=1, block=16, seq_lens=(77, 5))
    step = pd.make_step(spec)
    pd.clean(step)
    folder = pd.write(step, tmp_path / "s")
    cap = read_capture(folder / "rank1.safetensors")
    t = {k: v for k, v in cap.tensors().items() if k not in ("kv_indptr", "kv_indices", "orig_kv_indices")}
    meta = cap.meta.to_json()
    if change == "rank_past_world":
        meta.update(dcp_world_size=4, dcp_rank=3)
        t["dcp_out"] = t["dcp_out"][:, :4]  # its share of the heads among 4
    else:
        t["q"], t["out"], t["lse"] = t["q"][:, :8], t["out"][:, :8], t["lse"][:, :8]
        t["dcp_out"] = t["dcp_out"][:, :4]
    write_capture(folder / "rank1.safetensors", t, meta)
    report = replay_step(folder)
    assert report.verdict == "invalid" and report.exit_code == 2 and key in report.error and "rank" in report.error


def test_the_one_replay_judges_a_folder_of_ranks_as_one_step(tmp_path):
    """`refmla replay FOLDER` (and --jobs, and the API) judge the DCP ranks of a step as one call,
    beside the other captures given: a clean step agrees, a planted one names rank and positions,
    a lone rank file is the decode capture it is; `replay-cp` stays."""
    import subprocess
    import sys

    import refmla
    from refmla.synthetic import synth_capture, preset

    spec = pd.DcpSpec(world=2, interleave=1, block=16, seq_lens=(77, 5))
    want = {}
    for name, plant in (("clean", pd.clean), ("offset", pd.PLANTS["geometry_offset"])):
        step = pd.make_step(spec)
        want[name] = plant(step)
        pd.write(step, tmp_path / name)
    synth_capture(tmp_path / "plain.safetensors", preset("kimi-k2-tp8"), "none")
    args = [str(tmp_path / "clean"), str(tmp_path / "offset"), str(tmp_path / "plain.safetensors")]
    for jobs in ("1", "2"):
        run = subprocess.run([sys.executable, "-m", "refmla", "replay", *args, "--json", "--jobs", jobs, "--backend", "reference"],
                             capture_output=True, text=True, timeout=900)  # fmt: skip
        assert run.returncode == 1, run.stderr[-2000:]
        docs = json.loads(run.stdout)
        assert [d["capture"] for d in docs] == args
        assert [d["verdict"] for d in docs] == ["agree", "diverged", "agree"]
        assert [d.get("kind") for d in docs[:2]] == ["context_parallel"] * 2
        assert docs[0]["backends"]["rank 0"]["status"] == "pass" and docs[0]["backends"]["combine"]["status"] == "pass"
        (f,) = docs[1]["context_parallel"]["findings"]
        h, r, b, pos = want["offset"][0]
        assert (f["hypothesis"], f["rank"], f["request"], f["positions"]) == (h, r, b, pos)
        assert docs[1]["diagnosis"] == "context_parallel" and docs[1]["backends"]["rank 1"]["status"] == "fail"
        assert docs[1]["backends"]["rank 1"]["explanation"]["hypothesis"] == "cp_shard_geometry"
    lone = subprocess.run([sys.executable, "-m", "refmla", "replay", str(tmp_path / "clean" / "rank1.safetensors"),
                           "--json", "--backend", "reference"], capture_output=True, text=True, timeout=600)  # fmt: skip
    assert lone.returncode == 0 and json.loads(lone.stdout).get("kind") == "dense", lone.stderr[-2000:]
    alias = subprocess.run([sys.executable, "-m", "refmla", "replay-cp", str(tmp_path / "offset")],
                           capture_output=True, text=True, timeout=600)  # fmt: skip
    assert alias.returncode == 1 and "cp_shard_geometry" in alias.stdout
    assert refmla.replay(tmp_path / "clean").verdict == "agree"
    assert refmla.replay(tmp_path / "offset").kind_keys["context_parallel"]["findings"][0]["rank"] == 1
    with pytest.raises(ValueError, match="one step"):
        refmla.replay(tmp_path)


def test_the_one_replay_says_an_unusable_step_in_one_line(tmp_path):
    """Two captures of one rank in a step's folder: `refmla replay` exits 2 with one line naming
    the file and the key, no traceback."""
    import subprocess
    import sys

    spec = pd.DcpSpec(world=2, interleave=1, block=16, seq_lens=(77, 5))
    step = pd.make_step(spec)
    pd.clean(step)
    folder = pd.write(step, tmp_path / "twice")
    (folder / "rank1.safetensors").rename(folder / "rank1-copy.safetensors")
    pd.write(step, folder)
    run = subprocess.run([sys.executable, "-m", "refmla", "replay", str(folder)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 2 and "Traceback" not in run.stderr
    (line,) = [ln for ln in run.stderr.splitlines() if ln.startswith("refmla: error")]
    assert "'dcp_rank'" in line and "rank1" in line


@pytest.mark.parametrize("preset", ["kimi-k2-tp8-dcp2", "kimi-k2-tp8-dcp4"])
def test_synth_presets_write_a_step_clean_and_with_each_fault(tmp_path, preset):
    """`refmla synth OUT --preset kimi-k2-tp8-dcpN [--fault F]`: a folder of rank captures that
    `refmla replay` judges as one step: agree when clean, each planted class named on its rank and
    request, nothing else."""
    import refmla
    from refmla.synthetic.dcp import FAULTS

    for fault in FAULTS:
        planted = refmla.synth(tmp_path / fault, preset, fault)
        report = refmla.replay(tmp_path / fault)
        cp = report.kind_keys["context_parallel"]
        got = {(f["hypothesis"], f["rank"], f["request"] if f["hypothesis"] not in ("cp_combine_lse_base", "cp_shard_missing") else None)
               for f in cp["findings"]}  # fmt: skip
        assert got == {tuple(e) for e in planted["expect"]}, (fault, report.diagnosis_text)
        assert report.verdict == ("agree" if fault == "none" else "diverged"), (fault, report.diagnosis_text)

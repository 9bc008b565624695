"""`refmla replay / synth / doctor` end to end through the CLI entry point (reference + observed)."""

import json

import pytest

from refmla.cli import main
from refmla.diagnosis import BYTES_CONTRACT
from refmla.synthetic import EXPECT, FAULT_MODES, FAULTS, preset, synth_capture
from refmla.synthetic import MAY_AGREE

CONTRACT_BACKEND_KEYS = {"status", "reason", "max_abs_err", "cos_diff", "worst"}


def _replay_json(capsys, *argv):
    code = main(["replay", *argv, "--json", "--backend", "reference"])
    return code, json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("name", ["kimi-k2-tp8", "deepseek-v3-tp8", "hostile", "kimi-k2-tp8-extend"])
def test_clean_capture_agrees(tmp_path, capsys, name):
    path = tmp_path / f"{name}.safetensors"
    synth_capture(path, preset(name), "none")
    code, r = _replay_json(capsys, str(path))
    assert code == 0 and r["verdict"] == "agree" and r["diagnosis"] is None
    assert {"capture", "verdict", "diagnosis", "metadata", "backends"} <= r.keys()
    md = r["metadata"]
    assert md["ok"] is True and md["errors"] == [] and md["warnings"] == []
    for b in ("reference", "observed"):
        assert r["backends"][b]["status"] == "pass"
    for name, b in r["backends"].items():  # skipped ones too, with nulls
        assert CONTRACT_BACKEND_KEYS <= b.keys(), name


@pytest.mark.parametrize("fault", [f for f in FAULTS if EXPECT[f] is not None and FAULT_MODES[f] is None])
def test_planted_fault_diverges_at_the_right_request(tmp_path, capsys, fault):
    """A data fault diverges at its request; a numerics fault is diagnosed ``numerics`` (or, when
    the variant stays within tolerance, agrees)."""
    path = tmp_path / f"{fault}.safetensors"
    try:
        planted = synth_capture(path, preset("kimi-k2-tp8"), fault)
    except ValueError:  # a fault that needs pages (the zoo's page faults): the paged preset
        planted = synth_capture(path, preset("kimi-k2-tp8-page256"), fault)
    code, r = _replay_json(capsys, str(path))
    obs = r["backends"]["observed"]
    if EXPECT[fault] is None or (fault in MAY_AGREE and obs["status"] == "pass"):
        assert code == 0 and r["verdict"] == "agree", obs
        return
    assert code == 1 and r["verdict"] == "diverged" and obs["status"] == "fail"
    if EXPECT[fault] == "numerics":
        assert r["diagnosis"] == "numerics" and planted["variant"] in r["diagnosis_text"]
        return
    contract = ("kv_contract",) if EXPECT[fault] in BYTES_CONTRACT else ()  # the bytes read another way
    assert r["diagnosis"] in ("observed", "observed_unconfirmed", *contract)
    if "request" in planted:
        assert obs["worst"]["request"] == planted["request"]


def test_several_captures_and_directories_give_an_array_and_the_worst_exit(tmp_path, capsys):
    synth_capture(tmp_path / "a.safetensors", preset("hostile"), "none")
    synth_capture(tmp_path / "b.safetensors", preset("hostile"), "wrong_sm_scale")
    (tmp_path / "c.safetensors").write_bytes(b"garbage")
    code = main(["replay", str(tmp_path), "--json", "--backend", "reference"])
    captured = capsys.readouterr()
    assert captured.out, captured.err
    reports = json.loads(captured.out)
    assert code == 2 and [r["verdict"] for r in reports] == ["agree", "diverged", "invalid"]


def test_table_output_names_the_diverging_path(tmp_path, capsys):
    path = tmp_path / "f.safetensors"
    synth_capture(path, preset("hostile"), "kv_range_zero")
    assert main(["replay", str(path), "--backend", "reference"]) == 1
    out = capsys.readouterr().out
    assert "observed" in out and "FAIL" in out and "verdict  diverged" in out


def test_unknown_preset_or_fault_is_a_usage_error(tmp_path, capsys):
    assert main(["synth", str(tmp_path / "x.safetensors"), "--preset", "nope"]) == 2
    assert main(["synth", str(tmp_path / "x.safetensors"), "--fault", "nope"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(line.startswith("refmla: error:") for line in err)


def test_doctor_lists_every_backend(capsys):
    assert main(["doctor", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    names = [r["backend"] for r in rows if r["kind"] == "dense"]  # only ever added to
    assert names == ["reference", "observed", "triton", "aiter", "extend", "flex", "triton_decode_per_query",
                     "aiter_decode_per_query", "vllm_triton", "flashmla", "flashinfer_mla", "cutlass_mla", "fa3_mla"]
    sparse = [r["backend"] for r in rows if r["kind"] == "sparse_decode"]  # the sparse decode kernels (issue 28)
    assert sparse == ["triton", "aiter_sparse", "tilelang", "flashmla_sparse"]
    merges = {r["backend"]: r for r in rows if r["kind"] == "merge"}  # the state merges (issue 32)
    assert list(merges) == ["vllm_triton_merge", "sglang_triton_merge"]
    assert merges["sglang_triton_merge"]["usable"], merges["sglang_triton_merge"]["detail"]  # SGLang installed here
    indexers = {r["backend"]: r for r in rows if r["kind"] == "indexer"}  # the engines' indexer code, the GPU adapters
    assert list(indexers) == ["sglang_indexer_torch", "vllm_indexer_torch", "deepgemm_paged", "deepgemm_ragged",
                              "tilelang_indexer", "aiter_indexer"]
    for name in ("deepgemm_paged", "tilelang_indexer", "aiter_indexer"):  # absent here: unavailable, with why
        assert indexers[name]["usable"] or "not installed" in indexers[name]["detail"] or "GPU" in indexers[name]["detail"]
    assert all(isinstance(r["usable"], bool) and r["detail"] for r in rows)


def test_a_skipped_backend_still_carries_every_contract_key(tmp_path, capsys):
    path = tmp_path / "h.safetensors"
    synth_capture(path, preset("hostile"), "none")
    assert main(["replay", str(path), "--backend", "aiter", "--json", "--allow-skip"]) == 0  # no ROCm: skipped (issue 29)
    entry = json.loads(capsys.readouterr().out)["backends"]["aiter"]
    assert CONTRACT_BACKEND_KEYS <= entry.keys()
    if entry["status"] == "skipped":  # no ROCm here: the numbers are null, the reason is not
        assert entry["reason"] and entry["max_abs_err"] is None and entry["worst"] is None


KIND_PRESETS = {"kv_write": "kv-write-fp8", "kv_write (packed)": "kv-write-v4", "merge": "merge-chunked-prefill",
                "chunked_prefill": "chunked-prefill", "indexer": "indexer-v32"}  # fmt: skip


@pytest.mark.parametrize("kind", list(KIND_PRESETS))
def test_every_kind_prints_the_dense_documents_keys(tmp_path, capsys, kind):
    """Issue 32: a KV writer, merge or chunked-prefill report has the shape of every other kind's."""
    dense, other = tmp_path / "d.safetensors", tmp_path / "k.safetensors"
    synth_capture(dense, preset("kimi-k2-tp8"), "none")
    assert main(["synth", str(other), "--preset", KIND_PRESETS[kind]]) == 0
    capsys.readouterr()
    (_, d), (code, k) = _replay_json(capsys, str(dense)), _replay_json(capsys, str(other))
    shared = {"capture", "verdict", "diagnosis", "diagnosis_text", "diagnosis_backends", "metadata", "mode", "meta",
              "kind", "backends"}  # fmt: skip
    assert code == 0 and shared <= d.keys() and shared <= k.keys()
    assert k["kind"] == k["mode"] == kind.split()[0] and d["kind"] == "dense" and k["diagnosis_backends"] == []
    for name, b in k["backends"].items():
        assert CONTRACT_BACKEND_KEYS <= b.keys(), name

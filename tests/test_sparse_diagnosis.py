"""A sparse replay's diagnosis is the typed Diagnosis dense replay gives (refmla.diagnosis.diagnose_sparse):
the same classes, the same JSON keys, the text printed from it; each failing path's explanation in
the sentence; the production kernel (meta backend) named when it was not replayed."""

from __future__ import annotations

import json

import pytest

from refmla.cli import main
from refmla.diagnosis import Diagnosis, diagnose_sparse
from refmla.sparse import backends as sparse_backends
from refmla.sparse.backends import PathOutput, Unavailable
from refmla.sparse.make import synth_sparse
from refmla.options import ReplayOptions
from refmla.pipeline import replay_file
from refmla.results import BackendEntry

V4 = "deepseek-v4-flash-tp8"
DIAGNOSIS_KEYS = ("diagnosis", "diagnosis_text", "diagnosis_backends")


def test_the_json_has_dense_replays_diagnosis_keys_and_types(tmp_path, capsys):
    sparse, dense = tmp_path / "s.safetensors", tmp_path / "d.safetensors"
    synth_sparse(sparse, V4, "sink_omitted")
    assert main(["synth", str(dense)]) == 0
    capsys.readouterr()
    docs = []
    for path in (sparse, dense):
        main(["replay", str(path), "--json", "--backend", "reference", "--backend", "observed"])
        docs.append(json.loads(capsys.readouterr().out))
    s, d = docs
    assert all(k in s and k in d for k in DIAGNOSIS_KEYS)
    assert [type(s[k]) for k in DIAGNOSIS_KEYS] == [str, str, list] and d["diagnosis"] is None
    assert [type(d[k]) for k in DIAGNOSIS_KEYS[1:]] == [str, list]
    assert s["diagnosis"] == "observed_unconfirmed" and s["diagnosis_backends"] == ["observed"]
    assert "sink_omitted" in s["diagnosis_text"]


def test_a_planted_fault_with_triton_agreeing_is_observed_and_the_table_prints_it(tmp_path, capsys):
    path = tmp_path / "f.safetensors"
    synth_sparse(path, V4, "extra_cache_ignored")
    r = replay_file(str(path), ReplayOptions(backends=["reference", "observed", "triton"]))
    assert r.diagnosis == "observed" and r.diagnosis_backends == ["observed"]
    assert "offline path (triton) agrees" in r.diagnosis_text
    assert "observed: explained by extra_cache_ignored" in r.diagnosis_text
    assert main(["replay", str(path), "--backend", "reference", "--backend", "observed", "--backend", "triton"]) == 1
    assert f"diagnosis observed: {r.diagnosis_text}" in capsys.readouterr().out


def test_a_clean_replay_is_null_and_an_invalid_one_metadata(tmp_path):
    path = tmp_path / "c.safetensors"
    synth_sparse(path, V4)
    r = replay_file(str(path), ReplayOptions(backends=["reference", "observed"]))
    assert r.verdict == "agree" and r.diagnosis is None and r.to_json()["diagnosis_backends"] == []
    (tmp_path / "bad.safetensors").write_bytes(path.read_bytes()[:4000])
    bad = replay_file(str(tmp_path / "bad.safetensors"), ReplayOptions())
    assert bad.verdict == "invalid" and bad.diagnosis == "metadata" and bad.to_json()["diagnosis"] == "metadata"


def _wrong_kernel(cap):
    """A kernel that doubles every output: planted from the capture's own stored out, not the reference."""
    return PathOutput(cap.out.double() * 2.0, None, "planted: every output doubled")


def test_a_diverging_kernel_is_decode_with_the_production_output_agreeing(tmp_path, monkeypatch):
    path = tmp_path / "k.safetensors"
    synth_sparse(path, V4)
    monkeypatch.setitem(sparse_backends.BACKENDS, "tilelang", _wrong_kernel)
    r = replay_file(str(path), ReplayOptions(backends=["reference", "observed", "tilelang"], explain=False))
    assert r.verdict == "diverged" and r.diagnosis == "decode" and r.diagnosis_backends == ["tilelang"]
    assert "(tilelang) while the production output agrees" in r.diagnosis_text


def _entry(name, status, note=""):
    return name, BackendEntry(status, reason=note or None)


@pytest.mark.parametrize("case", ["both_bad", "error_only", "aiter_unreplayed", "flashmla_unreplayed"])
def test_classes_from_each_paths_status(case):
    ref = _entry("reference", "pass")
    if case == "both_bad":  # the kernel and production diverge, nothing agrees: decode, the inputs not excluded
        d = diagnose_sparse(dict([ref, _entry("observed", "fail"), _entry("triton", "fail")]))
        assert d.name == "decode" and d.backends == ["triton", "observed"] and "not excluded" in d.text
    elif case == "error_only":
        d = diagnose_sparse(dict([ref, _entry("observed", "pass"), _entry("triton", "error", "RuntimeError: boom")]))
        assert d.name == "backend_error" and d.backends == ["triton"]
    elif case == "aiter_unreplayed":  # production ran aiter_sparse, skipped here: the sentence names it
        d = diagnose_sparse(dict([ref, _entry("observed", "fail"), _entry("triton", "pass"),
                                  _entry("aiter_sparse", "skipped", "aiter is not importable (no ROCm)")]), "aiter_sparse")  # fmt: skip
        assert d.name == "observed" and "pa_decode_sparse (aiter_sparse), not replayed here: aiter is not importable" in d.text
    else:  # production ran FlashMLA, not replayed here: said so, not blamed on the state or a transfer
        d = diagnose_sparse(dict([ref, _entry("observed", "fail"), _entry("triton", "pass"),
                                  _entry("flashmla_sparse", "skipped", "flash_mla is not installed")]), "flashmla")  # fmt: skip
        assert d.name == "observed" and "production ran FlashMLA (flashmla), not replayed here: flash_mla is not installed" in d.text
        assert "not evidence of a state or transfer problem" in d.text and "KV not yet transferred" not in d.text


def test_unavailable_kernels_are_not_findings(tmp_path, monkeypatch):
    def gone(cap):
        raise Unavailable("not here")

    path = tmp_path / "u.safetensors"
    synth_sparse(path, V4)
    monkeypatch.setitem(sparse_backends.BACKENDS, "triton", gone)
    r = replay_file(str(path), ReplayOptions(backends=["reference", "observed", "triton"]))
    assert r.verdict == "agree" and r.diagnosis is None and r.backends["triton"].status == "skipped"

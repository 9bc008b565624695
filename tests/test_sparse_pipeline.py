"""Sparse decode captures take the one replay (refmla.pipeline): the dense document (backends keyed by
name, lower-case statuses, kind), a folder of every kind as one JSON array and one summary (serial
and --jobs), kernels isolated (a planted segfault is that backend's error), observed judged
whatever --backend filter, NaN inputs as upstream_nonfinite, every meta number bounded, empty
shapes defined (issues 28 and 33). Planted outputs come from this file's own code or from
refmla.sparse.faults' plain loop, never from the reference the replay measures with."""

from __future__ import annotations

import ctypes
import json

import pytest
import torch

from refmla.cli import main
from refmla.options import ReplayOptions
from refmla.pipeline import replay_file
from refmla.sparse import backends as sparse_backends
from refmla.sparse.backends import PathOutput
from refmla.sparse.faults import planted_output
from refmla.sparse.make import synth_sparse
from refmla.sparse.presets import sparse_preset
from refmla.sparse.synth import build_case
from refmla.sparse.validation import write_sparse

V4 = "deepseek-v4-flash-tp8"
FAST = ["--backend", "reference", "--backend", "observed"]  # no interpreted kernel: seconds, not minutes


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A dense clean capture, a clean V4 sparse one and a V4 sparse one with a planted fault."""
    d = tmp_path_factory.mktemp("mixed")
    assert main(["synth", str(d / "a_dense.safetensors")]) == 0
    synth_sparse(d / "b_sparse.safetensors", V4)
    synth_sparse(d / "c_sparse_fault.safetensors", V4, "sink_omitted")
    return d


@pytest.mark.parametrize("jobs", ["1", "2"])
def test_a_folder_of_every_kind_is_one_json_array_and_one_summary(folder, capsys, jobs):
    capsys.readouterr()
    assert main(["replay", str(folder), "--json", "--jobs", jobs, *FAST]) == 1
    docs = json.loads(capsys.readouterr().out)  # strict: exactly one document
    assert [d["kind"] for d in docs] == ["dense", "sparse_decode", "sparse_decode"]
    assert [d["verdict"] for d in docs] == ["agree", "agree", "diverged"]
    for d in docs:  # the dense shape: a map by name, lower-case statuses
        assert isinstance(d["backends"], dict) and list(d["backends"])[:2] == ["reference", "observed"]
        assert all(b["status"] in ("pass", "fail", "skipped", "error") for b in d["backends"].values())
    bad = docs[2]["backends"]["observed"]
    assert bad["explanation"]["hypothesis"] == "sink_omitted" and bad["localization"]["requests"]
    assert docs[2]["diagnosis"] == "observed_unconfirmed" and {"noise", "lonely_rows", "region"} <= set(docs[2])
    assert main(["replay", str(folder), "--jobs", jobs, *FAST]) == 1
    assert "3 captures: 2 agree, 1 diverged, 0 invalid" in capsys.readouterr().out


def _segfault(cap):
    ctypes.string_at(0)  # a read of address 0: SIGSEGV


def _production_copy(cap):
    """A correct kernel: production's own stored output (the capture is clean)."""
    return PathOutput(cap.out, cap.lse, "planted: production's output")


def test_a_segfaulting_sparse_kernel_is_its_error_every_other_result_kept(tmp_path, monkeypatch):
    path = tmp_path / "s.safetensors"
    synth_sparse(path, V4)
    monkeypatch.setenv("REFMLA_ISOLATE", "1")  # the suite runs kernels in-process (conftest); this test is about the child
    monkeypatch.setitem(sparse_backends.BACKENDS, "tilelang", _segfault)
    monkeypatch.setitem(sparse_backends.BACKENDS, "aiter_sparse", _production_copy)
    r = replay_file(str(path), ReplayOptions(backends=["tilelang", "aiter_sparse"]))
    st = {n: b.status for n, b in r.backends.items()}
    assert st == {"reference": "pass", "observed": "pass", "tilelang": "error", "aiter_sparse": "pass"}
    assert "SIGSEGV" in r.backends["tilelang"].reason
    assert r.verdict == "diverged" and r.diagnosis == "backend_error" and r.diagnosis_backends == ["tilelang"]


@pytest.mark.parametrize("only,plant", [("reference", "faults"), ("tilelang", "faults"), ("reference", "test"), ("tilelang", "test")])
def test_observed_is_judged_whatever_the_backend_filter(tmp_path, capsys, only, plant):
    path = tmp_path / "f.safetensors"
    if plant == "faults":  # refmla.sparse.faults' plain loop
        synth_sparse(path, V4, "extra_cache_ignored")
    else:  # this test's own code: a clean capture whose stored out is then made wrong (one head doubled)
        case = build_case(sparse_preset(V4))
        out, lse = planted_output(case)
        out = out.clone()
        out[1, 0, 3] = out[1, 0, 3] * 2 + 0.5
        write_sparse(path, {**case.tensors(), "out": out, "lse": lse}, case.meta())
    assert main(["replay", str(path), "--json", "--backend", only, "--no-explain"]) == 1
    d = json.loads(capsys.readouterr().out)
    assert d["verdict"] == "diverged" and d["backends"]["observed"]["status"] == "fail"


def _write(path, case, **override):
    out, lse = planted_output(case)
    write_sparse(path, {**case.tensors(), "out": out, "lse": lse, **override}, case.meta())


@pytest.mark.parametrize("where", ["attn_sink", "q", "cache_byte"])
def test_nonfinite_inputs_are_upstream_nonfinite_and_the_reference_never_fails(tmp_path, where):
    case = build_case(sparse_preset(V4))
    t = case.tensors()
    if where == "attn_sink":
        sink = t["attn_sink"].clone()
        sink[3] = float("nan")
        override = {"attn_sink": sink}
    elif where == "q":
        q = t["q"].clone()
        q[1, 0, 2, 7] = float("nan")
        override = {"q": q}
    else:  # an fp8 byte of a token request 0 attends set to NaN (0x7f in e4m3fn), by this test's own indexing
        kc = t["k_cache"].clone()
        live = t["indices"][0, 0, : int(t["topk_length"][0])]
        token = int(live[live >= 0][0])
        page, slot = divmod(token, case.meta()["page_size"])
        kc[page, slot * 576] = 0x7F  # V4 "MODEL1": each token's 448 fp8 + 64 bf16 rope bytes first, 576 each
        override = {"k_cache": kc}
    path = tmp_path / "n.safetensors"
    _write(path, case, **override)
    r = replay_file(str(path), ReplayOptions(backends=["reference", "observed"]))
    assert r.verdict == "diverged" and r.diagnosis == "upstream_nonfinite", (r.diagnosis, r.diagnosis_text)
    assert r.backends["reference"].status == "pass" and "backend_error" not in r.diagnosis_text
    assert r.exit_code == 1


@pytest.mark.parametrize("key,value", [("compress_ratio", "1e400"), ("compress_ratio", "3"), ("window", "-1"),
                                       ("softmax_scale", "NaN"), ("layer_id", "1" + "0" * 4400)])  # fmt: skip
def test_every_meta_number_is_bounded_exit_2_naming_the_key(tmp_path, capsys, key, value):
    case = build_case(sparse_preset(V4))
    good = tmp_path / "good.safetensors"
    _write(good, case)
    raw = good.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    meta = json.loads(header["__metadata__"]["meta"])
    meta.pop("compress_ratios", None)
    meta[key] = "@"
    header["__metadata__"]["meta"] = json.dumps(meta).replace('"@"', value)  # the number as written
    body = json.dumps(header).encode()
    body += b" " * (-len(body) % 8)
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(len(body).to_bytes(8, "little") + body + raw[8 + n :])
    assert main(["replay", str(bad), *FAST]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(bad) in err[0] and f"meta key '{key}'" in err[0], err


@pytest.mark.parametrize("empty", ["heads", "query_tokens"])
def test_zero_heads_or_zero_query_tokens_is_a_defined_empty_result(tmp_path, empty):
    case = build_case(sparse_preset(V4))
    out, lse = planted_output(case)
    t = {**case.tensors(), "out": out, "lse": lse}
    if empty == "heads":
        t = {k: v[:, :, :0] if k in ("q", "out", "lse") else v[:0] if k == "attn_sink" else v for k, v in t.items()}
    else:
        t = {k: v[:, :0] if k in ("q", "out", "lse", "indices", "extra_indices") else v for k, v in t.items()}
    path = tmp_path / "e.safetensors"
    write_sparse(path, t, case.meta())
    r = replay_file(str(path), ReplayOptions(backends=["reference", "observed"]))
    assert r.verdict == "agree" and r.backends["observed"].status == "pass"
    assert r.to_json()["shape"]["H" if empty == "heads" else "S"] == 0


def test_plot_on_a_sparse_capture_is_refused_in_one_line(folder, tmp_path, capsys):
    capsys.readouterr()
    main(["replay", str(folder / "b_sparse.safetensors"), "--plot", str(tmp_path / "p"), *FAST])
    err = [line for line in capsys.readouterr().err.splitlines() if "--plot" in line]
    assert len(err) == 1 and "sparse decode" in err[0]
    assert not list((tmp_path / "p").glob("b_sparse*"))


def test_the_sparse_reference_works_in_row_blocks_with_the_same_result(monkeypatch):
    from refmla.sparse import reference

    case = build_case(sparse_preset(V4))
    from refmla.sparse.format import SparseCapture, parse_sparse_meta

    cap = SparseCapture(path="mem", meta=parse_sparse_meta(case.meta()), **case.tensors())
    whole = reference.sparse_reference(cap)
    monkeypatch.setattr(reference, "TABLE_BYTES", 1)  # no table of the whole call: one query row per table
    assert len(reference.table_rows(reference.rows_of(cap), 512)) == cap.q.shape[0] * cap.q.shape[1]
    cap = SparseCapture(path="mem", meta=parse_sparse_meta(case.meta()), **case.tensors())  # no table kept
    blocked = reference.sparse_reference(cap)
    assert torch.equal(blocked.out, whole.out) and torch.equal(blocked.lse, whole.lse)  # a row's bits are its own


STANDINS = __import__("pathlib").Path(__file__).resolve().parent / "standins"


def test_flashmla_sparse_by_contract_against_a_standin_of_its_real_signature(tmp_path, monkeypatch):
    """The adapter passes FlashMLA's real keyword arguments (the stand-in asserts what the real one
    does and computes with its own byte decode and loop) and transposes its lse [B, H, S]."""
    import sys

    path = tmp_path / "s.safetensors"
    synth_sparse(path, V4)
    monkeypatch.delitem(sys.modules, "flash_mla", raising=False)
    monkeypatch.syspath_prepend(str(STANDINS / "flashmla_sparse"))
    import flash_mla

    monkeypatch.setitem(sys.modules, "flash_mla", flash_mla)  # undone after the test: the stand-in leaves
    flash_mla.CALLS.clear()
    r = replay_file(str(path), ReplayOptions(backends=["flashmla_sparse"]))
    e = r.backends["flashmla_sparse"]
    assert e.status == "pass" and e.lse is not None and e.lse.status == "pass", (e.status, e.reason)
    assert flash_mla.CALLS == [{"q": (4, 1, 8, 512), "indices": torch.int32, "extra": True}]
    assert "flash_mla.flash_mla_with_kvcache" in e.info["version"]


def test_flashmla_sparse_absent_is_skipped_with_the_reason(tmp_path, monkeypatch):
    monkeypatch.delitem(__import__("sys").modules, "flash_mla", raising=False)
    path = tmp_path / "s.safetensors"
    synth_sparse(path, V4)
    e = replay_file(str(path), ReplayOptions(backends=["flashmla_sparse"])).backends["flashmla_sparse"]
    assert e.status == "skipped" and "FlashMLA's sparse decode is not importable" in e.reason


@pytest.mark.parametrize("fault", ["window_off_by_one", "extra_cache_ignored", "other_rows_read"])
def test_the_localization_names_the_entries_whose_removal_brings_the_row_back(tmp_path, fault):
    """Per failing request, the top-k entry (cache, its position in that cache's list, the slot) or
    the cache whose removal brings its row back, else the entry carrying the error (issue 28); the
    faults planted by refmla.sparse.faults' plain loop, the entries read back from the file here."""
    from safetensors import safe_open

    path = tmp_path / "f.safetensors"
    synth_sparse(path, V4, fault)
    obs = replay_file(str(path), ReplayOptions(backends=["reference", "observed"])).backends["observed"]
    loc = obs.localization.to_json()
    assert loc["entries"] and [e["request"] for e in loc["entries"]] == loc["requests"][: len(loc["entries"])]
    with safe_open(str(path), "pt") as f:
        indices = f.get_tensor("indices")
    first = loc["entries"][0]
    if fault == "extra_cache_ignored":  # no one entry: the whole compressed cache
        assert all(e["cache"] == "extra" and "entry" not in e and e["how"] == "removal restores" for e in loc["entries"])
        assert "the compressed cache's entries: removal restores" in loc["text"]
    elif fault == "window_off_by_one":  # the oldest entry of the full window, each failing request
        for e in loc["entries"]:
            assert (e["cache"], e["entry"], e["how"]) == ("main", 0, "removal restores")
            assert e["slot"] == int(indices[e["request"], 0, 0])
    else:  # the entry read at its neighbour: its removal does not restore, it carries most of the error
        detail = obs.explanation.detail
        assert (first["cache"], first["entry"], first["how"]) == (detail["cache"], detail["entry"], "carries the error")
        assert first["slot"] == detail["slot_meant"] == int(indices[first["request"], 0, first["entry"]])
        assert first["share"] > 0.5

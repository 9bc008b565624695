"""The aiter path production ran (persistent, non-persistent, gluon): recorded, replayed, diagnosed.

Against the stand-in (tests/standins/aiter_standin): it checks the metadata calls, the buffers'
shapes and contents, and the persistent / Gluon keywords, and raises on the first wrong one.
"""

from __future__ import annotations

import sys

import pytest
import torch

from refmla.backends.aiter.paths import production_path, sglang_modes
from refmla.capture import read_capture, write_capture
from refmla.context import ReplayContext, ReplayOptions
from refmla.diagnosis import diagnose, unreplayed_path
from refmla.pipeline import replay_capture, run_backend
from refmla.synthetic import SynthSpec, make_inputs, make_meta
from refmla.synthetic.faults import faulty_output
from helpers import STANDINS, forget_aiter

FP8 = torch.float8_e4m3fn
SEQ_LENS = (37, 130, 5, 64, 1)


def path_meta(path: str, heads: int, page_size: int, **over) -> dict:
    """The meta the capture hook writes for a call that took ``path`` (SGLang 0.5.23's choices)."""
    kh = max(heads, 16)
    fast, intra, splits = sglang_modes(kh)
    meta = {"aiter_path": path, "aiter_kernel_heads": kh, "aiter_kv_granularity": max(page_size, 16),
            "aiter_head_pad_mode": "repeat" if heads in (4, 8) else ("zero" if heads == 12 else "none")}  # fmt: skip
    if path == "persistent":
        meta.update(aiter_fast_mode=fast, aiter_intra_batch_mode=intra, aiter_max_split_per_batch=splits,
                    aiter_num_kv_splits=splits)  # fmt: skip
    meta.update(over)
    return meta


def production_buffers(mla_module, t: dict, heads: int, kv_dtype, page_size: int) -> dict:
    """The persistent buffers SGLang's make_mla_meta_data would hand the kernel for this batch."""
    import aiter

    kh, B = max(heads, 16), t["kv_indptr"].shape[0] - 1
    fast, intra, splits = sglang_modes(kh)
    sizes = aiter.get_mla_metadata_info_v1(B, 1, kh, kv_dtype, kv_dtype, is_sparse=False, fast_mode=fast,
                                           num_kv_splits=splits, intra_batch_mode=intra)  # fmt: skip
    names = ("work_meta_data", "work_indptr", "work_info_set", "reduce_indptr", "reduce_final_map", "reduce_partial_map")
    bufs = {n: torch.full(s if isinstance(s, tuple) else (s,), -7, dtype=d) if d != torch.uint64 else torch.zeros(2, dtype=d)
            for n, (s, d) in zip(names, sizes)}  # fmt: skip
    i32 = dict(dtype=torch.int32)
    aiter.get_mla_metadata_v1(torch.arange(B + 1, **i32), t["kv_indptr"].to(torch.int32), torch.ones(B, **i32), kh, 1,
                              False, *[bufs[n] for n in ("work_meta_data", "work_info_set", "work_indptr",
                              "reduce_indptr", "reduce_final_map", "reduce_partial_map")],
                              kv_granularity=max(page_size, 16), max_seqlen_qo=1, uni_seqlen_qo=1, fast_mode=fast,
                              max_split_per_batch=splits, intra_batch_mode=intra)  # fmt: skip
    return {f"aiter_{n}": v for n, v in bufs.items() if n != "work_meta_data"}


def aiter_capture(tmp_path, *, heads=8, kv_dtype=torch.bfloat16, page_size=1, path="persistent", fault="none",
                  buffers=None, seq_lens=SEQ_LENS, **over):  # fmt: skip
    scale = 0.75 if kv_dtype == FP8 else 1.0
    spec = SynthSpec(name="aiter-path", num_heads=heads, seq_lens=seq_lens, page_size=page_size, kv_dtype=kv_dtype,
                     k_scale=scale, v_scale=scale, seed=5)  # fmt: skip
    t = make_inputs(spec)
    t["out"], _ = faulty_output(spec, t, fault)
    meta = make_meta(spec)
    meta["backend"] = "aiter"
    if path is not None:
        meta.update(path_meta(path, heads, page_size, **over))
    if buffers is not None:
        t.update(buffers(t))
    f = tmp_path / f"{path}-h{heads}-p{page_size}-{str(kv_dtype)[6:]}.safetensors"
    write_capture(f, t, meta, compact=False)
    return read_capture(f)


def replay_aiter(cap) -> dict:
    return run_backend("aiter", ReplayContext(cap, ReplayOptions(backends=["aiter"]))).to_json()


@pytest.mark.parametrize("page_size", [1, 64])
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, FP8], ids=["bf16", "fp8"])
@pytest.mark.parametrize("heads", [8, 16, 128])
def test_persistent_contract(standin, tmp_path, heads, kv_dtype, page_size):
    """Metadata through aiter's two functions by keyword, as SGLang calls them; the kernel keywords."""
    from aiter.ops import attention

    cap = aiter_capture(tmp_path, heads=heads, kv_dtype=kv_dtype, page_size=page_size,
                        buffers=lambda t: production_buffers(standin, t, heads, kv_dtype, page_size))  # fmt: skip
    attention.METADATA_CALLS.clear()
    entry = replay_aiter(cap)
    assert entry["status"] == "pass", entry.get("reason")
    kh, B = max(heads, 16), cap.batch_size
    fast, intra, splits = sglang_modes(kh)
    info_call, meta_call = attention.METADATA_CALLS
    assert info_call["fn"] == "get_mla_metadata_info_v1"
    assert (info_call["batch_size"], info_call["max_seqlen_qo"], info_call["num_head_qo"]) == (B, 1, kh)
    assert info_call["q_dtype"] == info_call["kv_dtype"] == kv_dtype  # SGLang passes the KV dtype for both
    assert (info_call["fast_mode"], info_call["intra_batch_mode"], info_call["num_kv_splits"]) == (fast, intra, splits)
    assert meta_call["kv_granularity"] == max(page_size, 16) and meta_call["is_causal"] is False
    assert (meta_call["max_seqlen_qo"], meta_call["uni_seqlen_qo"], meta_call["num_heads_k"]) == (1, 1, 1)
    assert meta_call["max_split_per_batch"] == splits and meta_call["dtype_kv"] == kv_dtype
    call = standin.CALLS[-1]
    assert call["mode"] == "persistent" and call["heads"] == kh
    assert call["kv_buffer_shape"] == [cap.kv_buffer.shape[0], 1, 1, 576]  # token-level, as SGLang
    assert call["intra_batch_mode"] is intra and call["num_kv_splits"] == splits
    assert call["buffer_shapes"]["work_info_set"][1] == 8 and call["buffer_shapes"]["reduce_indptr"] == [B + 1]
    if kv_dtype == FP8:
        assert float(call["kv_scale"]) == 0.75 and float(call["q_scale"]) == 0.75  # SGLang: q_scale = k_descale
    else:
        assert call["kv_scale"] is None and call["q_scale"] is None
    info = entry["info"]
    assert info["path"] == "persistent" and info["production_path"]["recorded"] == "persistent"
    assert info["metadata_compared"] == sorted(["work_indptr", "work_info_set", "reduce_indptr", "reduce_final_map",
                                                "reduce_partial_map"])  # fmt: skip
    assert [c["fn"].split(".")[-1] for c in info["metadata_calls"]] == ["get_mla_metadata_info_v1", "get_mla_metadata_v1"]


@pytest.mark.parametrize("buffer", ["work_info_set", "reduce_indptr", "work_indptr"])
def test_persistent_metadata_mismatch_is_a_finding(standin, tmp_path, buffer):
    """Production's buffers differ from the ones rebuilt for the captured indices: fail, typed, named."""

    def tampered(t):
        bufs = production_buffers(standin, t, 8, torch.bfloat16, 1)
        bufs[f"aiter_{buffer}"].view(-1)[1] += 1  # an off-by-one in production's plan
        return bufs

    cap = aiter_capture(tmp_path, buffers=tampered)
    entry = replay_aiter(cap)
    assert entry["status"] == "fail"  # the output agrees, but a finding is never a pass
    (finding,) = entry["info"]["findings"]
    assert finding["kind"] == "aiter_metadata_mismatch" and finding["detail"]["buffer"] == buffer
    assert buffer in entry["reason"]


def test_persistent_without_captured_buffers_still_runs(standin, tmp_path):
    entry = replay_aiter(aiter_capture(tmp_path, heads=16, kv_dtype=FP8))
    assert entry["status"] == "pass", entry.get("reason")
    assert entry["info"]["metadata_compared"] == [] and "findings" not in entry["info"]


def test_fp8_q_when_production_quantized_q(standin, tmp_path):
    cap = aiter_capture(tmp_path, heads=16, kv_dtype=FP8, aiter_q_dtype="float8_e4m3fn", aiter_q_scale=0.5)
    entry = replay_aiter(cap)
    assert entry["status"] in ("pass", "fail"), entry.get("reason")
    call = standin.CALLS[-1]
    assert call["q"].dtype == FP8 and float(call["q_scale"]) == 0.5
    assert torch.equal(call["q"], (cap.q.float() / 0.5).to(FP8))
    assert "quantized to float8_e4m3fn" in entry["info"]["q"]


@pytest.mark.parametrize("page_size", [1, 64])
def test_recorded_non_persistent_is_token_level(standin, tmp_path, page_size):
    from aiter.ops import attention

    entry = replay_aiter(aiter_capture(tmp_path, heads=16, page_size=page_size, path="non_persistent"))
    assert entry["status"] == "pass", entry.get("reason")
    assert standin.CALLS[-1]["mode"] == "non_persistent" and standin.CALLS[-1]["kv_buffer_shape"][1] == 1
    assert attention.METADATA_CALLS == [] and entry["info"]["path"] == "non_persistent"


@pytest.mark.parametrize("page_size", [1, 64])
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, FP8], ids=["bf16", "fp8"])
def test_gluon_contract(standin, tmp_path, kv_dtype, page_size):
    from aiter.ops.triton.gluon import mla_gluon

    mla_gluon.GLUON_CALLS.clear()
    cap = aiter_capture(tmp_path, heads=12, kv_dtype=kv_dtype, page_size=page_size, path="gluon")
    entry = replay_aiter(cap)
    assert entry["status"] == "pass", entry.get("reason")
    (call,) = mla_gluon.GLUON_CALLS
    assert call["heads"] == 12  # no head padding on this path
    assert call["kv_scale"] == cap.meta.k_scale and call["min_kv_seq_len"] == max(SEQ_LENS)
    assert entry["info"]["path"] == "gluon" and entry["info"]["kernel"].endswith("mla_gluon")
    assert not [c for c in standin.CALLS if c["fn"] == "mla_decode_fwd"]


def test_gluon_missing_from_the_release_is_skipped_naming_it(standin, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "aiter.ops.triton.gluon.mla_gluon", None)  # import fails
    entry = replay_aiter(aiter_capture(tmp_path, heads=12, path="gluon"))
    assert entry["status"] == "skipped" and "gluon" in entry["reason"] and "not replayed" in entry["reason"]


def test_persistent_without_metadata_functions_is_skipped(standin, tmp_path, monkeypatch):
    import aiter
    from aiter.ops import attention

    monkeypatch.delattr(aiter, "get_mla_metadata_v1")
    monkeypatch.delattr(attention, "get_mla_metadata_v1")
    entry = replay_aiter(aiter_capture(tmp_path))
    assert entry["status"] == "skipped"
    assert entry["reason"].startswith("production ran aiter's persistent kernel, not replayed here")


@pytest.mark.parametrize("name", ["dcp_asm", "flash_v9"])
def test_unknown_or_dcp_path_is_skipped_with_its_name(standin, tmp_path, name):
    entry = replay_aiter(aiter_capture(tmp_path, path=name))
    assert entry["status"] == "skipped" and f"aiter's {name} kernel, not replayed here" in entry["reason"]
    assert standin.CALLS == []


def test_env_forces_a_path_on_a_capture_without_one(standin, tmp_path, monkeypatch):
    monkeypatch.setenv("REFMLA_AITER_PATH", "persistent")
    cap = aiter_capture(tmp_path, heads=128, kv_dtype=FP8, path=None)
    p = production_path(cap.meta)
    assert (p.name, p.recorded, p.source) == ("persistent", None, "REFMLA_AITER_PATH=persistent")
    entry = replay_aiter(cap)
    assert entry["status"] == "pass", entry.get("reason")
    assert standin.CALLS[-1]["mode"] == "persistent" and standin.CALLS[-1]["intra_batch_mode"] is False  # 128: fast


def test_no_recorded_path_keeps_the_old_default(standin, tmp_path):
    cap = aiter_capture(tmp_path, heads=8, page_size=16, path=None)
    entry = replay_aiter(cap)
    assert entry["info"]["path"] == "non_persistent" and entry["info"]["index_convention"] == "page"
    assert entry["info"]["production_path"]["source"].startswith("default")


# -- diagnosis ---------------------------------------------------------------------------------


def test_observed_only_divergence_names_the_unreplayed_kernel(tmp_path, monkeypatch):
    """No aiter here: production's persistent kernel is not replayed, so state is not blamed."""
    forget_aiter()
    monkeypatch.setenv("REFMLA_EXTEND_IMPL", "torch")
    cap = aiter_capture(tmp_path, heads=16, fault="kv_range_zero", seq_lens=(37, 130, 300, 64, 1))
    report = replay_capture(cap, ReplayOptions(backends=["aiter", "extend"])).to_json()
    assert report["backends"]["aiter"]["status"] == "skipped"
    assert report["diagnosis"] == "observed"
    text = report["diagnosis_text"]
    assert "production ran aiter's persistent kernel, not replayed here: " in text
    assert report["backends"]["aiter"]["reason"].split(" (")[0] in text
    assert "KV not yet transferred" not in text


def test_observed_divergence_after_replaying_the_path_suspects_state(standin, tmp_path, monkeypatch):
    monkeypatch.setenv("REFMLA_EXTEND_IMPL", "torch")
    cap = aiter_capture(tmp_path, heads=16, fault="kv_range_zero", seq_lens=(37, 130, 300, 64, 1))
    report = replay_capture(cap, ReplayOptions(backends=["aiter", "extend"])).to_json()
    assert report["backends"]["aiter"]["status"] == "pass"
    assert report["diagnosis"] == "observed" and "not replayed here" not in report["diagnosis_text"]
    assert "KV not yet transferred" in report["diagnosis_text"]


def test_unreplayed_path_reasons():
    assert unreplayed_path(None, "skipped", None, "no aiter") is None
    assert unreplayed_path("persistent", None, None, None).startswith("the aiter backend was not run")
    assert unreplayed_path("persistent", "skipped", None, "no ROCm GPU") == "no ROCm GPU"
    assert "non_persistent path instead" in unreplayed_path("persistent", "pass", {"path": "non_persistent"}, None)
    assert unreplayed_path("gluon", "pass", {"path": "gluon"}, None) is None
    d = diagnose({"observed": "fail"}, unreplayed=("gluon", "no ROCm GPU"))
    name, text, about = d.name, d.text, d.backends
    assert name == "observed_unconfirmed" and "aiter's gluon kernel, not replayed here: no ROCm GPU" in text


# SGLang 0.5.23's choice (AiterAttnBackend.__init__ + _forward_mla_decode), the table in docs/aiter.md:
# heads, fp8 KV, SGLANG_AITER_MLA_PERSIST -> path
SGLANG_TABLE = [
    (8, False, "1", "non_persistent"), (8, True, "1", "persistent"), (8, True, "0", "non_persistent"),
    (12, False, "1", "persistent"), (12, True, "1", "persistent"), (12, True, "0", "gluon"),
    (12, False, "0", "non_persistent"),
    (16, False, "1", "non_persistent"), (16, True, "1", "persistent"), (16, True, "0", "non_persistent"),
    (32, False, "1", "persistent"), (64, True, "1", "persistent"), (64, False, "0", "non_persistent"),
    (128, False, "1", "non_persistent"), (128, True, "1", "persistent"), (128, True, "0", "non_persistent"),
]  # fmt: skip


@pytest.mark.parametrize("heads,fp8,persist,want", SGLANG_TABLE)
def test_sglang_path_table(heads, fp8, persist, want):
    from refmla.backends.aiter.paths import sglang_path

    name, knobs = sglang_path(heads, fp8, {"SGLANG_AITER_MLA_PERSIST": persist})
    assert name == want
    if name == "persistent":
        fast = max(heads, 16) in (32, 64, 128)
        assert (knobs["fast_mode"], knobs["intra_batch_mode"], knobs["max_split_per_batch"]) == (fast, not fast, 64)


def test_gluon_decode_backend_and_auto_splits_knobs():
    from refmla.backends.aiter.paths import sglang_path

    assert sglang_path(12, True, {"SGLANG_AITER_MLA_DECODE_BACKEND": "gluon"})[0] == "gluon"
    assert sglang_path(12, True, {"SGLANG_AITER_MLA_PERSIST": "0", "SGLANG_AITER_MLA_GLUON": "0"})[0] == "non_persistent"
    name, knobs = sglang_path(16, True, {"SGLANG_AITER_MLA_AUTO_KV_SPLITS": "1"})
    assert name == "persistent" and knobs["max_split_per_batch"] == -1 and knobs["auto_kv_splits"] is True


@pytest.mark.parametrize("persist,want", [("1", "persistent"), ("0", "non_persistent")])
def test_persist_env_picks_the_path_of_an_unrecorded_capture(standin, tmp_path, monkeypatch, persist, want):
    """What the kernel-regression suite does on MI355X with SGLANG_AITER_MLA_PERSIST=0/1."""
    monkeypatch.setenv("SGLANG_AITER_MLA_PERSIST", persist)
    entry = replay_aiter(aiter_capture(tmp_path, heads=16, kv_dtype=FP8, path=None))
    assert entry["status"] == "pass", entry.get("reason")
    assert entry["info"]["path"] == want and standin.CALLS[-1]["mode"] == want
    assert entry["info"]["production_path"]["source"].startswith(f"SGLANG_AITER_MLA_PERSIST={persist}")
    if want == "persistent":
        assert entry["info"]["num_kv_splits"] == 64


def test_status_lists_the_paths_this_aiter_can_replay(standin, monkeypatch):
    import aiter

    from refmla.backends.aiter import aiter_status

    assert aiter_status()[1].endswith("paths: persistent, non_persistent, gluon")
    monkeypatch.delattr(aiter, "get_mla_metadata_v1")
    assert aiter_status()[1].endswith("paths: non_persistent, gluon")


def test_metadata_compare_reads_only_the_used_part():
    """Tails of torch.empty buffers differ run to run: never a finding; the used part is, in any index dtype."""
    from refmla.backends.aiter.metadata import compare_buffers

    i32 = dict(dtype=torch.int32)
    rebuilt = {"work_indptr": torch.tensor([0, 2, 3], **i32), "work_info_set": torch.arange(40, **i32).reshape(5, 8),
               "reduce_indptr": torch.tensor([0, 2], **i32), "reduce_final_map": torch.tensor([[0, 0]], **i32),
               "reduce_partial_map": torch.tensor([0, 1, 99, 98], **i32)}  # fmt: skip
    prod = {k: v.clone().long() for k, v in rebuilt.items()}
    prod["work_info_set"][3:] = -1  # beyond work_indptr[-1] = 3
    prod["reduce_partial_map"][2:] = 12345  # beyond reduce_indptr[-1] = 2
    assert compare_buffers(prod, rebuilt) == []
    prod["work_info_set"][2, 5] += 1
    (f,) = compare_buffers(prod, rebuilt)
    assert (f.detail["buffer"], f.detail["first_row"], f.detail["rows_differing"]) == ("work_info_set", 2, 1)


def test_gluon_forced_on_too_many_heads_is_skipped(standin, tmp_path, monkeypatch):
    monkeypatch.setenv("REFMLA_AITER_PATH", "gluon")
    entry = replay_aiter(aiter_capture(tmp_path, heads=32, path=None))
    assert entry["status"] == "skipped" and "(gluon path)" in entry["reason"] and "32 heads" in entry["reason"]


def test_fp8_kv_observed_divergence_is_explained_not_invalid(tmp_path):
    """An fp8-KV deployment (the persistent kernel's case): the hypothesis search zeroes fp8 rows too."""
    forget_aiter()
    cap = aiter_capture(tmp_path, heads=16, kv_dtype=FP8, fault="kv_range_zero", seq_lens=(37, 130, 300, 64, 1))
    report = replay_capture(cap, ReplayOptions(backends=["aiter"])).to_json()
    assert report["verdict"] == "diverged" and report["diagnosis"] == "observed_unconfirmed"
    assert report["backends"]["observed"]["explanation"]["hypothesis"] == "kv_range_missing"
    assert "production ran aiter's persistent kernel, not replayed here" in report["diagnosis_text"]

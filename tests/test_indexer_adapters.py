"""The DeepGEMM / tilelang / aiter indexer adapters (refmla.indexer.adapters) against stand-ins of
their real signatures, built from the installed SGLang's own code: ``deep_gemm.fp8_paged_mqa_logits``
and ``deep_gemm.fp8_mqa_logits`` are SGLang's torch fallbacks with DeepGEMM's signatures
(``sglang.srt.layers.attention.dsa.utils._fp8_paged_mqa_logits_torch`` / ``_fp8_mqa_logits_torch``,
what SGLANG_FP8_PAGED_MQA_LOGITS_TORCH puts in DeepGEMM's place); the tilelang and aiter stand-ins
check the argument layout SGLang's callers hand over, then compute with SGLang's torch indexer.
The captures are SGLang's own indexer calls (tests/indexer_kit.py). Without the packages each
adapter is unavailable with the reason (replay: skipped; doctor: unavailable)."""

from __future__ import annotations

import importlib.machinery
import sys
import types

import pytest
import torch

import indexer_kit as kit
from refmla.compare import Tolerance
from refmla.context import ReplayOptions
from refmla.indexer import adapters
from refmla.indexer.io import read_indexer
from refmla.indexer.judge import judge_indexer

NAMES = ("deepgemm_paged", "deepgemm_ragged", "tilelang_indexer", "aiter_indexer")
CALLS: list = []  # (stand-in, argument layout) of each call made


def _mod(name, **attrs):
    m = types.ModuleType(name)
    m.__spec__ = importlib.machinery.ModuleSpec(name, None)
    m.__dict__.update(attrs)
    return m


def _paged_args(q, kv, w, lens, table):
    """What SGLang hands a paged logits kernel in decode (next_n 1), checked as the kernels check it."""
    B, one, H, D = q.shape
    assert one == 1 and q.dtype == torch.float8_e4m3fn and D == 128
    assert kv.dtype == torch.uint8 and kv.shape[1:] == (64, 1, D + 4)
    assert w.shape == (B, H) and w.dtype == torch.float32
    assert lens.dtype == torch.int32 and lens.shape[0] == B and table.dtype == torch.int32 and table.shape[0] == B


@pytest.fixture
def standins(monkeypatch):
    kit.sglang()
    from sglang.srt.layers.attention.dsa import utils
    from sglang.srt.layers.attention.dsv4.indexer import fp8_paged_mqa_logits_torch

    def paged(q, kv, w, lens, table, meta, max_len, clean_logits=False):  # DeepGEMM's signature
        _paged_args(q, kv, w, lens, table)
        assert lens.shape == (q.shape[0], 1) and meta is not None and clean_logits is False
        CALLS.append(("deep_gemm.fp8_paged_mqa_logits", tuple(q.shape)))
        return utils._fp8_paged_mqa_logits_torch(q, kv, w, lens, table, meta, max_len, clean_logits=clean_logits)

    def ragged(q, kv, w, ks, ke, clean_logits=False):  # DeepGEMM's signature
        k8, scales = kv
        assert q.dim() == 3 and k8.dim() == 2 and scales.shape == (k8.shape[0],) and ks.shape == ke.shape == (q.shape[0],)
        CALLS.append(("deep_gemm.fp8_mqa_logits", tuple(q.shape)))
        return utils._fp8_mqa_logits_torch(q, kv, w, ks, ke, clean_logits=clean_logits)

    def metadata(lens, page, sms):
        assert lens.dim() == 2 and page == 64 and sms > 0
        return torch.zeros(sms + 1, 2, dtype=torch.int32)  # the schedule: the torch path reads none

    def tilelang(q, kv, w, seq_lens, table, deep_gemm_metadata, max_seq_len, clean_logits=True):
        _paged_args(q, kv, w, seq_lens, table)
        assert seq_lens.dim() == 1 and clean_logits is False
        CALLS.append(("tilelang_fp8_paged_mqa_logits", tuple(q.shape)))
        return fp8_paged_mqa_logits_torch(q, kv, w, seq_lens, table, None, max_seq_len, clean_logits=False)

    def aiter(q, kv, w, out_logits, lens, table, max_model_len, Preshuffle=False, KVBlockSize=1):
        _paged_args(q, kv, w, lens, table)
        assert out_logits.shape == (q.shape[0], max_model_len) and KVBlockSize == kv.shape[1] and not Preshuffle
        CALLS.append(("aiter deepgemm_fp8_paged_mqa_logits", tuple(q.shape)))
        out_logits.copy_(fp8_paged_mqa_logits_torch(q, kv, w, lens, table, None, max_model_len, clean_logits=False))

    mods = {"deep_gemm": _mod("deep_gemm", fp8_paged_mqa_logits=paged, fp8_mqa_logits=ragged,
                              get_paged_mqa_logits_metadata=metadata, get_num_sms=lambda: 132),
            "tilelang": _mod("tilelang"),
            "sglang.kernels.ops.attention.dsa.tilelang_kernel": _mod("tilelang_kernel", tilelang_fp8_paged_mqa_logits=tilelang),
            "aiter": _mod("aiter"), "aiter.ops": _mod("aiter.ops"), "aiter.ops.triton": _mod("aiter.ops.triton"),
            "aiter.ops.triton.pa_mqa_logits": _mod("pa_mqa_logits", deepgemm_fp8_paged_mqa_logits=aiter)}  # fmt: skip
    for name, m in mods.items():
        monkeypatch.setitem(sys.modules, name, m)
    monkeypatch.setattr(adapters, "DEVICE", "cpu")
    CALLS.clear()
    return mods


def judged(tmp_path, backends, seed=0, ratio=1, kind="slots", seq=(150, 700, 1333, 2050)):
    kit.write(tmp_path / "c.safetensors", list(seq), ratio=ratio, seed=seed, kind=kind)
    return judge_indexer(read_indexer(tmp_path / "c.safetensors"), ReplayOptions(backends=list(backends), tol=Tolerance()))


@pytest.mark.parametrize("ratio,kind", [(1, "slots"), (4, "positions")])
def test_each_adapter_on_sglangs_own_calls_agrees_through_its_real_signature(tmp_path, standins, ratio, kind):
    r = judged(tmp_path, NAMES, seed=ratio, ratio=ratio, kind=kind, seq=(150, 700, 1333, 2050) if ratio == 1 else (500, 2051, 4099))
    for name in NAMES:
        assert r.backends[name].status == "pass", (name, r.backends[name].reason)
    assert r.verdict == "agree"
    called = {c for c, _ in CALLS}
    assert called == {"deep_gemm.fp8_paged_mqa_logits", "deep_gemm.fp8_mqa_logits", "tilelang_fp8_paged_mqa_logits",
                      "aiter deepgemm_fp8_paged_mqa_logits"}  # fmt: skip


def test_a_kernel_whose_logits_drop_the_key_scales_is_an_indexer_kernel_finding(tmp_path, standins, monkeypatch):
    dg = standins["deep_gemm"]
    real = dg.fp8_paged_mqa_logits

    def no_scales(q, kv, w, lens, table, meta, max_len, clean_logits=False):
        kv = kv.clone()
        kv[..., 128:] = torch.ones(1, dtype=torch.float32).view(torch.uint8)  # every key's scale read as 1.0
        return real(q, kv, w, lens, table, meta, max_len, clean_logits=clean_logits)

    monkeypatch.setattr(dg, "fp8_paged_mqa_logits", no_scales)
    r = judged(tmp_path, ["deepgemm_paged", "deepgemm_ragged"], seed=4)
    assert r.backends["deepgemm_paged"].status == "fail" and r.backends["deepgemm_ragged"].status == "pass"
    assert r.diagnosis == "indexer_kernel" and r.exit_code == 1


def test_without_their_packages_the_adapters_are_skipped_with_the_reason(tmp_path, monkeypatch):
    for name in ("deep_gemm", "tilelang", "aiter"):
        monkeypatch.setitem(sys.modules, name, None)  # import fails, find_spec says absent
    monkeypatch.setattr(adapters.importlib.util, "find_spec", lambda n: None if n in ("deep_gemm", "tilelang", "aiter") else object())
    for name in NAMES:
        ok, why = adapters.availability(name)
        assert not ok and "not installed" in why, (name, why)
    monkeypatch.setattr(adapters, "DEVICE", "cpu")
    r = judged(tmp_path, NAMES, seed=5)
    for name in NAMES:
        assert r.backends[name].status == "skipped" and "not importable" in r.backends[name].reason, name
    assert r.verdict == "agree"


def test_a_bf16_capture_is_skipped_by_each_adapter(tmp_path, standins):
    kit.write(tmp_path / "b.safetensors", [300, 900], bf16=True, kind="positions")
    r = judge_indexer(read_indexer(tmp_path / "b.safetensors"), ReplayOptions(backends=list(NAMES), tol=Tolerance()))
    assert all(r.backends[n].status == "skipped" and "fp8" in r.backends[n].reason for n in NAMES)

"""The NVIDIA block-table adapters against stand-ins written from the kernels' real signatures.

A stand-in (tests/standins/paged_standins) checks every argument the adapter passes and answers
with refmla's fp64 reference; a wrong convention raises ContractViolation (the backend errors),
and a wrong result fails the comparison. Without the real packages and a CUDA GPU, each backend
is skipped with its reason (the last test).
"""

from __future__ import annotations

import sys

import pytest
import torch

from helpers import STANDINS, load_tool
from refmla.backends import PAGED, get_backend
from refmla.backends import _CACHE as BACKEND_CACHE
from refmla.capture import read_capture, write_capture
from refmla.context import ReplayOptions
from refmla.hook.vllm_paths import VLLM_IMPLS
from refmla.pipeline import replay_capture

PAGED_STANDINS = STANDINS / "paged_standins"
pv = load_tool("planting_vllm")
FAKES = ("flash_mla", "flashinfer", "sgl_kernel", "paged_standin_ref", "vllm.vllm_flash_attn", "vllm_flash_attn_standin")


@pytest.fixture
def standins(monkeypatch):
    """The stand-ins first on sys.path (and as vllm.vllm_flash_attn) for one test."""
    def forget():
        for name in [k for k in sys.modules if k.split(".")[0] in FAKES or k in FAKES]:
            sys.modules.pop(name)
        for name in PAGED:
            BACKEND_CACHE.pop(name, None)

    forget()
    monkeypatch.syspath_prepend(str(PAGED_STANDINS))
    import paged_standin_ref
    import vllm_flash_attn_standin

    monkeypatch.setitem(sys.modules, "vllm.vllm_flash_attn", vllm_flash_attn_standin)
    paged_standin_ref.CALLS.clear()
    yield paged_standin_ref
    forget()


def _capture(tmp_path, page_size: int, heads: int = 16):
    """A decode capture: shuffled pages, NaN rows outside the sequences, a one-token request."""
    from helpers import paged_case

    q, pool, indptr, idx = paged_case([130, 1, 64], heads, page_size=page_size, dtype=torch.bfloat16, seed=3)
    meta = dict(mode="decode", backend="unknown", kv_lora_rank=512, qk_rope_head_dim=64, sm_scale=0.1352,
                logit_cap=0.0, page_size=page_size)  # fmt: skip
    tensors = dict(q=q, kv_buffer=pool, kv_indptr=indptr, kv_indices=idx, seq_lens=(indptr[1:] - indptr[:-1]).int())
    return read_capture(write_capture(tmp_path / "c.safetensors", tensors, meta))


@pytest.mark.parametrize("name", PAGED)
@pytest.mark.parametrize("page_size", [1, 64])
def test_adapter_meets_the_contract(standins, tmp_path, name, page_size):
    cap = _capture(tmp_path, page_size)
    report = replay_capture(cap, ReplayOptions(backends=[name]))
    entry = report.backends[name]
    assert entry.status == "pass", entry.reason
    assert entry.info["standin"] is True and "stand-in" in entry.info["version"]
    assert len(standins.CALLS) == 1
    kernel_page = standins.CALLS[0].get("page")
    if name == "cutlass_mla":
        assert kernel_page == 128 and entry.info["layout"].startswith("re-paged")
    if name == "flashinfer_mla" and page_size == 64:
        assert kernel_page == 64  # the capture's page size fits: no re-paging


def test_a_broken_convention_is_an_error_not_a_pass(standins, tmp_path, monkeypatch):
    """The stand-in refuses an int64 table: the adapter's own conventions are what is tested."""
    from refmla.backends.paged import inputs

    real = inputs.paged_inputs

    def int64_table(*a, **k):
        x = real(*a, **k)
        return inputs.PagedInputs(x.q, x.pool, x.block_table.long(), x.seq_lens, x.page_size, x.layout)

    monkeypatch.setattr(inputs, "paged_inputs", int64_table)
    entry = replay_capture(_capture(tmp_path, 64), ReplayOptions(backends=["flashmla"])).backends["flashmla"]
    assert entry.status == "error" and "block_table must be an int32 tensor" in entry.reason


def test_cutlass_refuses_more_than_128_heads(standins, tmp_path):
    entry = replay_capture(_capture(tmp_path, 1, heads=144), ReplayOptions(backends=["cutlass_mla"])).backends["cutlass_mla"]
    assert entry.status == "error" and "at most 128 heads" in entry.reason


@pytest.mark.parametrize("name", PAGED)
def test_without_the_kernel_each_is_skipped_with_its_reason(name):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the real kernels may be usable")
    BACKEND_CACHE.pop(name, None)
    ok, why = get_backend(name).availability()
    assert not ok and why
    assert any(w in why for w in ("not found", "CUDA", "not built", "not available", "extension"))


def test_doctor_lists_engines_and_kernels(capsys):
    from refmla.cli import main

    assert main(["doctor"]) == 0
    text = capsys.readouterr().out
    assert "engines and kernel packages: sglang" in text and "vllm " in text
    for name in ("vllm_triton", *PAGED):
        line = next(l for l in text.splitlines() if l.strip().startswith(name + " "))
        assert "[" in line and "]" in line  # engine and kernel
    assert "trtllm_batch_decode_with_kv_cache_mla" in text and "flash_mla_with_kvcache" in text


# -- fp8 (e4m3) caches: FlashMLA's and TRT-LLM's fp8 paths, the others skipped with the reason ------

FP8_KERNELS = {"flashmla": "flash_mla_with_kvcache_fp8", "flashinfer_mla": "trtllm_batch_decode_with_kv_cache_mla"}


@pytest.fixture
def fp8_standins(standins, monkeypatch):
    """The stand-ins, plus vLLM's dense fp8 FlashMLA module (vllm.v1.attention.ops.flashmla)."""
    import types

    sys.modules.pop("vllm_flashmla_standin", None)  # bound to this test's paged_standin_ref.CALLS
    import vllm_flashmla_standin

    monkeypatch.setitem(sys.modules, "vllm", sys.modules.get("vllm") or types.ModuleType("vllm"))
    monkeypatch.setitem(sys.modules, "vllm.v1.attention.ops.flashmla", vllm_flashmla_standin)
    yield standins


def _fp8_capture(tmp_path, page_size=64, k_scale=0.5, v_scale=0.5, dtype=torch.float8_e4m3fn, exact_q=True):
    """The hostile decode capture with its pool stored in fp8 at scale k_scale (kv = stored * k_scale).

    exact_q: q's values are e4m3 values (stored bf16), so the adapter's quantization is exact and
    what is tested is its conventions (dtypes, descales, bmm scales); else a general bf16 q, which
    these kernels quantize whole (rope part included): judged by that path's own control."""
    from helpers import paged_case

    q, pool, indptr, idx = paged_case([130, 1, 64], 16, page_size=page_size, dtype=torch.float32, seed=4)
    meta = dict(mode="decode", backend="unknown", kv_lora_rank=512, qk_rope_head_dim=64, sm_scale=0.1352,
                logit_cap=0.0, page_size=page_size, k_scale=k_scale, v_scale=v_scale)  # fmt: skip
    q = q.to(torch.float8_e4m3fn).to(torch.bfloat16) if exact_q else q.to(torch.bfloat16)
    tensors = dict(q=q, kv_buffer=(pool / k_scale).to(dtype), kv_indptr=indptr, kv_indices=idx,
                   seq_lens=(indptr[1:] - indptr[:-1]).int())  # fmt: skip
    return read_capture(write_capture(tmp_path / "c8.safetensors", tensors, meta))


@pytest.mark.parametrize("name", sorted(FP8_KERNELS))
@pytest.mark.parametrize("page_size", [1, 64])
def test_fp8_adapter_meets_the_contract(fp8_standins, tmp_path, name, page_size):
    report = replay_capture(_fp8_capture(tmp_path, page_size), ReplayOptions(backends=[name], explain=False))
    entry = report.backends[name]
    assert entry.status == "pass", entry.reason
    assert entry.info["kernel"].endswith(FP8_KERNELS[name]) and entry.info["standin"] is True
    assert fp8_standins.CALLS[-1]["kernel"] == FP8_KERNELS[name]


@pytest.mark.parametrize("name", sorted(FP8_KERNELS))
def test_fp8_a_general_q_is_judged_at_the_kernels_own_rounding_of_it(fp8_standins, tmp_path, name):
    """A bf16 q that is not e4m3-exact: the kernel rounds all of it to e4m3 (rope part too), far past
    the replay's control (which rounds only the latent part), so the backend's own control models
    that rounding; its out and lse pass, where judged by the replay's control they failed (cosine
    difference 0.000514 > 0.000334, the one-token request's lse -0.877 vs -0.945)."""
    cap = _fp8_capture(tmp_path, exact_q=False)
    assert not torch.equal(cap.q, cap.q.to(torch.float8_e4m3fn).to(cap.q.dtype)), "q must not be e4m3-exact"
    entry = replay_capture(cap, ReplayOptions(backends=[name], explain=False)).backends[name]
    assert entry.status == "pass", entry.reason
    assert "e4m3 whole" in entry.info["control"]
    if name == "flashmla":
        assert entry.lse is not None and entry.lse.status == "pass", entry.lse


def test_fp8_scale_dropped_is_a_failure_not_a_pass(fp8_standins, tmp_path, monkeypatch):
    """The contract test can fail: an adapter that forgot the k_scale (descale_k 1) fails the comparison."""
    import vllm_flashmla_standin

    import functools

    real = vllm_flashmla_standin.flash_mla_with_kvcache_fp8

    @functools.wraps(real)
    def no_descale_k(**kw):
        return real(**{**kw, "descale_k": torch.ones(1)})

    monkeypatch.setattr(vllm_flashmla_standin, "flash_mla_with_kvcache_fp8", no_descale_k)
    entry = replay_capture(_fp8_capture(tmp_path), ReplayOptions(backends=["flashmla"], explain=False)).backends["flashmla"]
    assert entry.status == "fail"


@pytest.mark.parametrize(("name", "case", "why"), [
    ("cutlass_mla", {}, "no fp8 KV cache path"),
    ("fa3_mla", {}, "no fp8 KV cache path"),
    ("flashmla", {"dtype": torch.float8_e5m2}, "reads fp8 e4m3"),
    ("flashinfer_mla", {"dtype": torch.float8_e5m2}, "reads fp8 e4m3"),
    ("flashmla", {"v_scale": 0.25}, "one KV scale to the latent K and V"),
    ("flashinfer_mla", {"v_scale": 0.25}, "one KV scale to the latent K and V"),
])  # fmt: skip
def test_fp8_a_cache_the_kernel_cannot_take_is_skipped_with_the_reason(fp8_standins, tmp_path, name, case, why):
    entry = replay_capture(_fp8_capture(tmp_path, **case), ReplayOptions(backends=[name], explain=False)).backends[name]
    assert entry.status == "skipped" and why in entry.reason, (entry.status, entry.reason)
    assert not fp8_standins.CALLS


def test_fp8_flashmla_without_its_fp8_entry_point_is_skipped(standins, tmp_path, monkeypatch):
    """DeepSeek's flash_mla alone (no dense fp8 decode) and no vLLM fp8 module: skipped, never an error."""
    import types

    monkeypatch.setitem(sys.modules, "vllm", sys.modules.get("vllm") or types.ModuleType("vllm"))
    monkeypatch.setitem(sys.modules, "vllm.v1.attention.ops.flashmla", types.ModuleType("vllm.v1.attention.ops.flashmla"))
    entry = replay_capture(_fp8_capture(tmp_path), ReplayOptions(backends=["flashmla"], explain=False)).backends["flashmla"]
    assert entry.status == "skipped" and "flash_mla_with_kvcache_fp8" in entry.reason, entry.reason



@pytest.mark.parametrize("kernel_q", ["float8_e4m3fn", None])
def test_fp8_observed_output_of_a_kernel_that_took_q_in_e4m3(tmp_path, kernel_q):
    """A hook capture of an fp8-query kernel (meta kernel_q_dtype, as refmla.hook.nvidia records it):
    the production output is this test's own dense formulation over q rounded to e4m3 whole. With
    the key, observed is judged at that rounding and passes; without it, the replay's control
    (the latent part rounded only) is too tight for it and it fails: what the key changes."""
    from helpers import dense_reference

    cap = _fp8_capture(tmp_path, exact_q=False)
    q8 = cap.q.to(torch.float8_e4m3fn)  # |q| < 448: scale 1, as the engines cast it
    m = cap.meta
    pool = cap.kv_buffer.float()
    out, lse = dense_reference(q8, pool, cap.kv_indptr, cap.kv_indices, 512, m.sm_scale, k_scale=m.k_scale, v_scale=m.v_scale)
    tensors = {k: getattr(cap, k) for k in ("q", "kv_buffer", "kv_indptr", "kv_indices", "seq_lens")}
    meta = {**m.to_json(), **({"kernel_q_dtype": kernel_q} if kernel_q else {})}
    tensors.update(out=out.to(torch.bfloat16), lse=lse.float())
    path = write_capture(tmp_path / "observed8.safetensors", tensors, meta)
    entry = replay_capture(read_capture(path), ReplayOptions(backends=["observed"], explain=False)).backends["observed"]
    if kernel_q:
        assert entry.status == "pass" and entry.lse.status == "pass", (entry.reason, entry.lse)
        assert "e4m3 whole" in entry.info["control"]
    else:
        assert entry.status == "fail", "the replay's control judged the e4m3-rounded q as within its noise"


# vLLM's backend name -> the capture's meta backend, as the vLLM hook writes it, for its block-table kernels
ENGINE_KERNELS = [(engine, name) for _, engine, name in VLLM_IMPLS.values() if name in PAGED]


def _vllm_capture(tmp_path, engine_backend: str, name: str):
    """A decode capture shaped as vLLM writes it (tools/planting_vllm.py: its block table, split
    schedule and metadata; out from its fp64 loop), naming the kernel that wrote it."""
    t, meta, _ = pv.capture(pv.VllmSpec(block=64, seq_lens=(1030, 77, 283), heads=2), "none")
    return read_capture(write_capture(tmp_path / "vllm.safetensors", t, {**meta, "backend": name, "engine_backend": engine_backend}))


def test_the_hook_names_every_block_table_kernel():
    assert sorted(name for _, name in ENGINE_KERNELS) == sorted(PAGED)


@pytest.mark.parametrize(("engine_backend", "name"), ENGINE_KERNELS)
def test_a_vllm_capture_replays_through_its_own_kernel_by_default(standins, tmp_path, engine_backend, name, monkeypatch):
    """Issue 27: a capture vLLM's FLASHMLA (...) wrote names its kernel (meta backend, as the vLLM hook
    writes it); a default replay runs that kernel where it can run (here: the stand-in) and it passes."""
    from refmla.pipeline import backend_names, engine_default

    monkeypatch.setenv("REFMLA_EXTEND_IMPL", "torch")  # the other default backends, without the interpreter's extend
    cap = _vllm_capture(tmp_path, engine_backend, name)
    assert name not in backend_names(ReplayOptions(), cap.meta.mode)  # opt-in for any other capture
    assert engine_default(cap) == (name,)
    report = replay_capture(cap, ReplayOptions(explain=False))
    assert report.backends[name].status == "pass", report.backends[name].reason
    assert report.verdict == "agree" and report.exit_code == 0


class _Absent:
    def availability(self) -> tuple[bool, str]:
        return False, "this test: the kernel is not installed"


@pytest.mark.parametrize(("engine_backend", "name"), ENGINE_KERNELS)
def test_without_its_kernel_a_vllm_capture_replays_the_others(tmp_path, engine_backend, name, monkeypatch):
    from refmla.pipeline import engine_default

    monkeypatch.setitem(BACKEND_CACHE, name, _Absent())  # whatever this machine has
    assert engine_default(_vllm_capture(tmp_path, engine_backend, name)) == ()

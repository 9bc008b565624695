"""DeepSeek-V4 pages whose tiles were scaled for e4m3fn's range (amax / 448) and cast into an
e4m3fnuz pool (+-240): ``kv_cast_overflow`` on a packed writer (refmla.kvwrite.encoding).

Test data: SGLang's own V4 store (``triton_fused_store_flashmla``, ROCm's path, in the Triton
interpreter) on an image mixing builds -- its store module's range e4m3fn's, its cast gfx942's
e4m3fnuz (the module's ``_FP8_DTYPE`` set by this file) -- captured by refmla's hook as MI300X's
pool; and this file's own loop with torch's unsaturated cast (NaN from 248 up)."""

from __future__ import annotations

import sys

import pytest
import torch

from refmla.kvwrite.io import read_kv_write, write_kv_write
from refmla.options import ReplayOptions
from refmla.pipeline import replay_file

STORE = "sglang.kernels.ops.kvcache.triton_store_cache"
FNUZ_PROBE = "sglang.kernels.ops.quantization.fp8_kernel"


@pytest.fixture
def mixed_store(tmp_path):
    """A kv_write capture of SGLang's V4 fused store, range e4m3fn, cast e4m3fnuz."""
    import dsv4_kit

    from refmla.hook import patching
    from refmla.hook.config import HookConfig

    try:
        pool = dsv4_kit.token_to_kv_pool([0, 4, 128])
        dsv4_kit.pack_quantizer()
        import importlib

        st, probe = importlib.import_module(STORE), importlib.import_module(FNUZ_PROBE)
    except (dsv4_kit.Unavailable, ImportError) as e:
        pytest.skip(str(e))
    saved = st._FP8_DTYPE, probe.is_fp8_fnuz
    dsv4_kit.rocm_store()
    st._FP8_DTYPE, probe.is_fp8_fnuz = torch.float8_e4m3fnuz, lambda: True  # gfx942's cast and pool
    try:
        patching.install(HookConfig(out_dir=str(tmp_path), backends=frozenset({"kvwrite"}), min_seq_len=0))
        pool.set_swa_key_buffer_radix_fused(layer_id=1, swa_loc=torch.tensor([2, 5, 9, 511], dtype=torch.int32),
                                            cache_k=dsv4_kit.v4_latent(4))  # fmt: skip
    finally:
        patching.uninstall()
        dsv4_kit.rocm_store(False)
        st._FP8_DTYPE, probe.is_fp8_fnuz = saved
    (f,) = sorted(tmp_path.glob("kvwrite-*set_swa_key_buffer_radix_fused*.safetensors"))
    return f


def test_sglangs_store_scaled_for_448_into_an_e4m3fnuz_pool_is_a_cast_overflow(mixed_store):
    cap = read_kv_write(mixed_store)
    assert cap.meta.kv_dtype == "float8_e4m3fnuz" and cap.meta.packed
    r = replay_file(mixed_store, ReplayOptions())
    e = r.backends["observed"].explanation
    assert e is not None and e.hypothesis == "kv_cast_overflow", r.diagnosis_text
    assert (e.detail["kv_dtype"], e.detail["range_of"]) == ("float8_e4m3fnuz", "float8_e4m3fn")
    assert e.detail["elements"] > 0 and e.detail["stored_nan"] == 0 and e.detail["smallest_overflowing"] > 240
    assert e.detail["cast"].startswith("clamped to +-240")  # the interpreter's cast saturates
    assert r.diagnosis == "kv_saturated" and r.diagnosis_text.startswith("kv_cast_overflow")


def test_the_same_tiles_cast_by_torch_store_nan_and_are_named(tmp_path, mixed_store):
    """This file's own loop: the capture's pages re-stored with torch's x.to(e4m3fnuz), unsaturated."""
    cap = read_kv_write(mixed_store)
    x = cap.latent.float().reshape(cap.tokens, 7, 64)
    s = x.abs().amax(-1).clamp_min(1e-8) / 448.0  # SGLang's scale, for e4m3fn's range
    e = torch.ceil(torch.log2(s))  # UE8M0: the power of two at or above
    q = (x * torch.exp2(-e)[..., None]).clamp(-448, 448).reshape(cap.tokens, -1).to(torch.float8_e4m3fnuz)
    assert bool(torch.isnan(q.float()).any())  # torch 2.x: NaN from 248 up
    rows = cap.rows_after.clone()
    at = torch.searchsorted(cap.pool_slots, cap.slots.long())
    rows[at, :448] = q.view(torch.uint8)
    path = tmp_path / "torch-cast.safetensors"
    write_kv_write(path, {n: getattr(cap, n) for n in ("latent", "rope", "slots", "pool_slots", "rows_before")}
                   | {"rows_after": rows}, cap.meta.to_json())  # fmt: skip
    r = replay_file(path, ReplayOptions())
    e = r.backends["observed"].explanation
    assert e is not None and e.hypothesis == "kv_cast_overflow", r.diagnosis_text
    assert e.detail["stored_nan"] == int(torch.isnan(q.float()).sum()) > 0 and "no saturation" in e.detail["cast"]


def test_a_consistent_e4m3fnuz_store_agrees(tmp_path):
    """SGLang's store with gfx942's range and cast (both e4m3fnuz): no false alarm."""
    import dsv4_kit

    from refmla.hook import patching
    from refmla.hook.config import HookConfig

    try:
        pool = dsv4_kit.token_to_kv_pool([0, 4, 128])
        dsv4_kit.pack_quantizer()
        import importlib

        st, probe = importlib.import_module(STORE), importlib.import_module(FNUZ_PROBE)
    except (dsv4_kit.Unavailable, ImportError) as e:
        pytest.skip(str(e))
    saved = st._FP8_DTYPE, st._FP8_INFO, probe.is_fp8_fnuz
    dsv4_kit.rocm_store()
    st._FP8_DTYPE, st._FP8_INFO, probe.is_fp8_fnuz = (torch.float8_e4m3fnuz, torch.finfo(torch.float8_e4m3fnuz),
                                                      lambda: True)  # fmt: skip
    try:
        patching.install(HookConfig(out_dir=str(tmp_path), backends=frozenset({"kvwrite"}), min_seq_len=0))
        pool.set_swa_key_buffer_radix_fused(layer_id=1, swa_loc=torch.tensor([2, 5, 9, 511], dtype=torch.int32),
                                            cache_k=dsv4_kit.v4_latent(4))  # fmt: skip
    finally:
        patching.uninstall()
        dsv4_kit.rocm_store(False)
        st._FP8_DTYPE, st._FP8_INFO, probe.is_fp8_fnuz = saved
    (f,) = sorted(tmp_path.glob("kvwrite-*set_swa_key_buffer_radix_fused*.safetensors"))
    assert read_kv_write(f).meta.kv_dtype == "float8_e4m3fnuz"
    assert replay_file(f, ReplayOptions()).verdict == "agree"

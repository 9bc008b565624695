"""The capture side of the aiter path: the hook's probes see SGLang's calls, the meta names the path,
the small persistent buffers travel in the capture, and the capture replays through the same path.

SGLang's AiterAttnBackend needs a ROCm GPU, so its calls are played here the way 0.5.23 makes them
(make_mla_decode_meta_data_buffer / make_mla_meta_data in init_forward_metadata, then
_forward_mla_decode inside forward_decode) against a stand-in module probed by the real probes.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from refmla.backends.aiter.paths import sglang_modes
from refmla.capture import read_capture, write_capture
from refmla.hook import kernel_probes
from refmla.hook.aiter_meta import BUFFER_MAX_BYTES, aiter_buffers, aiter_path_meta
from refmla.hook.call import Call, CallContext
from refmla.synthetic import SynthSpec, make_inputs, make_meta
from tests.test_aiter_paths import FP8, replay_aiter

NAMES = ("work_meta_data", "work_indptr", "work_info_set", "reduce_indptr", "reduce_final_map", "reduce_partial_map")


@pytest.fixture
def sglang_module(standin, monkeypatch):
    """A module standing for sglang...aiter_backend: aiter's functions in its globals, probed."""
    import aiter
    from aiter.ops.triton.gluon import mla_gluon

    mod = types.ModuleType("fake_sglang_aiter_backend")
    mod.mla_decode_fwd = standin.mla_decode_fwd
    mod.get_mla_metadata_info_v1 = aiter.get_mla_metadata_info_v1
    mod.get_mla_metadata_v1 = aiter.get_mla_metadata_v1
    mod.mla_gluon_decode = lambda **kw: mla_gluon.mla_gluon(**kw)
    mod.AiterAttnBackend = type("AiterAttnBackend", (), {"__module__": mod.__name__})
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    kernel_probes.probe_module(mod, kernel_probes.KERNEL_PROBES["aiter"][1], lambda *a: None)
    kernel_probes.probe_module(standin, kernel_probes.KERNEL_PROBES["aiter"][1], lambda *a: None)
    yield mod
    kernel_probes.clear_notes()


def sglang_decode(mod, t: dict, *, heads: int, kv_dtype, page_size: int, persistent: bool, k_scale: float):
    """SGLang 0.5.23's metadata build and persistent / non-persistent decode call; returns the backend."""
    kh, B = max(heads, 16), t["kv_indptr"].shape[0] - 1
    fast, intra, splits = sglang_modes(kh)
    backend = mod.AiterAttnBackend()
    backend.__dict__.update(head_pad_mode="repeat" if heads < 16 else "none", num_head_padded=kh,
                            mla_kernel_num_head_padded=kh, max_split_per_batch=splits, page_size=page_size,
                            mla_decode_backend="asm", use_mla_auto_kv_splits=False, dcp_world_size=1)  # fmt: skip
    mod._use_mla_ps_kernel, mod.fast_mode, mod.intra_batch_mode = persistent, fast, intra
    i32 = dict(dtype=torch.int32)
    qo, kv_indptr, last = torch.arange(B + 1, **i32), t["kv_indptr"].to(torch.int32), torch.ones(B, **i32)
    bufs = {n: None for n in NAMES}
    if persistent:  # init_forward_metadata: outside forward_decode, outside the per-call notes
        sizes = mod.get_mla_metadata_info_v1(B, 1, kh, kv_dtype, kv_dtype, is_sparse=False, fast_mode=fast,
                                             num_kv_splits=splits, intra_batch_mode=intra)  # fmt: skip
        bufs = {n: torch.empty(s, dtype=d) for n, (s, d) in zip(NAMES, sizes)}
        mod.get_mla_metadata_v1(qo, kv_indptr, last, kh, 1, False, bufs["work_meta_data"], bufs["work_info_set"],
                                bufs["work_indptr"], bufs["reduce_indptr"], bufs["reduce_final_map"],
                                bufs["reduce_partial_map"], kv_granularity=max(page_size, 16), max_seqlen_qo=1,
                                uni_seqlen_qo=1, fast_mode=fast, max_split_per_batch=splits,
                                intra_batch_mode=intra, is_cp_round_robin=False, dtype_q=kv_dtype,
                                dtype_kv=kv_dtype)  # fmt: skip
    backend.forward_metadata = types.SimpleNamespace(work_metadata=bufs["work_meta_data"], num_kv_splits=splits)
    kernel_probes.start_notes()  # forward_decode
    q = t["q"].repeat_interleave(kh // heads, dim=1) if heads < kh else t["q"]
    o = torch.empty(B, kh, 512, dtype=torch.bfloat16)
    scale = torch.tensor([k_scale]) if kv_dtype == FP8 else None
    mod.mla_decode_fwd(q, t["kv_buffer"].view(-1, 1, 1, 576), o, qo_indptr=qo, kv_indptr=kv_indptr,
                       kv_indices=t["kv_indices"].to(torch.int32), kv_last_page_lens=last, max_seqlen_q=1,
                       sm_scale=0.1, logit_cap=0.0, q_scale=scale, kv_scale=scale, intra_batch_mode=intra,
                       num_kv_splits=splits if persistent else None,
                       **{n: bufs[n] for n in NAMES})  # fmt: skip
    return backend, kernel_probes.take_notes()


def context(backend, notes) -> CallContext:
    call = Call(backend="aiter", mode="decode", layer=None, forward_batch=None, layer_id=0, step=0, rank=0,
                kernel_notes=notes)  # fmt: skip
    return CallContext(call=call, backend=backend, md=backend.forward_metadata, pool=None, heads=0, qk_head_dim=576,
                       kv_lora_rank=512, q=None, out=None)  # fmt: skip


@pytest.mark.parametrize("persistent", [True, False], ids=["persistent", "non_persistent"])
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, FP8], ids=["bf16", "fp8"])
@pytest.mark.parametrize("heads", [8, 16, 128])
def test_capture_names_the_path_and_replays_it(standin, sglang_module, tmp_path, monkeypatch, heads, kv_dtype,
                                               persistent):  # fmt: skip
    monkeypatch.setenv("SGLANG_AITER_MLA_PERSIST", "1" if persistent else "0")
    page_size, k_scale = 64, (0.5 if kv_dtype == FP8 else 1.0)
    spec = SynthSpec(name="hooked", num_heads=heads, seq_lens=(300, 17, 64), page_size=page_size, kv_dtype=kv_dtype,
                     k_scale=k_scale, v_scale=k_scale, seed=11)  # fmt: skip
    t = make_inputs(spec)
    backend, notes = sglang_decode(sglang_module, t, heads=heads, kv_dtype=kv_dtype, page_size=page_size,
                                   persistent=persistent, k_scale=k_scale)  # fmt: skip
    ctx = context(backend, notes)
    meta = {**make_meta(spec), "backend": "aiter", **aiter_path_meta(ctx)}
    assert meta["aiter_path"] == ("persistent" if persistent else "non_persistent")
    assert meta["aiter_path_source"] == "probe" and meta["aiter_kernel_heads"] == max(heads, 16)
    assert meta["aiter_kv_dtype"] == str(kv_dtype)[6:] and meta["aiter_q_dtype"] == "bfloat16"
    assert meta["aiter_env"]["SGLANG_AITER_MLA_PERSIST"] == ("1" if persistent else "0")
    assert meta["aiter_kv_granularity"] == 64 and meta["aiter_head_pad_mode"] == ("repeat" if heads < 16 else "none")
    if kv_dtype == FP8:
        assert meta["aiter_kv_scale"] == meta["aiter_q_scale"] == k_scale
    buffers, why_not = aiter_buffers(ctx)
    assert why_not is None and (len(buffers) == 5) is persistent
    if persistent:
        assert meta["aiter_metadata_call"]["kv_granularity"] == 64
        assert meta["aiter_metadata_info_call"]["num_head_qo"] == max(heads, 16)
    t["out"] = torch.zeros(3, heads, 512, dtype=torch.bfloat16)
    write_capture(tmp_path / "c.safetensors", {**t, **buffers}, meta, compact=False)
    cap = read_capture(tmp_path / "c.safetensors")
    assert not [w for w in cap.warnings if "ignored" in w]  # the buffers are known tensors
    entry = replay_aiter(cap)
    assert entry["status"] == "pass", entry.get("reason")
    assert entry["info"]["path"] == meta["aiter_path"]
    assert standin.CALLS[-1]["mode"] == meta["aiter_path"]
    assert "findings" not in entry["info"]
    if persistent:
        assert len(entry["info"]["metadata_compared"]) == 5


def test_gluon_call_is_named(standin, sglang_module):
    backend = sglang_module.AiterAttnBackend()
    backend.forward_metadata = types.SimpleNamespace(work_metadata=None)
    kernel_probes.start_notes()
    q = torch.randn(2, 12, 576).to(torch.bfloat16)
    kv = torch.randn(10, 1, 576).to(torch.bfloat16)
    sglang_module.mla_gluon_decode(q_nope=q[..., :512], q_pe=q[..., 512:], kv_c=kv.view(-1, 576),
                                   o=torch.empty(2, 12, 512, dtype=torch.bfloat16),
                                   page_table=torch.arange(6, dtype=torch.int32),
                                   seq_info=torch.tensor([0, 3, 6], dtype=torch.int32), sm_scale=0.1,
                                   kv_pe_offset=512, use_2d_view=False, kv_scale=1.0, min_kv_seq_len=3)  # fmt: skip
    meta = aiter_path_meta(context(backend, kernel_probes.take_notes()))
    assert meta["aiter_path"] == "gluon" and meta["aiter_gluon_call"]["min_kv_seq_len"] == 3


def test_large_buffers_are_left_out_with_the_reason(standin, sglang_module):
    big = torch.zeros(BUFFER_MAX_BYTES // 4 + 1, dtype=torch.int32)
    notes = {"aiter_kernel_tensors": {n: big for n in NAMES}}
    backend = sglang_module.AiterAttnBackend()
    backend.forward_metadata = None
    buffers, why_not = aiter_buffers(context(backend, notes))
    assert buffers == {} and "not captured" in why_not and "REFMLA_CAPTURE_AITER_META=full" in why_not


def test_large_buffers_are_captured_whole_when_asked(standin, sglang_module, monkeypatch):
    """REFMLA_CAPTURE_AITER_META=full: the plan whole, whatever its size (refmla inspect checks it);
    the size is in the meta either way."""
    big = torch.zeros(BUFFER_MAX_BYTES // 4 + 1, dtype=torch.int32)
    notes = {"aiter_kernel_tensors": {n: big for n in NAMES}, "aiter_kernel_call": {}}
    backend = sglang_module.AiterAttnBackend()
    backend.forward_metadata = None
    ctx = context(backend, notes)
    assert aiter_path_meta(ctx)["aiter_buffers_bytes"] == 5 * big.numel() * 4
    monkeypatch.setenv("REFMLA_CAPTURE_AITER_META", "full")
    buffers, why_not = aiter_buffers(ctx)
    assert why_not is None and len(buffers) == 5 and all(b.numel() == big.numel() for b in buffers.values())


def test_probes_never_raise_into_the_server():
    """Arguments the probe cannot read: the call still runs and returns the kernel's result."""
    mod = types.ModuleType("fake_kernels")
    mod.mla_decode_fwd = lambda *args, **kwargs: 42
    mod.get_mla_metadata_v1 = lambda *args, **kwargs: 43
    kernel_probes.probe_module(mod, kernel_probes.KERNEL_PROBES["aiter"][1], lambda *a: None)
    kernel_probes.start_notes()
    try:
        assert mod.get_mla_metadata_v1(object(), work_info_set=object()) == 43
        assert mod.mla_decode_fwd(object(), object(), q=object(), work_info_set=object()) == 42
    finally:
        kernel_probes.clear_notes()


def test_probes_note_nothing_outside_a_captured_call(sglang_module, standin):
    kernel_probes.start_notes()
    kernel_probes.clear_notes()  # the wrapper's finally: the call is over
    sglang_module.get_mla_metadata_info_v1(2, 1, 16, torch.bfloat16, torch.bfloat16, is_sparse=False)
    assert kernel_probes.take_notes() == {} and kernel_probes._open_notes() is None

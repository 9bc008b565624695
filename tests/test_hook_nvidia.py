"""The SGLang hook on SGLang's NVIDIA MLA decode backends (FlashMLA, TRT-LLM-gen MLA, FlashInfer MLA,
FA3 with qv), driven through its real install path with stand-ins written from SGLang 0.5.23's
``forward_decode`` (tests/standins/sglang_nvidia.py): each capture records the backend, the page
size, the dtypes, the KV scales the kernel applied and the block table, opens, and replays through
the reference in agreement with the stand-in's (correct) output. A table that cannot be read is a
skip, never a raise, and the server's output is never touched."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Optional

import pytest
import torch

from helpers import STANDINS, paged_case
from refmla.capture import read_capture
from refmla.context import ReplayOptions
from refmla.hook import patching
from refmla.hook.config import BACKENDS, DEFAULT_BACKENDS, HookConfig
from refmla.hook.sglang_paths import BACKEND_CLASSES, DECODE_ONLY
from refmla.pipeline import replay_capture

FP8 = torch.float8_e4m3fn
CLASS = {"flashmla": "FlashMLABackend", "trtllm_mla": "TRTLLMMLABackend",
         "flashinfer_mla": "FlashInferMLAAttnBackend", "fa3_mla": "FlashAttentionBackend"}  # fmt: skip


@dataclass(frozen=True)
class NvCase:
    backend: str  # the hook's name for it
    page: int  # the page size its kernel reads
    kv_dtype: torch.dtype = torch.bfloat16
    k_scale: Optional[float] = None  # the checkpoint's k_scale = v_scale (None: none)
    seq_lens: tuple = (130, 1, 64)  # a one-token request; a request that ends on a page boundary
    heads: int = 16
    seed: int = 5


@pytest.fixture
def standin(monkeypatch):
    monkeypatch.syspath_prepend(str(STANDINS))
    import sglang_nvidia

    for name, mod in sglang_nvidia.modules().items():
        monkeypatch.setitem(sys.modules, name, mod)
    sglang_nvidia.CALLS.clear()
    yield sglang_nvidia
    patching.uninstall()


def _table(idx, indptr, P, n_pages):
    """[B, M] pages of each request in position order, padded with a page no request uses (NaN rows)."""
    B = indptr.shape[0] - 1
    pages = [idx[int(indptr[b]) : int(indptr[b + 1])][::P] // P for b in range(B)]
    free = sorted(set(range(n_pages)) - set(torch.cat(pages).tolist()))[0]
    table = torch.full((B, max(len(p) for p in pages) + 1), free, dtype=torch.int32)
    for b, p in enumerate(pages):
        table[b, : len(p)] = p.to(torch.int32)
    return table


def build(case: NvCase, sglang_nvidia):
    """(backend object, call kwargs, layer): the backend's class from the patched module."""
    q, pool, indptr, idx = paged_case(list(case.seq_lens), case.heads, page_size=case.page, dtype=torch.float32,
                                      seed=case.seed)  # fmt: skip
    q, pool = q.to(torch.bfloat16), pool.to(case.kv_dtype)
    B, H, P = len(case.seq_lens), case.heads, case.page
    seq = torch.tensor(case.seq_lens, dtype=torch.int32)
    table = _table(idx, indptr, P, pool.shape[0] // P)
    scale = None if case.k_scale is None else torch.tensor(case.k_scale)
    layer = SimpleNamespace(layer_id=2, tp_q_head_num=H, tp_k_head_num=1, qk_head_dim=576, head_dim=576,
                            v_head_dim=512, scaling=0.1352, logit_cap=0.0, sliding_window_size=-1,
                            k_scale=scale, v_scale=scale, k_scale_float=case.k_scale, v_scale_float=case.k_scale)  # fmt: skip
    fb = SimpleNamespace(batch_size=B, seq_lens=seq, seq_lens_cpu=seq, forward_mode=SimpleNamespace(name="DECODE"),
                         req_pool_indices=None, spec_info=None)  # fmt: skip
    module = next(m for n, m in sys.modules.items() if n.endswith(_module(case.backend)))
    obj = getattr(module, CLASS[case.backend])()
    obj.token_to_kv_pool = SimpleNamespace(get_key_buffer=lambda layer_id: pool, kv_lora_rank=512)
    obj.page_size = P
    _metadata(case, obj, table, seq, indptr, idx)
    kwargs = dict(q=q.reshape(B, -1), k=None, v=None, layer=layer, forward_batch=fb)
    if case.backend != "flashmla":  # the latent part and the rope part apart, as these backends take q
        kwargs.update(q=q[..., :512].reshape(B, -1), q_rope=q[..., 512:].reshape(B, -1))
    return obj, kwargs, table


def _module(backend):
    return BACKEND_CLASSES[backend][0][0].rsplit(".", 1)[1]


def _metadata(case, obj, table, seq, indptr, idx):
    if case.backend == "flashmla":
        obj.forward_metadata = SimpleNamespace(block_kv_indices=table, flashmla_metadata=None, num_splits=None)
    elif case.backend == "trtllm_mla":
        obj.data_type = case.kv_dtype
        obj.forward_metadata = SimpleNamespace(block_kv_indices=torch.zeros_like(table))  # stale: not what ran
        obj.forward_decode_metadata = SimpleNamespace(block_kv_indices=table, seq_lens_k=None,
                                                      max_seq_len_k=int(seq.max()))  # fmt: skip
    elif case.backend == "flashinfer_mla":
        tail = torch.full((7,), 10**6, dtype=torch.int32)  # the plan buffer's stale tail: never read
        wrapper = SimpleNamespace(_kv_indptr_buf=indptr.to(torch.int32), _kv_indices_buf=torch.cat([idx.int(), tail]),
                                  _kv_len_arr_buf=seq, _page_size=1, _sm_scale=0.1352)  # fmt: skip
        obj.forward_metadata = SimpleNamespace(decode_wrapper=wrapper)
    else:
        obj.forward_metadata = SimpleNamespace(page_table=table, cache_seqlens_int32=seq, local_attn_metadata=None)
        obj.use_mla, obj.topk, obj.kv_cache_dtype_str = True, 0, "fp8_e4m3" if case.kv_dtype == FP8 else "auto"


def capture(tmp_path, case: NvCase, sglang_nvidia):
    patching.install(HookConfig(out_dir=str(tmp_path), min_seq_len=1, backends=frozenset({case.backend})))
    obj, kwargs, table = build(case, sglang_nvidia)
    out = obj.forward_decode(**kwargs)
    state = patching.current_state().summary()
    assert state["disabled"] is None and state["files_written"] == 1, state
    return out, table, read_capture(next(tmp_path.glob("*.safetensors")))


CASES = [
    NvCase("flashmla", 64), NvCase("flashmla", 64, FP8, k_scale=0.5),
    NvCase("trtllm_mla", 32), NvCase("trtllm_mla", 64, FP8, k_scale=0.5),
    NvCase("flashinfer_mla", 1), NvCase("flashinfer_mla", 1, FP8, k_scale=0.5),
    NvCase("fa3_mla", 16), NvCase("fa3_mla", 1, FP8, k_scale=0.5),
]  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.backend}-p{c.page}-{str(c.kv_dtype)[6:]}")
def test_capture_records_the_call_and_replays_agree(standin, tmp_path, case):
    out, table, cap = capture(tmp_path, case, standin)
    m, call = cap.meta, standin.CALLS[-1]
    assert (m.backend, m.engine, m.page_size, m.layer_id) == (case.backend, "sglang", case.page, 2)
    assert m.engine_backend == CLASS[case.backend]
    assert (m.extra["q_dtype"], m.extra["kv_dtype"]) == ("bfloat16", str(case.kv_dtype)[6:])
    if case.kv_dtype == FP8:  # the scales the kernel applied, and the checkpoint's when they differ
        assert (m.k_scale, m.v_scale) == (call["k_scale"], call["v_scale"])
        assert m.extra.get("layer_v_scale") == (0.5 if call["v_scale"] != 0.5 else None)
    if case.backend == "flashinfer_mla":
        assert cap.block_table is None  # its plan is token level (page 1)
    else:  # the table as the kernel read it, renumbered to the compacted pages
        assert cap.block_table is not None and cap.block_table.shape == table.shape
        assert torch.equal(cap.orig_kv_indices, call["rows"])
    assert torch.equal(cap.out.reshape(out.shape), out)  # the server's output as it was
    report = replay_capture(cap, ReplayOptions(backends=[], explain=False))
    assert {n: e.status for n, e in report.backends.items()} == {"reference": "pass", "observed": "pass"}
    assert report.verdict == "agree"


def test_a_wrong_stand_in_output_is_a_finding(standin, tmp_path):
    """The replay is not a rubber stamp: the same call with V scaled by 2 in the output disagrees."""
    out, _, cap = capture(tmp_path, NvCase("trtllm_mla", 32), standin)
    from refmla.capture import write_capture

    from refmla.capture.format import TENSORS

    t = {k: getattr(cap, k) for k in TENSORS if getattr(cap, k, None) is not None}
    t["out"] = cap.out * 2
    bad = read_capture(write_capture(tmp_path / "bad.safetensors", t, cap.meta.to_json(), compact=False))
    assert replay_capture(bad, ReplayOptions(backends=[], explain=False)).verdict != "agree"


@pytest.mark.parametrize("backend", ["flashmla", "trtllm_mla", "fa3_mla"])
def test_an_unreadable_table_is_a_skip_never_a_raise(standin, tmp_path, backend):
    case = NvCase(backend, 64 if backend != "trtllm_mla" else 32)
    patching.install(HookConfig(out_dir=str(tmp_path), min_seq_len=1, backends=frozenset({backend})))
    obj, kwargs, table = build(case, standin)
    table[0, 1] = -1  # inside request 0 (130 tokens)
    out = obj.forward_decode(**kwargs)
    state = patching.current_state().summary()
    assert state["files_written"] == 0 and state["disabled"] is None
    assert any("inside the sequence" in why for why in state["skipped"]), state["skipped"]
    assert out.shape == (3, 16 * 512)


def test_an_unknown_plan_is_a_skip(standin, tmp_path):
    """A FlashInfer plan of another page size (SGLang plans page 1): not read as token slots."""
    patching.install(HookConfig(out_dir=str(tmp_path), min_seq_len=1, backends=frozenset({"flashinfer_mla"})))
    obj, kwargs, _ = build(NvCase("flashinfer_mla", 1), standin)
    obj.forward_metadata.decode_wrapper._page_size = 16
    out = obj.forward_decode(**kwargs)
    state = patching.current_state().summary()
    assert state["files_written"] == 0 and state["disabled"] is None and out.shape == (3, 16 * 512)
    assert any("page_size 16" in why for why in state["skipped"]), state["skipped"]


def test_backends_are_known_opt_in_and_decode_only():
    for name in ("flashmla", "trtllm_mla", "flashinfer_mla", "fa3_mla"):
        assert name in BACKENDS and name not in DEFAULT_BACKENDS and name in DECODE_ONLY
        assert BACKEND_CLASSES[name][0][1] == CLASS[name]
    cfg = HookConfig.from_env({"REFMLA_CAPTURE_DIR": "/tmp/x", "REFMLA_CAPTURE_BACKENDS": "trtllm_mla,fa3_mla"})
    assert cfg.backends == {"trtllm_mla", "fa3_mla"}


def test_extend_is_not_wrapped_on_nvidia_backends(standin, tmp_path):
    mod = sys.modules["sglang.srt.layers.attention.trtllm_mla_backend"]
    mod.TRTLLMMLABackend.forward_extend = lambda self, q, k, v, layer, forward_batch, save_kv_cache=True: None
    patching.install(HookConfig(out_dir=str(tmp_path), modes=frozenset({"decode", "extend"}), backends=frozenset({"trtllm_mla"})))
    attention = [m for m in patching.patched_methods() if ".attention." in m]  # (ForwardBatch.init_new: the request table)
    assert attention == ["sglang.srt.layers.attention.trtllm_mla_backend.TRTLLMMLABackend.forward_decode"]

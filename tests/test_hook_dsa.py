"""The hook's capture of DeepSeek-V3.2 DSA decode on ROCm (refmla.hook.dsa_call).

What runs: SGLang 0.5.23's real ``dsa_backend`` module (imported on CPU), its real
``DeepseekSparseAttnBackend`` class, and the hook's patcher on its ``_forward_aiter``. What could
not be driven here: the real ``_forward_aiter`` body, which calls aiter's ``mla_decode_fwd`` (ROCm
only). So the method is a stand-in with the real signature (asserted against SGLang's) whose body
computes the same attention with a plain loop: each query row attends the slots of its
``page_table_1`` row that are not -1, over the layer's plain MLA cache, values dequantized by
``layer.k_scale`` under fp8. The capture is then replayed through the reference, the Triton decode
(interpreted) and the production output."""

from __future__ import annotations

import inspect
import math
from types import SimpleNamespace

import pytest
import torch

from refmla.capture import read_capture
from refmla.hook.config import HookConfig

DSA_MODULE = "sglang.srt.layers.attention.dsa_backend"
H, D, DV, K = 16, 576, 512, 64  # V3.2 at TP8: 128 / 8 heads; index width cut to 64 here (2048 in the model)


def forward_aiter(self, q_all: torch.Tensor, kv_cache: torch.Tensor, page_table_1: torch.Tensor, layer,
                  metadata, bs: int) -> torch.Tensor:  # fmt: skip
    """Stands for _forward_aiter: [T, H * Dv] from the valid top-k slots of each row, a plain loop."""
    q = q_all.reshape(-1, layer.tp_q_head_num, layer.head_dim).double()
    cache = kv_cache.reshape(-1, layer.head_dim).double()
    if kv_cache.element_size() == 1:
        cache = cache * float(layer.k_scale)
    o = torch.zeros(q.shape[0], layer.tp_q_head_num, layer.v_head_dim, dtype=torch.float64)
    for t in range(q.shape[0]):
        slots = [s for s in page_table_1[t].tolist() if s != -1]
        if not slots:
            continue
        k = cache[slots]  # [n, D]
        p = torch.softmax(q[t] @ k.T * layer.scaling, dim=-1)  # [H, n]
        o[t] = p @ k[:, : layer.v_head_dim]
    return o.to(torch.bfloat16).reshape(q.shape[0], -1)


@pytest.fixture
def dsa_class(monkeypatch):
    import importlib

    from sglang_kit import prepare

    from refmla.hook import patching

    prepare()
    cls = importlib.import_module(DSA_MODULE).DeepseekSparseAttnBackend
    assert list(inspect.signature(cls._forward_aiter).parameters) == list(inspect.signature(forward_aiter).parameters)
    monkeypatch.setattr(cls, "_forward_aiter", forward_aiter)
    yield cls
    patching.uninstall()


def call(kv_dtype=torch.bfloat16, rows=4, seed=0):
    """One decode call's arguments: shuffled top-k slots with -1 padding, a one-slot row, an empty row."""
    g = torch.Generator().manual_seed(seed)
    N = 400
    kv = torch.randn(N, 1, D, generator=g)
    kv = (kv * 4).to(kv_dtype) if kv_dtype != torch.bfloat16 else kv.to(torch.bfloat16)
    table = torch.full((rows, K), -1, dtype=torch.int32)
    for b, n in enumerate([50, 1, 0, 64][:rows]):
        table[b, :n] = torch.randperm(N, generator=g)[:n].to(torch.int32)
    table[0] = table[0, torch.randperm(K, generator=g)]  # -1 entries between valid ones
    layer = SimpleNamespace(layer_id=7, tp_q_head_num=H, head_dim=D, v_head_dim=DV, logit_cap=0.0,
                            scaling=192**-0.5 * (0.1 * math.log(40) + 1) ** 2,
                            k_scale=torch.tensor(0.25) if kv_dtype != torch.bfloat16 else None)  # fmt: skip
    q = torch.randn(rows, H * D, generator=g).to(torch.bfloat16)
    return dict(q_all=q, kv_cache=kv, page_table_1=table, layer=layer, metadata=None, bs=rows)


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_the_dsa_aiter_decode_is_captured_as_a_decode_over_the_top_k_and_replays(tmp_path, dsa_class, kv_dtype):
    from refmla.backends.triton_interp import ensure_interpreter, install_bf16_dot_fix
    from refmla.hook import patching
    from refmla.options import ReplayOptions
    from refmla.pipeline import replay_file

    ensure_interpreter()
    install_bf16_dot_fix()
    state = patching.install(HookConfig(out_dir=str(tmp_path), backends=frozenset({"dsa"})))
    assert getattr(dsa_class._forward_aiter, "__wrapped__", None) is forward_aiter
    kw = call(kv_dtype)
    served = dsa_class._forward_aiter(SimpleNamespace(), **kw)
    assert torch.equal(served, forward_aiter(None, **kw))  # the server's result, untouched
    (path,) = sorted(tmp_path.glob("decode-*.safetensors"))
    assert state.files_written == 1 and state.disabled is None and "dsa-aiter" in path.name
    cap = read_capture(path)
    valid = [[s for s in row if s != -1] for row in kw["page_table_1"].tolist()]
    assert cap.seq_lens.tolist() == [50, 1, 0, 64] and cap.orig_kv_indices.tolist() == sum(valid, [])
    assert cap.kv_buffer.shape[0] == len(set(sum(valid, [])))  # only the referenced rows
    m = cap.meta
    assert (m.backend, m.kv_lora_rank, m.qk_rope_head_dim, m.layer_id, m.page_size) == ("aiter", 512, 64, 7, 1)
    assert m.extra["dsa_topk"] == K and m.extra["decode_kernel"] == "dsa_aiter_mla_decode_fwd"
    assert m.k_scale == (0.25 if kv_dtype != torch.bfloat16 else 1.0)
    r = replay_file(str(path), ReplayOptions(backends=("reference", "observed", "triton"), isolate=False))
    assert r.verdict == "agree", {n: (b.status, b.reason) for n, b in r.backends.items()}


def test_several_query_tokens_per_request_are_a_counted_skip_and_the_call_is_untouched(tmp_path, dsa_class):
    from refmla.hook import patching

    state = patching.install(HookConfig(out_dir=str(tmp_path), backends=frozenset({"dsa"})))
    kw = call()
    kw["q_all"] = torch.cat([kw["q_all"], kw["q_all"]])  # MTP: 8 query rows (one index row each), 4 requests
    kw["page_table_1"] = torch.cat([kw["page_table_1"], kw["page_table_1"]])
    out = dsa_class._forward_aiter(SimpleNamespace(), **kw)
    assert torch.equal(out, forward_aiter(None, **kw))
    assert not list(tmp_path.glob("*.safetensors")) and state.disabled is None
    assert sum(state.skipped.values()) == 1


def test_an_exception_inside_the_capture_disables_the_hook_not_the_call(tmp_path, dsa_class, monkeypatch):
    from refmla.hook import dsa_call, patching

    state = patching.install(HookConfig(out_dir=str(tmp_path), backends=frozenset({"dsa"})))
    monkeypatch.setattr(dsa_call, "dsa_tensors", lambda a, out: 1 / 0)
    kw = call()
    out = dsa_class._forward_aiter(SimpleNamespace(), **kw)
    assert torch.equal(out, forward_aiter(None, **kw)) and "ZeroDivisionError" in (state.disabled or "")
    assert not list(tmp_path.glob("*.safetensors"))
    dsa_class._forward_aiter(SimpleNamespace(), **kw)  # disabled: straight through, still no file
    assert not list(tmp_path.glob("*.safetensors"))


def test_the_folder_budget_stops_the_capture(tmp_path, dsa_class):
    from refmla.hook import patching

    state = patching.install(HookConfig(out_dir=str(tmp_path), backends=frozenset({"dsa"}), max_files=1))
    for seed in range(3):
        dsa_class._forward_aiter(SimpleNamespace(), **call(seed=seed))
    assert len(list(tmp_path.glob("decode-*.safetensors"))) == 1 and not state.active and state.disabled is None


def test_a_kernel_reading_minus_one_as_slot_0_is_caught_in_the_replay(tmp_path, dsa_class, monkeypatch):
    """The capture holds what the kernel was asked to read: a production kernel that reads every -1
    of page_table_1 as slot 0 (SGLang #31218's class of bug) diverges from the capture's reference."""
    from refmla.hook import patching
    from refmla.options import ReplayOptions
    from refmla.pipeline import replay_file

    def buggy(self, q_all, kv_cache, page_table_1, layer, metadata, bs):
        return forward_aiter(self, q_all, kv_cache, page_table_1.clamp(min=0), layer, metadata, bs)

    monkeypatch.setattr(dsa_class, "_forward_aiter", buggy)
    patching.install(HookConfig(out_dir=str(tmp_path), backends=frozenset({"dsa"})))
    dsa_class._forward_aiter(SimpleNamespace(), **call())
    (path,) = sorted(tmp_path.glob("decode-*.safetensors"))
    r = replay_file(str(path), ReplayOptions(backends=("reference", "observed"), isolate=False, explain=False))
    assert r.verdict == "diverged" and r.backends["observed"].status == "fail"

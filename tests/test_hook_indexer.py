"""The hook's capture of DeepSeek-V3.2's indexer decode top-k (refmla.hook.indexer_call).

What runs: SGLang's real ``dsa_indexer`` module (imported on CPU), its real ``Indexer`` class and
its real ``_get_index_k_read_buffer`` (the pool's index-K buffer), and the hook's patcher on
``Indexer._get_topk_paged``. What could not be driven here: the real ``_get_topk_paged`` body, which
calls DeepGEMM (CUDA). So the method is a stand-in with the real signature (asserted against
SGLang's) whose body is SGLang's own torch path: ``fp8_paged_mqa_logits_torch`` over the pool's
buffer, then ``topk_transform_pytorch_vectorized`` into pool slots. The capture is then replayed
through the fp64 indexer."""

from __future__ import annotations

import importlib
import inspect
from types import SimpleNamespace

import pytest
import torch

import indexer_kit as kit
from refmla.hook.config import HookConfig

MODULE = "sglang.srt.layers.attention.dsa.dsa_indexer"
POOL = SimpleNamespace(buffer=None)


def get_token_to_kv_pool():  # what the stand-in's module global resolves to, as SGLang's does
    return SimpleNamespace(get_index_k_with_scale_buffer=lambda layer_id: POOL.buffer)


def _get_topk_paged(self, forward_batch, layer_id: int, q_fp8: torch.Tensor, weights: torch.Tensor, metadata) -> torch.Tensor:
    """Stands for Indexer._get_topk_paged: SGLang's torch logits and top-k transform, pool slots."""
    _, ind = kit.sglang()
    kv = self._get_index_k_read_buffer(get_token_to_kv_pool(), layer_id)
    table, lens = metadata.get_page_table_64(), metadata.get_seqlens_int32()
    logits = ind.fp8_paged_mqa_logits_torch(q_fp8[:, None], kv, weights, lens, table, None, table.shape[1] * 64,
                                            clean_logits=False)  # fmt: skip
    out = torch.empty(q_fp8.shape[0], 256, dtype=torch.int32)
    ind.topk_transform_pytorch_vectorized(logits, lens, table, out, 64)
    return out


@pytest.fixture
def indexer_class(monkeypatch):
    from sglang_kit import prepare

    from refmla.hook import patching

    prepare()
    cls = importlib.import_module(MODULE).Indexer
    assert list(inspect.signature(cls._get_topk_paged).parameters) == list(inspect.signature(_get_topk_paged).parameters)
    monkeypatch.setattr(cls, "_get_topk_paged", _get_topk_paged)
    yield cls
    patching.uninstall()


def call(cls, seed=0):
    """(owner, arguments) of one decode call over a pool with pages no request uses."""
    t, m = kit.call([300, 1500, 70], topk=256, seed=seed)
    P = t["k_cache"].shape[0]
    spare = torch.randn(5, t["k_cache"].shape[1]).to(torch.uint8)  # pages of other layers' requests
    POOL.buffer = torch.cat([t["k_cache"], spare]).view(P + 5, 64, 1, 132)
    meta = SimpleNamespace(get_page_table_64=lambda: t["page_table"], get_seqlens_int32=lambda: t["seq_lens"])
    owner = SimpleNamespace(_get_index_k_read_buffer=cls._get_index_k_read_buffer)
    return owner, dict(forward_batch=SimpleNamespace(rids=["a", "b", "c"]), layer_id=5, q_fp8=t["q"],
                       weights=t["weights"], metadata=meta)  # fmt: skip


def test_the_indexer_call_is_captured_and_replays_agree(tmp_path, indexer_class):
    from refmla.hook import patching
    from refmla.indexer.io import read_indexer
    from refmla.options import ReplayOptions
    from refmla.pipeline import replay_file

    state = patching.install(HookConfig(out_dir=str(tmp_path), backends=frozenset({"dsa"})))
    assert getattr(indexer_class._get_topk_paged, "__wrapped__", None) is _get_topk_paged
    owner, kw = call(indexer_class)
    served = indexer_class._get_topk_paged(owner, **kw)
    assert torch.equal(served, _get_topk_paged(owner, **kw))  # the server's result, untouched
    (path,) = sorted(tmp_path.glob("indexer-*.safetensors"))
    assert state.files_written == 1 and state.disabled is None and "-L005-" in path.name
    cap = read_indexer(path)
    assert cap.k_cache.shape[0] < POOL.buffer.shape[0] and torch.equal(cap.indices, served)  # only the pages used
    assert cap.meta.rids == ["a", "b", "c"] and cap.meta.indices_kind == "slots" and cap.meta.topk == 256
    r = replay_file(str(path), ReplayOptions(backends=["sglang_indexer_torch"]))
    assert r.verdict == "agree" and r.backends["sglang_indexer_torch"].status == "pass", r.diagnosis_text


def test_several_query_tokens_per_request_are_a_counted_skip(tmp_path, indexer_class, monkeypatch):
    from refmla.hook import patching

    def mtp(self, forward_batch, layer_id: int, q_fp8: torch.Tensor, weights: torch.Tensor, metadata) -> torch.Tensor:
        half = q_fp8.shape[0] // 2  # two query tokens per request (MTP): one index row each
        r = _get_topk_paged(self, forward_batch, layer_id, q_fp8[:half], weights[:half], metadata)
        return torch.cat([r, r])

    monkeypatch.setattr(indexer_class, "_get_topk_paged", mtp)
    state = patching.install(HookConfig(out_dir=str(tmp_path), backends=frozenset({"dsa"})))
    owner, kw = call(indexer_class)
    kw.update(q_fp8=torch.cat([kw["q_fp8"]] * 2), weights=torch.cat([kw["weights"]] * 2))
    out = indexer_class._get_topk_paged(owner, **kw)
    assert torch.equal(out, mtp(owner, **kw))
    assert not list(tmp_path.glob("*.safetensors")) and state.disabled is None and sum(state.skipped.values()) == 1


def test_an_exception_inside_the_capture_disables_the_hook_not_the_call(tmp_path, indexer_class, monkeypatch):
    from refmla.hook import indexer_call, patching

    state = patching.install(HookConfig(out_dir=str(tmp_path), backends=frozenset({"dsa"})))
    monkeypatch.setattr(indexer_call, "indexer_tensors", lambda *a: 1 / 0)
    owner, kw = call(indexer_class)
    out = indexer_class._get_topk_paged(owner, **kw)
    assert torch.equal(out, _get_topk_paged(owner, **kw)) and "ZeroDivisionError" in (state.disabled or "")
    assert not list(tmp_path.glob("*.safetensors"))

"""The hook's capture of DeepSeek-V4's C4 indexer (refmla.hook.c4_indexer_call).

What runs: SGLang's real ``dsv4.indexer`` module (imported on CPU), its real
``C4IndexerBackendMixin`` class, and the hook's patcher on its ``forward_c4_indexer`` and prepare
steps. What could not be driven here: the real bodies, which run the compressor, the projections
and DeepGEMM on CUDA. So the two methods are stand-ins with the real signatures (asserted against
SGLang's) that keep the real structure: the query and weights come from the prepare step, the
logits are SGLang's own torch path over the pool's index-K buffer, the top-k SGLang's
``topk_transform_pytorch_vectorized`` written in place into ``core_metadata.c4_sparse_page_indices``,
and the method returns None. The call's data are SGLang-made (tests/indexer_kit.py, ratio 4)."""

from __future__ import annotations

import importlib
import inspect
from types import SimpleNamespace

import pytest
import torch

import indexer_kit as kit
from refmla.hook.config import HookConfig

MODULE = "sglang.srt.layers.attention.dsv4.indexer"
SEQ, K = [401, 2050, 3001], 128
CALL: dict = {}


def _forward_prepare_normal(self, x, q_lora, c4_indexer, positions, forward_batch, skip_compressor=False, q_lora_quant=None):
    """Stands for the prepare step: the call's fp8 query and its weights [rows, H, 1], as SGLang returns them."""
    return CALL["q"], CALL["weights"][:, :, None]


def forward_c4_indexer(self, x, q_lora, c4_indexer, forward_batch, alt_streams=None, enable_multi_stream=False,
                       q_lora_ready=None, skip_compressor=False, q_lora_quant=None):  # fmt: skip
    """Stands for forward_c4_indexer: prepare, SGLang's torch logits, its top-k written in place."""
    _, ind = kit.sglang()
    q, w = self._forward_prepare_normal(x=x, q_lora=q_lora, c4_indexer=c4_indexer, positions=None, forward_batch=forward_batch)
    im, cm = self.forward_metadata.indexer_metadata, self.forward_metadata.core_metadata
    kv = self.token_to_kv_pool.get_index_k_with_scale_buffer(layer_id=c4_indexer.layer_id)
    kv = kv.view(kv.shape[0], 64, 1, 132)
    logits = ind.fp8_paged_mqa_logits_torch(q.unsqueeze(1), kv, w.squeeze(2), im.compressed_seq_lens, im.page_table,
                                            None, im.page_table.shape[1] * 64, clean_logits=False)  # fmt: skip
    ind.topk_transform_pytorch_vectorized(logits, im.compressed_seq_lens, im.page_table, cm.c4_sparse_page_indices,
                                          im.compressed_page_size)  # fmt: skip
    if CALL.get("stale") is not None:  # production's fault, planted by the test: the previous step's indices
        cm.c4_sparse_page_indices.copy_(CALL["stale"])


@pytest.fixture
def mixin(monkeypatch):
    from sglang_kit import prepare

    from refmla.hook import patching

    prepare()
    cls = importlib.import_module(MODULE).C4IndexerBackendMixin
    for real, mine in ((cls.forward_c4_indexer, forward_c4_indexer), (cls._forward_prepare_normal, _forward_prepare_normal)):
        assert list(inspect.signature(real).parameters) == list(inspect.signature(mine).parameters), real.__name__
    monkeypatch.setattr(cls, "forward_c4_indexer", forward_c4_indexer)
    monkeypatch.setattr(cls, "_forward_prepare_normal", _forward_prepare_normal)
    yield cls
    patching.uninstall()


def backend(cls, seed=0, fp4=False):
    """(backend, keyword arguments) of one decode call: SGLang's data, a pool with spare pages."""
    t, _ = kit.call(SEQ, ratio=4, topk=K, seed=seed)
    CALL.update(q=t["q"], weights=t["weights"], stale=None)
    spare = torch.randint(0, 255, (3, t["k_cache"].shape[1]), dtype=torch.uint8)  # other layers' pages
    pool = torch.cat([t["k_cache"], spare])
    B = len(SEQ)
    im = SimpleNamespace(page_table=t["page_table"].clamp(min=0), compressed_seq_lens=(t["seq_lens"] // 4).int(),
                         compressed_page_size=64, compress_ratio=4, rows_per_request=1)  # fmt: skip
    cm = SimpleNamespace(c4_sparse_page_indices=torch.full((B, K), -7, dtype=torch.int32))
    b = object.__new__(type("Backend", (cls,), {}))
    b.token_to_kv_pool = SimpleNamespace(get_index_k_with_scale_buffer=lambda layer_id: pool)
    b.forward_metadata = SimpleNamespace(indexer_metadata=im, core_metadata=cm)
    b.debug_use_external_c4_sparse_indices = False
    fb = SimpleNamespace(rids=["a", "b", "c"], forward_mode=SimpleNamespace(is_idle=lambda: False))
    c4 = SimpleNamespace(layer_id=7, use_fp4_indexer=fp4)
    return b, dict(x=None, q_lora=None, c4_indexer=c4, forward_batch=fb)


def install(tmp_path):
    from refmla.hook import patching

    return patching.install(HookConfig(out_dir=str(tmp_path), backends=frozenset({"dsv4"})))


def test_the_c4_indexer_call_is_captured_its_result_untouched_and_it_replays_agree(tmp_path, mixin):
    from refmla.indexer.io import read_indexer
    from refmla.options import ReplayOptions
    from refmla.pipeline import replay_file

    plain, kw = backend(mixin, seed=1)
    assert plain.forward_c4_indexer(**kw) is None
    want = plain.forward_metadata.core_metadata.c4_sparse_page_indices.clone()  # without the hook
    state = install(tmp_path)
    b, kw = backend(mixin, seed=1)
    assert b.forward_c4_indexer(**kw) is None
    assert torch.equal(b.forward_metadata.core_metadata.c4_sparse_page_indices, want)
    (path,) = sorted(tmp_path.glob("indexer-*.safetensors"))
    assert state.files_written == 1 and state.disabled is None and "-L007-" in path.name
    cap = read_indexer(path)
    assert cap.meta.compress_ratio == 4 and cap.meta.indices_kind == "slots" and cap.meta.rids == ["a", "b", "c"]
    assert torch.equal(cap.entries, torch.tensor(SEQ) // 4) and torch.equal(cap.indices, want)
    r = replay_file(str(path), ReplayOptions(backends=["sglang_indexer_torch"]))
    assert r.verdict == "agree" and r.backends["sglang_indexer_torch"].status == "pass", r.diagnosis_text


def test_stale_c4_indices_in_production_replay_as_the_indexer_named(tmp_path, mixin):
    from refmla.options import ReplayOptions
    from refmla.pipeline import replay_file

    prev, kw = backend(mixin, seed=3)
    prev.forward_c4_indexer(**kw)
    stale = prev.forward_metadata.core_metadata.c4_sparse_page_indices.clone()  # another step's query, same cache
    install(tmp_path)
    b, kw = backend(mixin, seed=3)
    CALL["q"] = CALL["q"].flip(0)  # this step's queries differ; production keeps the previous step's indices
    CALL["stale"] = stale
    b.forward_c4_indexer(**kw)
    (path,) = sorted(tmp_path.glob("indexer-*.safetensors"))
    r = replay_file(str(path), ReplayOptions(backends=[]))
    assert r.verdict == "diverged" and r.diagnosis == "indexer", r.diagnosis_text


def test_the_fp4_indexer_is_a_counted_skip(tmp_path, mixin):
    state = install(tmp_path)
    b, kw = backend(mixin, fp4=True)
    b.forward_c4_indexer(**kw)
    assert not list(tmp_path.glob("*.safetensors")) and state.disabled is None and sum(state.skipped.values()) == 1


def test_an_exception_in_the_capture_disables_the_hook_and_one_in_the_call_propagates_as_is(tmp_path, mixin, monkeypatch):
    from refmla.hook import c4_indexer_call

    state = install(tmp_path)
    monkeypatch.setattr(c4_indexer_call, "indexer_tensors", lambda *a: 1 / 0)
    b, kw = backend(mixin, seed=2)
    assert b.forward_c4_indexer(**kw) is None and "ZeroDivisionError" in (state.disabled or "")
    assert (b.forward_metadata.core_metadata.c4_sparse_page_indices != -7).any()  # the call did its work


def test_the_calls_own_exception_propagates_as_is_with_the_hook_armed(tmp_path, mixin):
    from refmla.hook import c4_indexer_call

    state = install(tmp_path)
    b, kw = backend(mixin, seed=2)
    CALL["q"] = "not a tensor"  # the server's own failure inside the call
    with pytest.raises(AttributeError):
        b.forward_c4_indexer(**kw)
    assert c4_indexer_call._PREPARED == {} and state.disabled is None and state.active  # nothing kept, hook on
    assert not list(tmp_path.glob("*.safetensors"))

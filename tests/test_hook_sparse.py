"""The hook's capture of DeepSeek-V4 sparse decode calls (refmla.hook.sparse_call).

What runs: SGLang 0.5.23's real ``deepseek_v4_backend_hip_radix`` module (imported on CPU), the
hook's patcher on its ``flash_mla_with_kvcache_entrypoint`` name, and SGLang's real Triton sparse
kernel behind it. What could not be driven here: ``DeepseekV4HipRadixBackend`` itself (HIP only:
its forward needs ROCm metadata kernels), and the real entrypoint, which on a non-HIP host imports
``flash_mla_interface`` (the ``flash_mla`` CUDA extension, absent). So the entrypoint is a stand-in
routing ``backend="triton"`` to ``triton_fp8_attention_fwd`` exactly as SGLang's HIP entrypoint does,
and the call's keyword arguments are built as ``_forward_attention`` builds them (the contract)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from refmla.hook.config import HookConfig
from refmla.sparse.backends import TRITON_ENTRY, kernel_kwargs
from refmla.sparse.format import SparseCapture, parse_sparse_meta
from refmla.sparse.validation import read_sparse
from refmla.sparse.presets import sparse_preset
from refmla.options import ReplayOptions
from refmla.pipeline import replay_file
from refmla.sparse.synth import build_case


@pytest.fixture
def dsv4_module(monkeypatch):
    import importlib

    from refmla.hook import patching

    mod = importlib.import_module(patching.DSV4_MODULE)
    triton = importlib.import_module(TRITON_ENTRY)

    def entrypoint(backend: str, **kwargs):  # SGLang's HIP entrypoint for backend "triton"
        assert backend == "triton"
        return triton.triton_fp8_attention_fwd(**kwargs)

    monkeypatch.setattr(mod, patching.DSV4_ENTRY, entrypoint)
    yield mod
    patching.uninstall()


class Layer:
    layer_id = 5


def forward_attention(mod, layer, kwargs):
    """Stands for DeepseekV4HipRadixBackend._forward_attention: calls the module-level name."""
    return mod.flash_mla_with_kvcache_entrypoint(**kwargs, backend="triton")[0]


def test_the_hook_captures_the_entrypoints_keyword_arguments_and_replays(tmp_path, dsv4_module):
    from refmla.backends.triton_interp import ensure_interpreter, install_bf16_dot_fix
    from refmla.hook import patching

    ensure_interpreter()
    install_bf16_dot_fix()
    state = patching.install(HookConfig(out_dir=str(tmp_path), backends=frozenset({"dsv4"})))
    assert getattr(dsv4_module.flash_mla_with_kvcache_entrypoint, "__wrapped__", None) is not None
    case = build_case(sparse_preset("deepseek-v4-flash-tp8"))
    cap = SparseCapture(path="mem", meta=parse_sparse_meta(case.meta()), **case.tensors())
    kw = kernel_kwargs(cap)
    from refmla.sparse.backends import one_config_each, TRITON_FUSED

    with one_config_each(TRITON_FUSED, True):
        served = forward_attention(dsv4_module, Layer(), kw)
    (path,) = sorted(tmp_path.glob("sparse-*.safetensors"))
    got = read_sparse(path)
    assert state.files_written == 1 and state.disabled is None
    assert got.meta.backend == "triton" and got.meta.layer_id == 5 and got.meta.kv_layout == "v4"
    assert got.meta.page_size == 256 and got.meta.extra_page_size == 64
    assert got.k_cache.shape[1] == 149760 and got.extra_k_cache.shape[1] == 37440  # padded page rows kept
    assert got.k_cache.shape[0] <= cap.k_cache.shape[0]  # only the pages the indices reference
    assert (got.out == served).all()
    r = replay_file(str(path), ReplayOptions(backends=["reference", "observed", "triton"]))
    assert r.verdict == "agree", [(n, e.status, e.reason) for n, e in r.backends.items()]


def test_an_exception_inside_the_capture_disables_the_hook_not_the_call(tmp_path, dsv4_module, monkeypatch):
    from refmla.hook import patching, sparse_call

    state = patching.install(HookConfig(out_dir=str(tmp_path), backends=frozenset({"dsv4"})))
    monkeypatch.setattr(sparse_call, "sparse_tensors", lambda kw, result, kvm=None: 1 / 0)
    case = build_case(sparse_preset("deepseek-v4-flash-tp8-swa"))
    cap = SparseCapture(path="mem", meta=parse_sparse_meta(case.meta()), **case.tensors())
    from refmla.sparse.backends import one_config_each, TRITON_FUSED

    with one_config_each(TRITON_FUSED, True):
        out = forward_attention(dsv4_module, Layer(), kernel_kwargs(cap))
    assert out.shape == (4, 1, 8, 512) and state.disabled and "ZeroDivisionError" in state.disabled
    assert not list(tmp_path.glob("*.safetensors"))


def forward_attention_of_layer(mod, layer, kwargs, compress_ratio, token_to_kv_pool):
    """Stands for _forward_attention with its ``compress_ratio`` argument and ``token_to_kv_pool``
    local (the names SGLang 0.5.23's method has), calling the module-level entrypoint."""
    return mod.flash_mla_with_kvcache_entrypoint(**kwargs, backend="triton")[0]


class RatioPool:
    """The one attribute of DeepSeekV4TokenToKVPool the ratio needs: the model's per-layer list."""

    def __init__(self, ratios):
        self.compression_ratios = ratios


@pytest.mark.parametrize("pool_ratio", [128, 4])
def test_the_hook_records_the_layers_compress_ratio_and_the_models_list(tmp_path, dsv4_module, pool_ratio):
    from refmla.backends.triton_interp import ensure_interpreter, install_bf16_dot_fix
    from refmla.hook import patching
    from refmla.sparse.backends import TRITON_FUSED, one_config_each
    from refmla.sparse.presets import V4_FLASH_COMPRESS_RATIOS

    ensure_interpreter()
    install_bf16_dot_fix()
    patching.install(HookConfig(out_dir=str(tmp_path), backends=frozenset({"dsv4"})))
    case = build_case(sparse_preset("deepseek-v4-flash-tp8-c128"))
    cap = SparseCapture(path="mem", meta=parse_sparse_meta(case.meta()), **case.tensors())
    ratios = list(V4_FLASH_COMPRESS_RATIOS)
    ratios[3] = pool_ratio  # 128: the pool agrees with the call at layer 3; 4: it does not

    class Layer3:
        layer_id = 3

    with one_config_each(TRITON_FUSED, True):
        forward_attention_of_layer(dsv4_module, Layer3(), kernel_kwargs(cap), 128, RatioPool(ratios))
    (path,) = sorted(tmp_path.glob("sparse-*.safetensors"))
    got = read_sparse(path)
    assert got.meta.compress_ratio == 128 and got.meta.layer_role == "compressed" and got.meta.layer_id == 3
    if pool_ratio == 128:
        assert got.meta.compress_ratios == ratios and "compress_ratios_mismatch" not in got.meta.extra
    else:
        assert got.meta.compress_ratios is None
        assert got.meta.extra["compress_ratios_mismatch"] == "pool compression_ratios[3] = 4, the call's 128"


# --------------------------------------------------------------------------------------------
# The KV map (issue 28): what diff-kv and disagg compare, read from SGLang's pool and forward batch
# --------------------------------------------------------------------------------------------


class Mode:
    def __init__(self, decode: bool):
        self.decode = decode

    def is_decode(self):
        return self.decode

    def is_extend(self):
        return not self.decode


def sglang_state(cap, rows_of_req):
    """The forward batch and DeepSeekV4TokenToKVPool attributes the KV map reads, built so that they
    give the synthetic capture's own map: full page k of request b is the compressed cache's page k
    (SGLang's compressed slot = full loc // ratio), and full_to_swa sends each full loc of the window to
    the window cache's token."""
    from types import SimpleNamespace

    P, ratio, cpp = cap.meta.page_size, cap.meta.compress_ratio, cap.meta.extra_page_size
    B, M = cap.q.shape[0], int(cap.seq_lens.max())
    r2t = torch.zeros(max(rows_of_req) + 1, M, dtype=torch.int64)
    spare = int(cap.extra_k_cache.shape[0])  # full page ids past every compressed page, for pages with no entry
    mapping = torch.zeros((spare + 4 * B + 8) * P, dtype=torch.int64)
    for b in range(B):
        L = int(cap.seq_lens[b])
        ent = cap.extra_slots[int(cap.extra_slot_indptr[b]) : int(cap.extra_slot_indptr[b + 1])].long()
        win = cap.slots[int(cap.slot_indptr[b]) : int(cap.slot_indptr[b + 1])].long()
        pages = []
        for k in range(-(-L // P)):
            pages.append(int(ent[k * cpp]) // cpp if k * cpp < ent.numel() else spare)
            spare += pages[-1] == spare
        j = torch.arange(L)
        full = torch.tensor(pages)[j // P] * P + j % P
        r2t[rows_of_req[b], :L] = full
        held = win >= 0
        mapping[full[held]] = win[held]
        assert torch.equal(full[::ratio][: L // ratio] // ratio, ent)  # the construction is SGLang's rule
    from refmla.sparse.presets import V4_FLASH_COMPRESS_RATIOS

    pool = SimpleNamespace(full_to_swa_index_mapping=mapping, sliding_window=128, request_window=None,
                           compression_ratios=list(V4_FLASH_COMPRESS_RATIOS))  # fmt: skip
    fb = SimpleNamespace(req_to_token_pool=SimpleNamespace(req_to_token=r2t), batch_size=B, seq_lens=cap.seq_lens.clone(),
                         req_pool_indices=torch.tensor(rows_of_req), rids=list(cap.meta.rids))  # fmt: skip
    return fb, pool


def forward_attention_of_batch(mod, layer, kwargs, compress_ratio, token_to_kv_pool, forward_batch):
    """Stands for _forward_attention with the locals SGLang 0.5.23's method has."""
    return mod.flash_mla_with_kvcache_entrypoint(**kwargs, backend="triton")[0]


@pytest.fixture(scope="module")
def v4_pair(tmp_path_factory):
    from refmla.synthetic.disagg_sparse import sparse_disagg_preset, synth_sparse_disagg

    root = tmp_path_factory.mktemp("v4-pair")
    synth_sparse_disagg(root, sparse_disagg_preset("disagg-v4", layers=(2,)), "none")
    return root


@pytest.mark.parametrize("node", ["decode", "prefill"])
def test_the_hook_records_the_kv_map_diff_kv_reads(tmp_path, v4_pair, monkeypatch, node):
    """A decode call (one row per request), and on a prefill node an extend call of several rows per
    request (kept: each request's last row): the map the hook records names the same physical tokens as
    the synthetic capture's, and diff-kv against the synthetic prefill capture finds every position equal."""
    import importlib

    from refmla.diffkv import diff_kv_files
    from refmla.diffkv.views import physical
    from refmla.hook import patching, sparse_call

    mod = importlib.import_module(patching.DSV4_MODULE)
    src = read_sparse(next((v4_pair / "decode").glob("*-s0.safetensors")))
    B = src.q.shape[0]
    ext = [3, 1, 2, 1] if node == "prefill" else [1] * B  # query rows per request
    last = torch.cumsum(torch.tensor(ext), 0) - 1
    rows = torch.arange(B).repeat_interleave(torch.tensor(ext))
    kw = kernel_kwargs(src)
    for k in ("q", "indices", "topk_length", "extra_indices_in_kvcache", "extra_topk_length"):
        kw[k] = kw[k][rows].clone()
    kw["q"][~torch.isin(torch.arange(len(rows)), last)] = 0.5  # the other rows: other queries
    out, lse = src.out[rows].clone(), src.lse[rows].clone()
    monkeypatch.setattr(mod, patching.DSV4_ENTRY, lambda backend, **k: (out, lse))  # production's result
    monkeypatch.setattr(sparse_call, "disagg_meta", lambda: {"disagg_mode": node, "disagg_transfer_backend": "mori"})
    patching.install(HookConfig(out_dir=str(tmp_path), backends=frozenset({"dsv4"})))
    from refmla.hook.requests import record

    lens = src.seq_lens.tolist()  # what ForwardBatch.init_new saw of each request (refmla.hook.requests)
    prompts = [list(range(100 + b, 100 + b + L - 1)) for b, L in enumerate(lens)]
    record(SimpleNamespace(reqs=[SimpleNamespace(rid=rid, origin_input_ids=p, output_ids=[7], cached_tokens_device=0,
                                                 cached_tokens_host=32 if b == 2 else 0, cached_tokens_storage=0)
                                 for b, (rid, p) in enumerate(zip(src.meta.rids, prompts))]))  # fmt: skip
    try:
        fb, pool = sglang_state(src, [3, 0, 4, 1])
        fb.forward_mode = Mode(decode=node == "decode")
        fb.extend_seq_lens = torch.tensor(ext)

        class Layer2:
            layer_id = 2

        forward_attention_of_batch(mod, Layer2(), kw, 4, pool, fb)
    finally:
        patching.uninstall()
    (path,) = sorted(tmp_path.glob("sparse-*.safetensors"))
    got = read_sparse(path)
    assert got.q.shape[0] == B and torch.equal(got.q, src.q) and torch.equal(got.out, src.out)
    assert got.meta.rids == src.meta.rids and got.meta.disagg_mode == node
    assert torch.equal(got.seq_lens, src.seq_lens) and torch.equal(got.slot_indptr, src.slot_indptr)
    for pre, page in (("", got.meta.page_size), ("extra_", got.meta.extra_page_size)):
        mine = physical(getattr(got, pre + "slots").long(), getattr(got, pre + "k_cache_pages").long(), page)
        assert torch.equal(mine, getattr(src, pre + "slots").long())  # the synth's captured numbering is physical
    assert got.k_cache.shape[0] < src.k_cache.shape[0]  # compacted: only the pages the map and indices name
    assert got.kv_token_ids.tolist() == sum((p + [7] for p in prompts), [])  # each position's token, like slots
    o = got.kv_origin.tolist()
    at = int(got.slot_indptr[2])
    assert o[at : at + 32] == [2] * 32 and o.count(2) == 32 and o.count(0) == len(o) - 32  # request 2's host hit
    result = diff_kv_files([str(next((v4_pair / "prefill").glob("*.safetensors")))], str(path))
    assert result.ok and result.physical_slots and result.positions_compared == 1319

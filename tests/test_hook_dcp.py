"""The vLLM hook under decode context parallelism: each rank's forward_mqa (vLLM's real
TritonMLAImpl on the Triton interpreter, the way tests/test_vllm.py drives it) is captured with its
shard geometry, and the ranks' captures of one step replay as one call (refmla replay-cp)."""

from __future__ import annotations

import shutil
from types import SimpleNamespace

import pytest
import torch

import vllm_kit
from helpers import load_tool
from refmla.backends import triton_interp
from refmla.capture import read_capture
from refmla.cp.judge import replay_step

pd = load_tool("planting_dcp")
SPEC = pd.DcpSpec(world=2, interleave=4, block=16, seq_lens=(70, 9, 3), tp_heads=8)  # rank 1 holds none of the last


def _rank_call(step, r):
    """(impl, q, cache, md, layer) of rank r's decode call, laid out as vLLM's DCP path lays it:
    the rank's own cache and block table, the local lengths in decode.seq_lens (vLLM's
    get_dcp_local_seq_lens), the whole ones in dcp_tot_seq_lens, the gathered heads in q."""
    mod = vllm_kit.import_triton_mla()  # first: vLLM's Triton kernels on the interpreter
    from vllm.model_executor.layers.attention.mla_attention import MLACommonDecodeMetadata, MLACommonMetadata
    from vllm.v1.attention.backends.utils import get_dcp_local_seq_lens

    rk = step["ranks"][r]
    tot = torch.tensor(SPEC.seq_lens, dtype=torch.int32)
    local = get_dcp_local_seq_lens(tot, SPEC.world, r, SPEC.interleave)
    md = vllm_kit._metadata(MLACommonMetadata, MLACommonDecodeMetadata, rk["table"], local, 1)
    md.decode.dcp_tot_seq_lens = tot
    impl = object.__new__(mod.TritonMLAImpl)
    impl.kv_lora_rank, impl.scale, impl._sm_count = 512, pd.KIMI_SM_SCALE, 132
    impl.dcp_world_size, impl.dcp_rank = SPEC.world, r
    impl.num_heads, impl.kv_cache_dtype = SPEC.tp_heads, "auto"
    layer = SimpleNamespace(_k_scale=torch.tensor(1.0), _k_scale_float=1.0, _v_scale_float=1.0,
                            layer_name="model.layers.3.self_attn.attn")  # fmt: skip
    cache = rk["kv"].reshape(-1, SPEC.block, 576)
    return impl, step["q"], cache, md, layer


@pytest.fixture
def interleave_config(monkeypatch):
    """vLLM's current config as the engine publishes it during a forward: its parallel config's
    cp_kv_cache_interleave_size (where the hook reads the interleave)."""
    vllm_kit.import_triton_mla()
    import vllm.config

    cfg = SimpleNamespace(parallel_config=SimpleNamespace(cp_kv_cache_interleave_size=SPEC.interleave))
    monkeypatch.setattr(vllm.config, "get_current_vllm_config_or_none", lambda: cfg)


def test_each_rank_is_captured_and_the_step_replays_as_one_call(tmp_path, interleave_config):
    from refmla.hook import vllm_patch
    from refmla.hook.config import HookConfig

    triton_interp.install_bf16_dot_fix()
    step = pd.make_step(SPEC)
    outs = {}
    for r in range(SPEC.world):
        impl, q, cache, md, layer = _rank_call(step, r)
        plain, _ = impl.forward_mqa(q, cache, md, layer)
        vllm_patch.install(HookConfig(out_dir=str(tmp_path / f"rank{r}"), min_seq_len=1))
        try:
            outs[r], _ = impl.forward_mqa(q, cache, md, layer)
            state = vllm_patch.current_state().summary()
        finally:
            vllm_patch.uninstall()
        assert torch.equal(plain.nan_to_num(), outs[r].nan_to_num())  # the server's output, untouched
        assert state["disabled"] is None and state["files_written"] == 1, state
    folder = tmp_path / "step"
    folder.mkdir()
    for r in range(SPEC.world):
        (f,) = (tmp_path / f"rank{r}").glob("*.safetensors")
        assert f"dcp{r}of{SPEC.world}" in f.name
        shutil.copy(f, folder / f.name)
        cap = read_capture(folder / f.name)
        m = cap.meta
        assert (m.dcp_world_size, m.dcp_rank, m.dcp_interleave_size) == (SPEC.world, r, SPEC.interleave)
        assert m.dcp_tot_seq_lens == list(SPEC.seq_lens) and m.extra["lse_base"] == "ln"  # TRITON_MLA: natural
        assert cap.seq_lens.tolist() == step["ranks"][r]["seq"]
        assert torch.equal(cap.out.nan_to_num(), outs[r].nan_to_num())
    assert torch.isnan(outs[1][2]).all()  # vLLM's kernel: 0 / 0 over an empty shard (the combine masks it)
    report = replay_step(folder)
    assert report.verdict == "agree", report.text()
    assert [e.status for e in report.ranks] == ["pass", "pass"]
    assert report.combine.status == "unjudged"  # forward_mqa's lse is bf16 and the combine is not captured


def test_a_rank_short_of_its_shard_is_named(tmp_path, interleave_config):
    """Rank 0's kernel handed one row fewer for request 0 (its metadata masked at a wrong local
    length): the capture keeps the shard's pages, and the step names rank 0 and the position."""
    from refmla.hook import vllm_patch
    from refmla.hook.config import HookConfig

    triton_interp.install_bf16_dot_fix()
    step = pd.make_step(SPEC)
    folder = tmp_path / "step"
    for r in range(SPEC.world):
        impl, q, cache, md, layer = _rank_call(step, r)
        if r == 0:
            md.decode.seq_lens = md.decode.seq_lens.clone()
            md.decode.seq_lens[0] -= 1
        vllm_patch.install(HookConfig(out_dir=str(folder), min_seq_len=1))
        try:
            impl.forward_mqa(q, cache, md, layer)
        finally:
            vllm_patch.uninstall()
    report = replay_step(folder)
    last = step["ranks"][0]["positions"][0][-1]
    assert [(f.hypothesis, f.rank, f.request, f.positions) for f in report.findings] == [
        ("cp_local_length", 0, 0, [[last, last + 1]])]
    assert report.verdict == "diverged"


def test_a_dcp_call_without_its_geometry_is_skipped_never_raised(tmp_path, monkeypatch):
    """No interleave size anywhere the engine keeps it: the call is skipped with the reason, the
    server's output unchanged."""
    vllm_kit.import_triton_mla()
    import vllm.config
    from refmla.hook import vllm_patch
    from refmla.hook.config import HookConfig

    monkeypatch.setattr(vllm.config, "get_current_vllm_config_or_none", lambda: None)
    triton_interp.install_bf16_dot_fix()
    step = pd.make_step(SPEC)
    impl, q, cache, md, layer = _rank_call(step, 1)
    plain, _ = impl.forward_mqa(q, cache, md, layer)
    vllm_patch.install(HookConfig(out_dir=str(tmp_path), min_seq_len=1))
    try:
        hooked, _ = impl.forward_mqa(q, cache, md, layer)
        state = vllm_patch.current_state().summary()
    finally:
        vllm_patch.uninstall()
    assert torch.equal(plain.nan_to_num(), hooked.nan_to_num())
    assert state["files_written"] == 0 and state["disabled"] is None
    assert any("interleave" in str(k) for k in state.get("skipped", {})), state

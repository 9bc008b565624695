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


def _correct_attn_out(out, lses, cp_rank, ctx=None, is_lse_base_on_e=True):
    """vLLM's correct_attn_out with its Triton kernel (CorrectAttnCPOutKernel, a JIT wrapper the
    interpreter cannot run) written out in torch, step by step as the kernel does it: the total lse
    in fp32 (NaN / +inf as -inf, an all -inf max as 0), this rank's factor, 0 where the factor is 0,
    stored back in out's dtype."""
    exp, log = (torch.exp, torch.log) if is_lse_base_on_e else (torch.exp2, torch.log2)
    lse = lses.float()
    lse = torch.where(torch.isnan(lse) | (lse == float("inf")), float("-inf"), lse)
    top = lse.amax(0)
    top = torch.where(top == float("-inf"), 0.0, top)
    total = log(exp(lse - top).sum(0)) + top
    fin = lse[cp_rank] - total
    fin = torch.where(torch.isnan(fin) | (fin == float("inf")), float("-inf"), fin)
    factor = exp(fin)[..., None]
    new = torch.where(factor == 0.0, 0.0, out.float() * factor)
    out.copy_(new.to(out.dtype))
    return out, total


class _DcpGroup:
    """A DCP group of W ranks in one process for vLLM's cp_lse_ag_out_rs: all_gather hands back
    every rank's (masked) lse, reduce_scatter sums every rank's corrected partial in the output
    dtype, rank by rank, and keeps this rank's heads. The other ranks' partials are their own
    forward_mqa outputs, corrected by the same steps."""

    def __init__(self, rank, parts, locals_, base_e=True):
        from vllm.v1.attention.ops.dcp import mask_dcp_empty_shards_

        self.world_size, self.rank_in_group, self.parts, self.base_e = len(parts), rank, parts, base_e
        self.masked = []
        for r, (_, lse) in enumerate(parts):
            lse = lse.clone().contiguous()
            mask_dcp_empty_shards_(lse, locals_[r], torch.arange(lse.shape[0] + 1, dtype=torch.int32))
            self.masked.append(lse)

    def all_gather(self, t, dim=0):
        return torch.cat([t if r == self.rank_in_group else self.masked[r] for r in range(self.world_size)], dim)

    def reduce_scatter(self, t, dim=1):
        lses = torch.stack(self.masked)
        acc = None
        for r, (out, _) in enumerate(self.parts):
            term = t if r == self.rank_in_group else _correct_attn_out(out.clone(), lses, r, None, self.base_e)[0]
            acc = term.clone() if acc is None else (acc.float() + term.float()).to(t.dtype)
        H = t.shape[dim] // self.world_size
        return acc.narrow(dim, H * self.rank_in_group, H).contiguous()


@pytest.mark.parametrize("plant", ["clean", "wrong_base"])
def test_the_combine_is_recorded_and_judged_as_a_merge(tmp_path, interleave_config, monkeypatch, plant):
    """Each rank's forward_mqa (vLLM's TritonMLAImpl) and then its layer's DCP combine, vLLM's own
    cp_lse_ag_out_rs bound as MLADCPManager binds it (functools.partial with the group and the lse
    base): the hook writes the rank's capture once the combine ran, with the combine's inputs and
    its output; the step's combine agrees when clean, and a combine that reads the natural lse
    with exp2 (vLLM #43919's base mix-up) is named on every rank."""
    import functools

    from refmla.hook import vllm_patch
    from refmla.hook.config import HookConfig
    from vllm.v1.attention.ops import dcp as vdcp

    monkeypatch.setattr(vdcp, "correct_attn_out", _correct_attn_out)
    triton_interp.install_bf16_dot_fix()
    step = pd.make_step(SPEC)
    calls = [_rank_call(step, r) for r in range(SPEC.world)]
    parts = [c[0].forward_mqa(*c[1:]) for c in calls]  # each rank's (out, lse) as the server computes it
    locals_ = [c[3].decode.seq_lens for c in calls]
    served = {}
    folder = tmp_path / "step"
    for r, (impl, q, cache, md, layer) in enumerate(calls):
        group = _DcpGroup(r, parts, locals_, base_e=plant == "clean")
        layer.dcp_manager = SimpleNamespace(
            combine=functools.partial(vdcp.cp_lse_ag_out_rs, cp_group=group, is_lse_base_on_e=plant == "clean"))
        plain = layer.dcp_manager.combine(parts[r][0].clone(), parts[r][1].clone(), seq_lens=locals_[r],
                                          query_start_loc=torch.arange(q.shape[0] + 1, dtype=torch.int32))  # fmt: skip
        vllm_patch.install(HookConfig(out_dir=str(folder), min_seq_len=1))
        try:
            out, lse = impl.forward_mqa(q, cache, md, layer)  # what vLLM's MLA layer does: forward_mqa, then the combine
            assert not list(folder.glob(f"*dcp{r}of*")) if folder.exists() else True  # held until the combine
            served[r] = layer.dcp_manager.combine(out, lse, seq_lens=locals_[r],
                                                  query_start_loc=torch.arange(q.shape[0] + 1, dtype=torch.int32))  # fmt: skip
            state = vllm_patch.current_state().summary()
        finally:
            vllm_patch.uninstall()
        assert torch.equal(plain, served[r])  # the server's combined output, untouched
        assert state["disabled"] is None and state["files_written"] == 1, state
        assert not hasattr(layer.dcp_manager.combine, "__wrapped__")  # restored on uninstall
    caps = {read_capture(f).meta.dcp_rank: read_capture(f) for f in folder.glob("*.safetensors")}
    for r, cap in caps.items():
        assert cap.meta.extra["dcp_combine"] == "cp_lse_ag_out_rs"
        assert torch.equal(cap.dcp_out, served[r]) and cap.dcp_in_lse.dtype == parts[r][1].dtype
        assert torch.equal(cap.dcp_in_out.nan_to_num(), parts[r][0].nan_to_num())
    report = replay_step(folder)
    assert [e.status for e in report.ranks] == ["pass", "pass"], report.text()
    if plant == "clean":
        assert report.verdict == "agree" and report.combine.status == "pass", report.text()
        assert "whole-context reference: pass" in report.combine.note
    else:
        assert report.combine.status == "fail"
        assert {(f.hypothesis, f.rank) for f in report.findings} == {("cp_combine_lse_base", r) for r in range(SPEC.world)}, report.text()

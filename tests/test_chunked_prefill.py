"""The chunked-prefix prefill captured whole (meta mode chunked_prefill, issue 32): SGLang's real
``forward_normal_chunked_kv_core`` / ``_chunked_prefix_attn_mha`` on its real pools, batch, chunk
plan (``prepare_chunked_prefix_cache_info``, the Triton kv-indices kernel) and real ``merge_state``
(Triton, interpreted) with the hook on; the attention backend is this file's stand-in, written from
SGLang's ``forward(q, k, v, layer, forward_batch, save_kv_cache)`` signature, computing attention
by its own loop (the CPU cannot run the GPU MHA backends). Faults are this file's wrappers: a chunk
missing its last keys, an empty chunk's lse 0. Also the synth presets, bad input and inspect."""

from __future__ import annotations

import json
import math

import pytest
import torch

from refmla.cli import main as refmla_main
from refmla.hook.config import HookConfig
from refmla.options import ReplayOptions
from refmla.pipeline import replay_file

H, NOPE, ROPE, DV, RANK = 4, 32, 64, 32, 512
PREFIX, EXTEND, CAPACITY = (70, 37), (5, 3), 48  # chunks of 24: request 1's last chunk is empty


class StandinBackend:
    """SGLang's attention backend interface for the MHA prefill, by this file's own loop: the new
    tokens causal over their own keys, chunk ``prefix_chunk_idx`` over its keys
    (``prefix_chunk_cu_seq_lens``), (out, lse) when ``mha_return_lse``. ``drop`` = (chunk,
    request, n): that request's chunk attended without its last n keys; ``empty_lse``: a value
    returned as the lse of a row with no keys (-inf when correct)."""

    def __init__(self, real, drop=None, empty_lse=-math.inf):
        self.token_to_kv_pool, self.req_to_token_pool = real.token_to_kv_pool, real.req_to_token_pool
        self.kv_index_translator = real.kv_index_translator
        self.drop, self.empty_lse = drop, empty_lse

    def forward(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        fb, T = forward_batch, q.shape[0]
        q, k, v = q.view(T, H, -1), k.view(k.shape[0], H, -1), v.view(v.shape[0], H, -1)
        out, lse = torch.zeros(T, H, DV), torch.full((T, H), self.empty_lse)
        qo = [0, *torch.cumsum(torch.tensor(fb.extend_seq_lens_cpu), 0).tolist()]
        chunk = fb.prefix_chunk_idx if fb.attn_attend_prefix_cache else None
        for b in range(len(qo) - 1):
            rows = range(qo[b], qo[b + 1])
            if chunk is None:
                keys = [range(qo[b], qo[b] + j + 1) for j in range(len(rows))]  # causal over its own new keys
            else:
                cu = fb.prefix_chunk_cu_seq_lens[chunk]
                a, e = int(cu[b]), int(cu[b + 1])
                if self.drop is not None and self.drop[:2] == (chunk, b):
                    e -= self.drop[2]
                keys = [range(a, e)] * len(rows)
            for r, ks in zip(rows, keys):
                for h in range(H):
                    if len(ks):
                        s = torch.stack([q[r, h].float() @ k[n, h].float() for n in ks]) * layer.scaling
                        w = torch.exp(s - s.max())
                        out[r, h] = (w[:, None] * v[list(ks), h].float()).sum(0) / w.sum()
                        lse[r, h] = s.max() + torch.log(w.sum())
        out = out.to(q.dtype)
        return (out, lse) if fb.mha_return_lse else out


@pytest.fixture(scope="module")
def sglang():
    import sglang_kit as K

    try:
        fixture = K.build(K.Case(mode="extend", num_heads=H, prefix_lens=PREFIX, extend_lens=EXTEND))
        from sglang.srt.layers.radix_attention import RadixAttention
        from sglang.srt.models.deepseek_common.attention_forward_methods import forward_mha
    except (K.Unavailable, ImportError) as e:
        pytest.skip(str(e))

    class Layer(forward_mha.DeepseekMHAForwardMixin, torch.nn.Module):
        """The attributes of DeepseekV2AttentionMLA that the real MHA methods read."""

        def __init__(self):
            torch.nn.Module.__init__(self)
            self.num_local_heads, self.qk_nope_head_dim, self.qk_rope_head_dim = H, NOPE, ROPE
            self.qk_head_dim, self.v_head_dim, self.kv_lora_rank, self.layer_id = NOPE + ROPE, DV, RANK, 0
            g = torch.Generator().manual_seed(7)
            self.w = (torch.randn(RANK, H * (NOPE + DV), generator=g) / 24).bfloat16()
            self.kv_b_proj = lambda x: (x @ self.w, None)
            self.o_proj = lambda x: (x, None)
            self.attn_mha = RadixAttention(H, NOPE + ROPE, (NOPE + ROPE) ** -0.5, H, layer_id=0, v_head_dim=DV)

    return fixture, Layer()


def run(sglang, tmp_path, backend_kw=None, cfg_kw=None):
    """One real forward_normal_chunked_kv_core with the hook on: (its attention output, captures)."""
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

    from refmla.backends.triton_interp import install_bf16_dot_fix
    from refmla.hook import patching

    install_bf16_dot_fix()
    fixture, layer = sglang
    fb = fixture.forward_batch
    fb.num_prefix_chunks = fb.prefix_chunk_len = None  # the chunk plan made afresh by SGLang
    fb.get_max_chunk_capacity = lambda: CAPACITY
    g = torch.Generator().manual_seed(3)
    q, k = (torch.randn(sum(EXTEND), H, NOPE + ROPE, generator=g).bfloat16() for _ in range(2))
    v = torch.randn(sum(EXTEND), H, DV, generator=g).bfloat16()
    patching.install(HookConfig(out_dir=str(tmp_path), backends=frozenset({"merge"}), min_seq_len=0, **(cfg_kw or {})))
    try:
        with torch.no_grad(), forward_context(ForwardContext(attn_backend=StandinBackend(fixture.backend, **(backend_kw or {})))):
            out = layer.forward_normal_chunked_kv_core(q, k, v, fb)
        state = patching.current_state()
    finally:
        patching.uninstall()
    assert "forward" not in layer.attn_mha.__dict__  # the shadowed forward is gone
    return out, sorted(tmp_path.glob("*.safetensors")), state


def test_the_hook_records_sglangs_chunked_prefill_and_it_agrees(sglang, tmp_path):
    out, files, state = run(sglang, tmp_path)
    assert [f.name.split("-")[0] for f in files] == ["chunked_prefill"], files  # its merges are in it, not apart
    r = replay_file(files[0], ReplayOptions())
    assert r.verdict == "agree", r.diagnosis_text
    assert r.kind == "chunked_prefill" and r.shape.dims == {"chunks": 3}
    assert sorted(r.backends) == sorted(["reference", "observed", "new_tokens", "chunk_0", "chunk_1", "chunk_2",
                                         "merge_0", "merge_1", "merge_2"])  # fmt: skip
    from refmla.merge.io import read_chunked

    cap = read_chunked(files[0])
    fb = sglang[0].forward_batch
    assert cap.chunk_lens.tolist() == fb.prefix_chunk_seq_lens_cpu.tolist() == [[24, 24], [24, 13], [22, 0]]
    assert cap.chunk_starts.tolist() == fb.prefix_chunk_starts_cpu.tolist()
    assert torch.equal(cap.out.reshape(out.shape), out)  # the capture's merged output is what the layer went on with
    assert cap.meta.sm_scale == pytest.approx((NOPE + ROPE) ** -0.5) and cap.meta.merger == "sglang.merge_state"


def test_a_chunk_missing_its_last_keys_is_named_with_its_rows(sglang, tmp_path):
    _, files, _ = run(sglang, tmp_path, {"drop": (1, 0, 8)})
    r = replay_file(files[0], ReplayOptions())
    assert r.verdict == "diverged" and r.diagnosis == "chunked_piece", r.diagnosis_text
    e = r.backends["chunk_1"].explanation
    assert e.hypothesis == "chunk_keys_missing" and e.request == 0, e.to_json()
    assert e.detail == {"chunk": 1, "request": 0, "missing": 8, "end": "last", "keys": 24, "rows": [0, 4]}
    assert [n for n, b in r.backends.items() if b.status == "fail"] == ["observed", "chunk_1"]
    assert "chunk 1's attention" in r.diagnosis_text and "request 0 rows 0-4" in r.diagnosis_text


def test_an_empty_chunk_returned_with_lse_0_is_named_at_its_merge(sglang, tmp_path):
    _, files, _ = run(sglang, tmp_path, {"empty_lse": 0.0})
    r = replay_file(files[0], ReplayOptions())
    assert r.verdict == "diverged" and r.diagnosis == "merge", r.diagnosis_text
    e = r.backends["merge_2"].explanation
    assert e.hypothesis == "merge_empty_piece_lse" and e.detail["value"] == 0.0 and e.detail["rows"] == [5, 6, 7]
    assert r.backends["merge_2"].info["failed_requests"] == [1]
    assert r.backends["chunk_2"].status == "pass"  # the piece's output is right: its lse is the merge's to judge


def test_a_hook_error_disables_it_and_the_layer_runs_on(sglang, tmp_path, monkeypatch):
    from refmla.hook import chunked_call

    def broken(self, a, result):
        raise RuntimeError("planted")

    monkeypatch.setattr(chunked_call.Recorder, "attention", broken)
    out, files, state = run(sglang, tmp_path)
    clean, _, _ = run(sglang, tmp_path / "clean")
    assert files == [] and state.disabled and "planted" in state.disabled
    assert torch.equal(out, clean)


def test_the_layer_filter_leaves_the_call_and_its_merges_alone(sglang, tmp_path):
    _, files, state = run(sglang, tmp_path, cfg_kw={"layers": frozenset({3})})
    assert files == [] and state.disabled is None  # no capture of layer 0, nor of its merges apart


FAULTS = {
    "chunk_missing_block": ("chunked_piece", "chunk_1", "chunk_keys_missing", {"chunk": 1, "request": 0, "missing": 8}),
    "chunk_other_request": ("chunked_piece", "chunk_0", "chunk_other_keys", {"request": 1, "read_request": 0}),
    "empty_lse_zero": ("merge", "merge_2", "merge_empty_piece_lse", {"piece": "a", "value": 0.0}),
    "chunk_dropped": ("merge", "merge_1", "merge_piece_dropped", {"dropped": "a"}),
    "lse_base": ("chunked_piece", "new_tokens", "piece_lse_base", {"documented_base": "e", "returned_in": "2"}),
}


@pytest.mark.parametrize("fault", ["none", *FAULTS])
def test_synth_presets_are_named_link_by_link(tmp_path, fault):
    path = tmp_path / "c.safetensors"
    assert refmla_main(["synth", str(path), "--preset", "chunked-prefill", "--fault", fault]) == 0
    r = replay_file(path, ReplayOptions())
    if fault == "none":
        assert r.verdict == "agree", r.diagnosis_text
        return
    diagnosis, link, hypothesis, detail = FAULTS[fault]
    e = r.backends[link].explanation
    assert r.diagnosis == diagnosis and e is not None and e.hypothesis == hypothesis, r.diagnosis_text
    assert {k: e.detail[k] for k in detail} == detail


def test_log2_lse_merged_as_ln_on_the_log2_preset_is_the_merges(tmp_path):
    path = tmp_path / "c.safetensors"
    assert refmla_main(["synth", str(path), "--preset", "chunked-prefill-log2", "--fault", "lse_base"]) == 0
    r = replay_file(path, ReplayOptions())
    assert r.diagnosis == "merge" and r.backends["merge_0"].explanation.hypothesis == "merge_lse_base"
    assert all(r.backends[n].status == "pass" for n in ("new_tokens", "chunk_0", "chunk_1", "chunk_2"))


def _rewrite(path, out, **changes):
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(path), framework="pt") as f:
        t, md = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
    for k, v in changes.items():
        t.pop(k) if v is None else t.__setitem__(k, v)
    save_file({k: v.contiguous() for k, v in t.items()}, str(out), metadata=md)
    return out


@pytest.mark.parametrize("change, named", [
    ({"chunk_lse": torch.zeros(3, 8, 3)}, "tensor 'chunk_lse'"),
    ({"step_out": None}, "tensor 'step_out'"),
    ({"chunk_k": torch.zeros(50, 4, 48).bfloat16()}, "tensor 'chunk_k'"),
    ({"extend_lens": torch.tensor([5, 4], dtype=torch.int32)}, "tensor 'extend_lens'"),
])  # fmt: skip
def test_bad_input_exits_2_naming_the_file_and_tensor(tmp_path, capsys, change, named):
    good = tmp_path / "good.safetensors"
    refmla_main(["synth", str(good), "--preset", "chunked-prefill"])
    bad = _rewrite(good, tmp_path / "bad.safetensors", **change)
    capsys.readouterr()
    assert refmla_main(["replay", str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(bad) in err[0] and named in err[0], err


def test_bad_meta_exits_2_naming_the_key(tmp_path, capsys):
    from safetensors import safe_open
    from safetensors.torch import save_file

    good, bad = tmp_path / "good.safetensors", tmp_path / "bad.safetensors"
    refmla_main(["synth", str(good), "--preset", "chunked-prefill"])
    with safe_open(str(good), framework="pt") as f:
        t, md = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
    meta = json.loads(md["meta"])
    meta["sm_scale"] = -1.0
    save_file(t, str(bad), metadata={**md, "meta": json.dumps(meta)})
    capsys.readouterr()
    assert refmla_main(["replay", str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(bad) in err[0] and "meta key 'sm_scale'" in err[0], err


def test_chunks_that_do_not_tile_the_prefix_are_the_rows_diagnosis(tmp_path):
    good = tmp_path / "good.safetensors"
    refmla_main(["synth", str(good), "--preset", "chunked-prefill"])
    starts = torch.tensor([[0, 0], [17, 16], [32, 32]], dtype=torch.int32)  # request 0's chunk 1 moved by one
    r = replay_file(_rewrite(good, tmp_path / "gap.safetensors", chunk_starts=starts), ReplayOptions())
    assert r.verdict == "diverged" and r.diagnosis == "chunked_row", r.diagnosis_text
    gaps = [(f.request, f.numbers["start"], f.numbers["end"], f.numbers["what"]) for f in r.metadata.findings]
    assert gaps == [(0, 16, 17, "uncovered"), (0, 32, 33, "overlap")]


def test_inspect_describes_a_chunked_prefill_capture(tmp_path, capsys):
    path = tmp_path / "c.safetensors"
    refmla_main(["synth", str(path), "--preset", "chunked-prefill"])
    capsys.readouterr()
    assert refmla_main(["inspect", str(path), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    d = doc["description"]
    assert doc["kind"] == "chunked_prefill" and d["chunks"] == 3 and d["chunk_keys"] == [32, 23, 8]
    assert d["empty_chunks"] == {"2": [1]} and d["coverage_gaps"] == [] and d["extend_lens"] == [5, 3]

"""The merge captures (meta mode merge): merges made by this file's own plain loop (correct, log2
lse merged as ln, an empty chunk merged with lse 0 or NaN), vLLM's and SGLang's Triton merges
interpreted on the CPU as backends, the hook on SGLang's real merge_state and vLLM's
merge_attn_states, and bad input."""

from __future__ import annotations

import json
import math

import pytest
import torch

from refmla.cli import main as refmla_main
from refmla.hook.config import HookConfig
from refmla.options import ReplayOptions
from refmla.pipeline import replay_file

T, H, D = 5, 3, 32


def attention(q, k, v):
    """fp64 softmax attention of q [T, H, D] over k, v [n, D]: (out, natural lse)."""
    s = torch.einsum("thd,nd->thn", q.double(), k.double()) / math.sqrt(q.shape[-1])
    return torch.einsum("thn,nd->thd", s.softmax(-1), v.double()), torch.logsumexp(s, -1)


def pieces(seed: int = 0):
    """Two chunks of a chunked-prefix prefill; row 0 has no prefix keys (its first chunk is empty)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, H, D, generator=g)
    oa, la = attention(q, torch.randn(16, D, generator=g), torch.randn(16, D, generator=g))
    ob, lb = attention(q, torch.randn(16, D, generator=g), torch.randn(16, D, generator=g))
    oa[0], la[0] = 0.0, -math.inf
    return oa.bfloat16(), la, ob.bfloat16(), lb


def merged_by_loop(oa, la, ob, lb, exp, log):
    """The merge, one (row, head) at a time, with the given exp / log."""
    out, lse = torch.zeros(T, H, D, dtype=torch.float64), torch.zeros(T, H, dtype=torch.float64)
    for t in range(T):
        for h in range(H):
            a, b = float(la[t, h]), float(lb[t, h])
            if math.isnan(a) or math.isnan(b):
                out[t, h], lse[t, h] = math.nan, math.nan
                continue
            m = max(a, b)
            wa, wb = exp(a - m), exp(b - m)
            out[t, h] = (wa * oa[t, h].double() + wb * ob[t, h].double()) / (wa + wb)
            lse[t, h] = m + log(wa + wb)
    return out, lse


def write(path, oa, la, ob, lb, out, lse, base):
    from safetensors.torch import save_file

    t = {"out_a": oa, "lse_a": la.float(), "out_b": ob, "lse_b": lb.float(), "out": out.bfloat16(), "lse": lse.float()}
    meta = {"mode": "merge", "merger": "test.loop", "lse_base": base}
    save_file({k: v.contiguous() for k, v in t.items()}, str(path),
              metadata={"format": "refmla.capture/1", "meta": json.dumps(meta)})  # fmt: skip
    return path


@pytest.mark.parametrize("base", ["e", "2"])
def test_a_correct_merge_agrees_and_the_merge_kernels_replay_it(tmp_path, base):
    oa, la, ob, lb = pieces()
    if base == "2":
        la, lb = la / math.log(2), lb / math.log(2)
        out, lse = merged_by_loop(oa, la, ob, lb, lambda x: 2.0**x, math.log2)
    else:
        out, lse = merged_by_loop(oa, la, ob, lb, math.exp, math.log)
    r = replay_file(write(tmp_path / "m.safetensors", oa, la, ob, lb, out, lse, base), ReplayOptions())
    assert r.verdict == "agree", r.diagnosis_text
    assert r.backends["observed"].lse.status == "pass"
    for name in ("vllm_triton_merge", "sglang_triton_merge"):
        e = r.backends[name]
        if e.status == "skipped":
            pytest.skip(f"{name}: {e.reason}")
        assert e.status == "pass" and e.max_abs_err < 0.01


def test_log2_lse_merged_as_ln_is_named(tmp_path):
    oa, la, ob, lb = pieces(1)
    la2, lb2 = la / math.log(2), lb / math.log(2)  # the pieces' lse are log2 (FlashInfer's convention)
    out, lse = merged_by_loop(oa, la2, ob, lb2, math.exp, math.log)  # ... merged as if natural
    r = replay_file(write(tmp_path / "m.safetensors", oa, la2, ob, lb2, out, lse, "2"), ReplayOptions())
    e = r.backends["observed"].explanation
    assert r.verdict == "diverged" and r.diagnosis == "merge"
    assert e.hypothesis == "merge_lse_base" and e.detail == {"documented_base": "2", "merged_as": "e"}


@pytest.mark.parametrize("value", [0.0, math.nan])
def test_an_empty_chunk_merged_with_lse_0_or_nan_is_named(tmp_path, value):
    oa, la, ob, lb = pieces(2)
    la[0] = value  # the engine passed the empty chunk's lse as 0 (NaN) instead of -inf
    out, lse = merged_by_loop(oa, la, ob, lb, math.exp, math.log)
    r = replay_file(write(tmp_path / "m.safetensors", oa, la, ob, lb, out, lse, "e"), ReplayOptions())
    e = r.backends["observed"].explanation
    assert r.verdict == "diverged" and e.hypothesis == "merge_empty_piece_lse"
    assert e.detail["piece"] == "a" and e.detail["rows"] == [0]
    assert (e.detail["value"] == "nan") if value != value else e.detail["value"] == 0.0


def test_a_dropped_piece_is_named(tmp_path):
    oa, la, ob, lb = pieces(3)
    out, lse = oa.double(), la  # the second chunk never merged
    r = replay_file(write(tmp_path / "m.safetensors", oa, la, ob, lb, out, lse, "e"), ReplayOptions())
    assert r.backends["observed"].explanation.hypothesis == "merge_piece_dropped"


def test_an_lse_read_in_the_other_layout_is_named(tmp_path):
    oa, la, ob, lb = pieces(6)
    ma, mb = (x.reshape(-1).reshape(H, T).t() for x in (la, lb))  # the merger read [T, H] as [H, T]
    out, lse = merged_by_loop(oa, ma, ob, mb, math.exp, math.log)
    r = replay_file(write(tmp_path / "m.safetensors", oa, la, ob, lb, out, lse, "e"), ReplayOptions(backends=[]))
    e = r.backends["observed"].explanation
    assert r.verdict == "diverged" and e.hypothesis == "merge_lse_layout"
    assert e.detail == {"stored": "[T, H]", "read_as": "[H, T]"}


def test_each_piece_weighted_by_the_others_lse_is_named(tmp_path):
    oa, la, ob, lb = pieces(7)
    oa[0], la[0] = -0.5 * ob[0], lb[0] - 1.0  # no empty chunk: a swap must not look like an empty piece
    out, lse = merged_by_loop(oa, lb, ob, la, math.exp, math.log)  # the lse of a and b swapped
    r = replay_file(write(tmp_path / "m.safetensors", oa, la, ob, lb, out, lse, "e"), ReplayOptions(backends=[]))
    assert r.verdict == "diverged" and r.backends["observed"].explanation.hypothesis == "merge_lse_swapped"


@pytest.mark.parametrize("preset,fault,hypothesis", [
    ("merge-chunked-prefill", "lse_base", "merge_lse_base"),
    ("merge-cp-log2", "lse_base", "merge_lse_base"),
    ("merge-chunked-prefill", "empty_lse_zero", "merge_empty_piece_lse"),
    ("merge-cp-log2", "empty_lse_nan", "merge_empty_piece_lse"),
    ("merge-chunked-prefill", "piece_dropped", "merge_piece_dropped"),
    ("merge-cp-log2", "lse_layout", "merge_lse_layout"),
])  # fmt: skip
def test_each_merge_synth_fault_is_named_and_the_clean_preset_agrees(tmp_path, preset, fault, hypothesis):
    """The synth presets and faults (refmla.merge.synth, its own loop): `refmla synth --preset merge-*`."""
    clean, bad = tmp_path / "clean.safetensors", tmp_path / "bad.safetensors"
    assert refmla_main(["synth", str(clean), "--preset", preset]) == 0
    assert refmla_main(["synth", str(bad), "--preset", preset, "--fault", fault]) == 0
    assert replay_file(clean, ReplayOptions(backends=[])).verdict == "agree"
    r = replay_file(bad, ReplayOptions(backends=[]))
    assert r.verdict == "diverged" and r.diagnosis == "merge"
    assert r.backends["observed"].explanation.hypothesis == hypothesis


def test_bad_input_exits_2_naming_the_file_and_tensor(tmp_path, capsys):
    oa, la, ob, lb = pieces()
    path = write(tmp_path / "m.safetensors", oa, la[:, :2], ob, lb, oa.double(), la, "e")
    assert refmla_main(["replay", str(path)]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and "tensor 'lse_a'" in err


def test_the_hook_captures_sglangs_real_merge_state(tmp_path):
    from refmla.backends.triton_interp import ensure_interpreter, install_bf16_dot_fix
    from refmla.hook import patching

    ensure_interpreter()
    install_bf16_dot_fix()  # production's merge on this CPU: the interpreter, its bf16 rounding fixed
    try:
        from sglang.srt.layers.attention import merge_state as mod
    except Exception as e:
        pytest.skip(f"sglang merge_state not importable: {type(e).__name__}: {e}")
    patching.install(HookConfig(out_dir=str(tmp_path), backends=frozenset({"merge"}), min_seq_len=0))
    try:
        oa, la, ob, lb = pieces(4)
        mod.merge_state(oa, la.float(), ob, lb.float())
    finally:
        patching.uninstall()
    (f,) = sorted(tmp_path.glob("merge-*.safetensors"))
    r = replay_file(f, ReplayOptions(backends=["vllm_triton_merge"]))
    assert r.verdict == "agree", r.diagnosis_text
    assert r.meta.merger == "sglang.merge_state" and r.meta.lse_base == "e"


def test_the_hook_captures_vllms_merge_attn_states_with_its_lse_layout(tmp_path):
    from refmla.backends.vllm_compat import vllm_triton_on_cpu
    from refmla.hook import vllm_patch

    ok, why = vllm_triton_on_cpu()
    if not ok:
        pytest.skip(why)
    try:
        from vllm.v1.attention.ops import merge_attn_states as mod
    except Exception as e:
        pytest.skip(f"vllm merge_attn_states not importable: {type(e).__name__}: {e}")
    vllm_patch.install(HookConfig(out_dir=str(tmp_path), backends=frozenset({"merge"}), min_seq_len=0))
    try:
        oa, la, ob, lb = pieces(5)
        out, lse = torch.empty_like(oa), torch.empty(H, T)
        mod.merge_attn_states(out, oa, la.float().t().contiguous(), ob, lb.float().t().contiguous(), output_lse=lse)
    finally:
        vllm_patch.uninstall()
    (f,) = sorted(tmp_path.glob("merge-*.safetensors"))
    r = replay_file(f, ReplayOptions(backends=["sglang_triton_merge"]))
    assert r.verdict == "agree", r.diagnosis_text
    assert r.backends["observed"].lse.status == "pass"  # the [H, T] lse came back as [T, H]


def test_inspect_describes_a_merge_capture(tmp_path, capsys):
    oa, la, ob, lb = pieces()
    la[0] = 0.0  # the empty chunk recorded with a finite lse
    out, lse = merged_by_loop(oa, la, ob, lb, math.exp, math.log)
    path = write(tmp_path / "m.safetensors", oa, la, ob, lb, out, lse, "e")
    assert refmla_main(["inspect", str(path), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)["description"]
    assert d["empty_a"] == H and d["empty_with_finite_lse"] == H and d["lse_base"] == "e"

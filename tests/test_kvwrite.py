"""The KV writer captures (meta mode kv_write): SGLang's real MLATokenToKVPool with the hook on,
writers planted at test time with their own plain loops, bad input, and the synth faults.

What runs: SGLang 0.5.23's real ``MLATokenToKVPool`` on the CPU (bf16, and fp8 stored as uint8),
its ``set_mla_kv_buffer`` / ``set_kv_buffer`` wrapped by the hook. The writers that cannot run here
-- vLLM's ``concat_and_cache_mla`` (a CUDA op) and aiter's ``fused_qk_rope_cat_and_cache_mla``
(ROCm) -- are stand-ins with their real signatures, written below as plain loops, wrapped by the hook
under their real names."""

from __future__ import annotations

import json
import math
import sys
import types

import pytest
import torch

from refmla.cli import main as refmla_main
from refmla.hook.config import HookConfig
from refmla.options import ReplayOptions
from refmla.pipeline import replay_file

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import sglang_kit  # noqa: E402

def hook_cfg(tmp_path) -> HookConfig:
    return HookConfig(out_dir=str(tmp_path), backends=frozenset({"kvwrite"}), min_seq_len=0)


@pytest.fixture
def pool_of():
    import refmla.hook

    def make(dtype: str):
        try:
            return sglang_kit.mla_pool(dtype, size=48)
        except sglang_kit.Unavailable as e:
            pytest.skip(str(e))

    yield make
    refmla.hook.uninstall()


class Layer:
    layer_id = 0
    k_scale = k_scale_float = None


def _inputs(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 1, 512, generator=g).bfloat16(), torch.randn(n, 1, 64, generator=g).bfloat16()


def captures(tmp_path):
    return sorted(tmp_path.glob("kvwrite-*.safetensors"))


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_sglangs_real_pool_writer_captures_replay_agree(tmp_path, pool_of, dtype):
    import refmla.hook

    pool = pool_of(dtype)
    nope, rope = _inputs(6)
    refmla.hook.install(hook_cfg(tmp_path))
    pool.set_mla_kv_buffer(Layer(), torch.tensor([7, 3, 30, 12, 4, 40]), nope, rope)
    pool.set_kv_buffer(Layer(), torch.tensor([20, 21]), torch.cat([nope[:2], rope[:2]], -1), None)
    refmla.hook.uninstall()
    files = captures(tmp_path)
    assert len(files) == 2
    for f in files:
        r = replay_file(f, ReplayOptions())
        assert r.verdict == "agree", r.diagnosis_text
        assert r.backends["observed"].status == "pass" and r.meta.kv_dtype == dtype
    # the capture holds what the pool holds now
    from refmla.kvwrite.io import read_kv_write

    cap = read_kv_write(files[0])
    pos = cap.positions()
    stored = pool.kv_buffer[0].view(pool.dtype)[cap.slots.long(), 0]
    assert torch.equal(cap.rows_after[pos].view(torch.uint8), stored.view(torch.uint8))


def test_a_pool_writer_that_puts_one_row_in_the_neighbouring_slot_is_named(tmp_path, pool_of):
    import refmla.hook

    pool = pool_of("bfloat16")
    real = pool._scatter_mla_rows

    def shifted(dst, loc, nope, rope):  # planted: token 2's row lands one slot further
        loc = loc.clone()
        loc[2] += 1
        real(dst, loc, nope, rope)

    pool._scatter_mla_rows = shifted
    nope, rope = _inputs(4, seed=1)
    refmla.hook.install(hook_cfg(tmp_path))
    pool.set_mla_kv_buffer(Layer(), torch.tensor([9, 15, 22, 33]), nope, rope)
    refmla.hook.uninstall()
    (f,) = captures(tmp_path)
    r = replay_file(f, ReplayOptions())
    e = r.backends["observed"].explanation
    assert r.verdict == "diverged" and r.diagnosis == "kv_writer"
    assert e.hypothesis == "kv_row_to_other_slot"
    assert e.detail["tokens"] == [2] and e.detail["slots"] == [22] and e.detail["written_to"] == [23]


# --- vLLM's concat_and_cache_mla: a stand-in with its signature, its own loop --------------------


def vllm_concat_standin(drop_scale: bool = False):
    def concat_and_cache_mla(kv_c, k_pe, kv_cache, slot_mapping, kv_cache_dtype, scale, skip_scale=False):
        s = 1.0 if drop_scale else float(scale)
        block = kv_cache.shape[1]
        view = kv_cache.view(torch.float8_e4m3fn) if kv_cache_dtype.startswith("fp8") else kv_cache
        for t, slot in enumerate(slot_mapping.tolist()):
            if slot < 0:
                continue
            row = torch.cat([kv_c[t].float(), k_pe[t].float()])
            if kv_cache_dtype.startswith("fp8"):
                row = (row / s).clamp(-448.0, 448.0)
            view[slot // block, slot % block] = row.to(view.dtype)

    return concat_and_cache_mla


@pytest.fixture
def vllm_ops(monkeypatch):
    from refmla.hook import vllm_patch

    try:
        import vllm._custom_ops as ops
    except Exception as e:
        pytest.skip(f"vllm._custom_ops not importable: {type(e).__name__}: {e}")
    yield ops, monkeypatch
    vllm_patch.uninstall()


@pytest.mark.parametrize("drop_scale", [False, True])
def test_a_vllm_fp8_writer_without_its_scale_is_named_with_its_rows(tmp_path, vllm_ops, drop_scale):
    from refmla.hook import vllm_patch

    ops, monkeypatch = vllm_ops
    monkeypatch.setattr(ops, "concat_and_cache_mla", vllm_concat_standin(drop_scale))
    vllm_patch.install(hook_cfg(tmp_path))
    cache = torch.zeros(4, 16, 576, dtype=torch.uint8)
    g = torch.Generator().manual_seed(2)
    kv_c, k_pe = torch.randn(5, 512, generator=g).bfloat16(), torch.randn(5, 64, generator=g).bfloat16()
    slots = torch.tensor([17, 3, -1, 40, 18])  # -1: a padded token, not written
    ops.concat_and_cache_mla(kv_c, k_pe, cache, slots, "fp8", torch.tensor([0.25]))
    vllm_patch.uninstall()
    (f,) = captures(tmp_path)
    r = replay_file(f, ReplayOptions())
    if not drop_scale:
        assert r.verdict == "agree", r.diagnosis_text
        return
    e = r.backends["observed"].explanation
    assert r.diagnosis == "kv_writer" and e.hypothesis == "kv_scale_not_applied"
    assert e.detail["slots"] == [17, 3, 40, 18] and e.detail["scale"] == 0.25


# --- aiter's fused rope + quantize + cache write (SGLang on ROCm): a stand-in, its signature ---------

ROCM_MODULE = "sglang.srt.models.deepseek_common.attention_forward_methods.forward_mla_rocm"


def aiter_fused_standin(invert: bool = False):
    def fused_qk_rope_cat_and_cache_mla(q_nope, q_pe, k_nope, k_pe, kv_cache, slot_mapping, pos, cos, sin,
                                        k_scale, is_neox, q_out_dtype=None):  # fmt: skip
        half = k_pe.shape[-1] // 2
        c, s = cos[pos].float(), sin[pos].float()  # [T, half]
        x1, x2 = k_pe[:, :half].float(), k_pe[:, half:].float()
        k_roped = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1).to(k_pe.dtype)  # neox style
        scale = float(k_scale)
        for t, slot in enumerate(slot_mapping.tolist()):
            row = torch.cat([k_nope[t].float(), k_roped[t].float()])
            row = row * scale if invert else row / scale
            kv_cache[slot, 0] = row.clamp(-240.0, 240.0).to(kv_cache.dtype)
        return q_nope, q_pe, k_roped, None

    return fused_qk_rope_cat_and_cache_mla


@pytest.mark.parametrize("invert", [False, True])
def test_aiters_fused_rope_quantize_cache_write_by_contract(tmp_path, monkeypatch, invert):
    from refmla.hook import patching

    mod = types.ModuleType(ROCM_MODULE)
    mod.fused_qk_rope_cat_and_cache_mla = aiter_fused_standin(invert)
    monkeypatch.setitem(sys.modules, ROCM_MODULE, mod)
    patching.install(hook_cfg(tmp_path))
    try:
        g = torch.Generator().manual_seed(3)
        T = 4
        cache = torch.zeros(32, 1, 576, dtype=torch.float8_e4m3fnuz)
        ang = torch.rand(64, 32, generator=g) * math.pi
        mod.fused_qk_rope_cat_and_cache_mla(torch.randn(T, 2, 512).bfloat16(), torch.randn(T, 2, 64).bfloat16(),
                                            torch.randn(T, 512, generator=g).bfloat16(),
                                            torch.randn(T, 64, generator=g).bfloat16(), cache,
                                            torch.tensor([5, 11, 2, 20]), torch.tensor([0, 7, 9, 63]), ang.cos(),
                                            ang.sin(), torch.tensor(0.5), True)  # fmt: skip
    finally:
        patching.uninstall()
    (f,) = captures(tmp_path)
    r = replay_file(f, ReplayOptions())
    assert r.meta.kv_dtype == "float8_e4m3fnuz" and r.meta.writer == "aiter.fused_qk_rope_cat_and_cache_mla"
    if not invert:
        assert r.verdict == "agree", r.diagnosis_text
    else:
        assert r.backends["observed"].explanation.hypothesis == "kv_scale_inverted"


def test_the_hook_never_raises_into_the_writer(tmp_path, pool_of):
    from refmla.hook import patching

    pool = pool_of("bfloat16")

    state = patching.install(hook_cfg(tmp_path))
    nope, rope = _inputs(2)
    pool.kv_lora_rank = "not a number"  # what the capture reads is broken: the write still happens
    pool.set_mla_kv_buffer(Layer(), torch.tensor([3, 4]), nope, rope)
    assert state.disabled is not None and not captures(tmp_path)
    assert torch.equal(pool.kv_buffer[0][3, 0, :512], nope[0, 0])


def test_the_writer_capture_keeps_the_hooks_filters_and_budget(tmp_path, pool_of):
    import dataclasses

    import refmla.hook

    pool = pool_of("bfloat16")
    nope, rope = _inputs(3, seed=4)
    refmla.hook.install(dataclasses.replace(hook_cfg(tmp_path), layers=frozenset({1})))  # layer 0 is not wanted
    pool.set_mla_kv_buffer(Layer(), torch.tensor([3, 4]), nope[:2], rope[:2])
    refmla.hook.uninstall()
    assert captures(tmp_path) == [] and torch.equal(pool.kv_buffer[0][4, 0, :512], nope[1, 0])  # written all the same
    refmla.hook.install(dataclasses.replace(hook_cfg(tmp_path), max_files=1))  # REFMLA_CAPTURE_MAX_FILES=1
    for t, slot in enumerate((5, 6, 7)):
        pool.set_mla_kv_buffer(Layer(), torch.tensor([slot]), nope[t : t + 1], rope[t : t + 1])
    refmla.hook.uninstall()
    assert len(captures(tmp_path)) == 1 and torch.equal(pool.kv_buffer[0][7, 0, :512], nope[2, 0])


# --- bad input and the synth faults ---------------------------------------------------------------


def _raw_capture(path, tensors: dict, meta: dict) -> None:
    """A capture file written by plain safetensors (no refmla validation), to hand refmla bad input."""
    import json

    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path),
              metadata={"format": "refmla.capture/1", "meta": json.dumps(meta)})  # fmt: skip


def _good(n: int = 3) -> tuple[dict, dict]:
    slots = torch.tensor([4, 8, 12])[:n]
    keep = torch.unique(torch.cat([slots - 1, slots, slots + 1]))
    rows = torch.zeros(keep.shape[0], 8, dtype=torch.float8_e4m3fn)
    t = {"latent": torch.ones(n, 6).bfloat16(), "rope": torch.ones(n, 2).bfloat16(), "slots": slots,
         "pool_slots": keep, "rows_before": rows, "rows_after": rows.clone(), "scale": torch.tensor([0.5])}  # fmt: skip
    m = {"mode": "kv_write", "writer": "test", "kv_dtype": "float8_e4m3fn", "kv_lora_rank": 6, "qk_rope_head_dim": 2}
    return t, m


@pytest.mark.parametrize("breaks,key", [
    (lambda t, m: t.update(slots=torch.tensor([4, 8, 99])), "tensor 'slots'"),
    (lambda t, m: t.update(scale=torch.tensor([float("nan")])), "tensor 'scale'"),
    (lambda t, m: t.update(latent=torch.ones(3, 5).bfloat16()), "tensor 'latent'"),
    (lambda t, m: m.update(kv_dtype="int4"), "meta key 'kv_dtype'"),
    (lambda t, m: t.pop("rows_after"), "tensor 'rows_after'"),
])  # fmt: skip
def test_bad_input_exits_2_naming_the_file_and_key(tmp_path, capsys, breaks, key):
    t, m = _good()
    breaks(t, m)
    path = tmp_path / "bad.safetensors"
    _raw_capture(path, t, m)
    assert refmla_main(["replay", str(path)]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and key in err and "Traceback" not in err


@pytest.mark.parametrize("preset,fault,hypothesis", [
    ("kv-write-fp8", "scale_missing", "kv_scale_not_applied"),
    ("kv-write-fp8-fnuz", "scale_inverted", "kv_scale_inverted"),
    ("kv-write-bf16", "rope_offset", "kv_rope_offset"),
    ("kv-write-bf16", "neighbour_slot", "kv_row_to_other_slot"),
    ("kv-write-fp8", "neighbour_overwritten", "kv_neighbour_overwritten"),
])  # fmt: skip
def test_each_synth_fault_is_named_and_the_clean_preset_agrees(tmp_path, preset, fault, hypothesis):
    from refmla.kvwrite.synth import synth_kv_write

    clean, bad = tmp_path / "clean.safetensors", tmp_path / "bad.safetensors"
    synth_kv_write(clean, preset)
    planted = synth_kv_write(bad, preset, fault)
    assert replay_file(clean, ReplayOptions()).verdict == "agree"
    e = replay_file(bad, ReplayOptions()).backends["observed"].explanation
    assert e is not None and e.hypothesis == hypothesis
    named = e.detail.get("slots", []) + e.detail.get("next_to_written_slot", [])
    assert planted["slot"] in named


def test_a_scale_too_small_for_the_rope_part_is_saturation(tmp_path):
    from refmla.kvwrite.synth import synth_kv_write

    synth_kv_write(tmp_path / "s.safetensors", "kv-write-fp8", "saturated")
    r = replay_file(tmp_path / "s.safetensors", ReplayOptions())
    assert r.verdict == "diverged" and r.diagnosis == "kv_saturated" and r.exit_code == 1
    (f,) = [f for f in r.metadata.findings if f.check == "kv_saturated"]
    assert set(f.numbers["saturated"]) == {"rope"}


def test_inspect_describes_a_writer_capture_and_names_a_bad_one(tmp_path, capsys):
    from refmla.kvwrite.synth import synth_kv_write

    good = tmp_path / "w.safetensors"
    synth_kv_write(good, "kv-write-fp8")
    assert refmla_main(["inspect", str(good), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["kind"] == "kv_write" and doc["description"]["tokens_written"] == 8
    assert doc["description"]["scale"] == 0.0625 and doc["tensors"]["rows_after"]["dtype"] == "float8_e4m3fn"
    t, m = _good()
    t["slots"] = torch.tensor([4, 8, 99])
    bad = tmp_path / "bad.safetensors"
    _raw_capture(bad, t, m)
    assert refmla_main(["inspect", str(bad)]) == 2
    assert "tensor 'slots'" in capsys.readouterr().err


def test_a_writer_handed_one_tensor_as_rows_before_and_after_writes_a_capture(tmp_path):
    """safetensors refuses tensors that share memory; a writer that hands the same tensor as the rows
    before and after the call (it wrote nothing) still gets its capture, each tensor its own copy."""
    from refmla.kvwrite.io import read_kv_write, write_kv_write

    t, m = _good()
    t["rows_after"] = t["rows_before"]
    path = write_kv_write(tmp_path / "w.safetensors", t, m)
    cap = read_kv_write(path)
    assert torch.equal(cap.rows_before.float(), cap.rows_after.float())
    assert cap.rows_before.shape == t["rows_before"].shape

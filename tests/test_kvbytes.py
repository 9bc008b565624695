"""The bytes between a KV writer and its reader (refmla.kvwrite.encoding and the writer names):
fp8 encodings, torch's cast past the range, another scale, rows or rope parts left unwritten.

Test data: writers made by the test's own plain loop, vLLM's ``concat_and_cache_mla`` reference loop
(its kernel test: each token's cat(kv_c, k_pe) at ``cache[slot // block, slot % block]``, then
``convert_fp8``: x / scale saturated and cast), with torch's own fp8 casts for every encoding;
SGLang's real ``MLATokenToKVPool`` (its pool casts with ``x.to(fp8)``) and DeepSeek-V4's real
``fused_store_cache`` store (tests/dsv4_kit.py). Faults are planted by this file's loop, never
by refmla's reference."""

from __future__ import annotations

import dataclasses
import json
import sys

import pytest
import torch

from refmla.kvwrite.io import read_kv_write, write_kv_write
from refmla.options import ReplayOptions
from refmla.pipeline import replay_file

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import sglang_kit  # noqa: E402

FP8_MAX = {"float8_e4m3fn": 448.0, "float8_e4m3fnuz": 240.0, "float8_e5m2": 57344.0}


@dataclasses.dataclass
class WriterCase:
    """One writer call, as vLLM's concat_and_cache_mla test builds it."""

    written: str = "float8_e4m3fn"  # the fp8 the writer's cast stores
    read: str = "float8_e4m3fn"  # the pool's dtype as the reader (and the capture's meta) says
    scale: float = 0.0625  # the scale the writer is given
    scale_used: float = 0.0  # the scale it divides by (0: the one given)
    tokens: int = 6
    block: int = 16
    skip: tuple = ()  # tokens the writer leaves out
    rope_stale: bool = False  # write only the latent part
    magnitude: float = 1.0
    seed: int = 0


def vllm_loop(case: WriterCase, path) -> str:
    """vLLM's reference loop for concat_and_cache_mla, then its convert_fp8, into a cache of
    ``case.written``; captured as a kv_write file whose pool is read as ``case.read``."""
    g = torch.Generator().manual_seed(case.seed)
    kv_c = (torch.randn(case.tokens, 512, generator=g) * case.magnitude).bfloat16()
    k_pe = (torch.randn(case.tokens, 64, generator=g) * case.magnitude).bfloat16()
    slots = torch.randperm(4 * case.block - 2, generator=g)[: case.tokens] + 1
    cache = torch.randn(4, case.block, 576, generator=g).to(getattr(torch, case.written))  # old bytes
    before = cache.clone()
    s = case.scale_used or case.scale
    for i in range(case.tokens):
        if i in case.skip:
            continue
        slot = int(slots[i])
        b, o = slot // case.block, slot % case.block
        row = torch.cat([kv_c[i].float(), k_pe[i].float()]) / s
        row = row.clamp(-FP8_MAX[case.written], FP8_MAX[case.written]).to(cache.dtype)
        width = 512 if case.rope_stale else 576
        cache[b, o, :width] = row[:width]
    keep = torch.unique(torch.cat([slots - 1, slots, slots + 1])).long()
    flat = lambda c: c.reshape(-1, 576)[keep].view(torch.uint8).view(getattr(torch, case.read))  # noqa: E731
    meta = {"mode": "kv_write", "writer": "vllm.concat_and_cache_mla", "kv_dtype": case.read, "kv_lora_rank": 512,
            "qk_rope_head_dim": 64, "page_size": case.block}  # fmt: skip
    write_kv_write(path, {"latent": kv_c, "rope": k_pe, "slots": slots, "scale": torch.tensor([case.scale]),
                          "pool_slots": keep, "rows_before": flat(before), "rows_after": flat(cache)}, meta)  # fmt: skip
    return str(path)


ENCODINGS = list(FP8_MAX)


@pytest.mark.parametrize("read", ["float8_e4m3fn", "float8_e4m3fnuz"])
@pytest.mark.parametrize("scale", [1.0, 0.5, 0.0625, 3.7])
def test_clean_writers_agree_in_every_encoding_and_scale(tmp_path, read, scale):
    r = replay_file(vllm_loop(WriterCase(written=read, read=read, scale=scale), tmp_path / "w.safetensors"),
                    ReplayOptions())  # fmt: skip
    assert r.verdict == "agree", r.diagnosis_text


@pytest.mark.parametrize("written,read", [(w, r) for w in ENCODINGS for r in ENCODINGS[:2] if w != r])
def test_a_cache_written_in_another_encoding_is_named_with_both(tmp_path, written, read):
    r = replay_file(vllm_loop(WriterCase(written=written, read=read), tmp_path / "w.safetensors"), ReplayOptions())
    e = r.backends["observed"].explanation
    assert r.verdict == "diverged" and r.diagnosis == "kv_contract"
    assert e.hypothesis == "kv_fp8_encoding_mismatch" and e.detail["written"] == written and e.detail["read"] == read
    assert r.diagnosis_text.startswith("kv_fp8_encoding_mismatch") and written in r.diagnosis_text
    if {written, read} == {"float8_e4m3fn", "float8_e4m3fnuz"}:  # one byte, half (or twice) the value
        assert e.detail["read_over_written"] == (0.5 if read == "float8_e4m3fnuz" else 2.0)


@pytest.mark.parametrize("ratio", [2.0, 448.0 / 240.0, 0.37])
def test_a_scale_of_another_value_is_named_with_its_ratio(tmp_path, ratio):
    case = WriterCase(scale=0.0625, scale_used=float(torch.tensor(0.0625) * ratio))
    e = replay_file(vllm_loop(case, tmp_path / "w.safetensors"), ReplayOptions()).backends["observed"].explanation
    assert e.hypothesis == "kv_scale_other_value" and e.detail["ratio"] == pytest.approx(ratio, rel=1e-6)


def _high_half(x: float) -> float:
    """An fp32's high two bytes as a bf16 (its mantissa truncated), by this file's own arithmetic."""
    import struct

    return struct.unpack("<f", struct.pack("<I", struct.unpack("<I", struct.pack("<f", x))[0] & 0xFFFF0000))[0]


@pytest.mark.parametrize("read,value", [("ue8m0", 2.0**-6), ("bf16", _high_half(0.0131))])
def test_a_writer_that_read_its_fp32_scale_as_another_format_is_named(tmp_path, read, value):
    """The writer was given 0.0131 (fp32) and divided by its UE8M0 power of two rounded up (2^-6) or
    by the fp32's high half read as a bf16."""
    case = WriterCase(scale=0.0131, scale_used=value)
    e = replay_file(vllm_loop(case, tmp_path / "w.safetensors"), ReplayOptions()).backends["observed"].explanation
    assert e.hypothesis == "kv_scale_format" and e.detail["read"] == read and e.detail["stored"] == "fp32"
    assert e.detail["value_read"] == value
    assert replay_file(str(tmp_path / "w.safetensors"), ReplayOptions()).diagnosis == "kv_contract"


def test_tokens_left_unwritten_are_named_which(tmp_path):
    e = replay_file(vllm_loop(WriterCase(skip=(2, 4)), tmp_path / "w.safetensors"), ReplayOptions()).backends["observed"].explanation
    assert e.hypothesis == "kv_tokens_not_written" and e.detail["tokens"] == [2, 4] and not e.detail["every_token"]
    cap = read_kv_write(tmp_path / "w.safetensors")
    assert e.detail["slots"] == [int(cap.slots[2]), int(cap.slots[4])]


def test_a_call_that_wrote_nothing_here_is_named(tmp_path):
    e = replay_file(vllm_loop(WriterCase(skip=tuple(range(6))), tmp_path / "w.safetensors"),
                    ReplayOptions()).backends["observed"].explanation  # fmt: skip
    assert e.hypothesis == "kv_tokens_not_written" and e.detail["every_token"] and e.detail["tokens"] == list(range(6))


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "bfloat16"])
def test_a_rope_part_left_stale_is_named(tmp_path, dtype):
    case = WriterCase(written="float8_e4m3fn", read="float8_e4m3fn", rope_stale=True)
    path = vllm_loop(case, tmp_path / "w.safetensors")
    if dtype == "bfloat16":  # the same loop into a bf16 cache
        cap = read_kv_write(path)
        g = torch.Generator().manual_seed(5)
        before = torch.randn(cap.rows_before.shape, generator=g).bfloat16()
        after = before.clone()
        pos = cap.positions()
        after[pos, :512] = cap.latent.bfloat16()
        write_kv_write(path, {"latent": cap.latent, "rope": cap.rope, "slots": cap.slots, "pool_slots": cap.pool_slots,
                              "rows_before": before, "rows_after": after},
                       {**cap.meta.to_json(), "kv_dtype": "bfloat16"})  # fmt: skip
    e = replay_file(path, ReplayOptions()).backends["observed"].explanation
    assert e.hypothesis == "kv_rope_stale" and e.detail["tokens"] == list(range(6)) and e.detail["rope_columns"] == [512, 576]


# --- torch's own cast per fp8 dtype: SGLang's real pool (x.to(fp8)) --------------------------------


class Layer:
    layer_id = 0
    k_scale = k_scale_float = None


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e4m3fnuz"])
def test_sglangs_pool_cast_past_the_range_per_dtype(tmp_path, dtype):
    """Values past the range: torch's e4m3fn cast saturates (what the contract documents: agree but
    kv_saturated), its e4m3fnuz cast stores NaN from 248 up (kv_cast_overflow, not a writer mistake)."""
    import refmla.hook
    from refmla.hook.config import HookConfig

    try:
        pool = sglang_kit.mla_pool(dtype, size=48)
    except sglang_kit.Unavailable as e:
        pytest.skip(str(e))
    g = torch.Generator().manual_seed(0)
    nope, rope = (torch.randn(4, 1, 512, generator=g) * 150).bfloat16(), torch.randn(4, 1, 64, generator=g).bfloat16()
    refmla.hook.install(HookConfig(out_dir=str(tmp_path), backends=frozenset({"kvwrite"}), min_seq_len=0))
    try:
        pool.set_mla_kv_buffer(Layer(), torch.tensor([3, 9, 20, 30]), nope, rope)
    finally:
        refmla.hook.uninstall()
    (f,) = sorted(tmp_path.glob("kvwrite-*.safetensors"))
    r = replay_file(f, ReplayOptions())
    assert r.verdict == "diverged" and r.diagnosis == "kv_saturated"
    stored = pool.kv_buffer[0].view(getattr(torch, dtype))[[3, 9, 20, 30], 0].float()
    if dtype == "float8_e4m3fn":
        assert r.backends["observed"].status == "pass" and not bool(stored.isnan().any())
        return
    e = r.backends["observed"].explanation
    assert bool(stored.isnan().any()) and e.hypothesis == "kv_cast_overflow"
    assert e.detail["stored_nan"] == int(stored.isnan().sum()) and e.detail["smallest_overflowing"] > 240
    assert r.diagnosis_text.startswith("kv_cast_overflow") and "NaN by torch's cast" in r.metadata.warnings[-1]


# --- DeepSeek-V4 on MI300X: pages written e4m3fn, read e4m3fnuz -------------------------------------


def test_v4_pages_written_e4m3fn_read_e4m3fnuz_replay_as_the_encoding_mismatch(tmp_path):
    """SGLang's real V4 fused store quantizes with e4m3fn (448) here; the capture says the pool is read
    as e4m3fnuz (MI300X's): the tile exponents and the bytes are the e4m3fn writer's."""
    import dsv4_kit

    from refmla.hook import patching
    from refmla.hook.config import HookConfig

    try:
        pool = dsv4_kit.token_to_kv_pool([0, 4, 128])
        dsv4_kit.pack_quantizer()
    except dsv4_kit.Unavailable as e:
        pytest.skip(str(e))
    dsv4_kit.rocm_store()
    try:
        patching.install(HookConfig(out_dir=str(tmp_path), backends=frozenset({"kvwrite"}), min_seq_len=0))
        k = dsv4_kit.v4_latent(4)
        pool.set_swa_key_buffer_radix_fused(layer_id=1, swa_loc=torch.tensor([2, 5, 9, 511], dtype=torch.int32), cache_k=k)
    finally:
        patching.uninstall()
        dsv4_kit.rocm_store(False)
    (f,) = sorted(tmp_path.glob("kvwrite-*set_swa_key_buffer_radix_fused*.safetensors"))
    cap = read_kv_write(f)
    assert cap.meta.kv_dtype == "float8_e4m3fn" and replay_file(f, ReplayOptions()).verdict == "agree"
    t = {n: getattr(cap, n) for n in ("latent", "rope", "slots", "pool_slots", "rows_before", "rows_after")}
    mi300 = tmp_path / "read-fnuz.safetensors"
    write_kv_write(mi300, t, {**cap.meta.to_json(), "kv_dtype": "float8_e4m3fnuz"})
    r = replay_file(mi300, ReplayOptions())
    e = r.backends["observed"].explanation
    assert r.diagnosis == "kv_contract" and e.hypothesis == "kv_fp8_encoding_mismatch"
    assert (e.detail["written"], e.detail["read"]) == ("float8_e4m3fn", "float8_e4m3fnuz")
    assert "float8_e4m3fn bytes into a pool read as float8_e4m3fnuz" in r.diagnosis_text


# --- SGLang's reserved slot 0: padding -------------------------------------------------------------


def test_sglangs_reserved_slot_0_is_padding(tmp_path):
    """A CUDA-graph batch's padded tokens go to slot 0, which SGLang's real scatter
    (set_mla_kv_buffer_dcp_sharded_triton, reserved_skip_index 0) leaves as it was: padding, not
    compared, noted; the same rows from a writer of another engine are a token not written."""
    import refmla.hook
    from refmla.hook.config import HookConfig

    try:
        pool = sglang_kit.mla_pool("bfloat16", size=48)
    except sglang_kit.Unavailable as e:
        pytest.skip(str(e))
    g = torch.Generator().manual_seed(1)
    nope, rope = torch.randn(4, 1, 512, generator=g).bfloat16(), torch.randn(4, 1, 64, generator=g).bfloat16()
    refmla.hook.install(HookConfig(out_dir=str(tmp_path), backends=frozenset({"kvwrite"}), min_seq_len=0))
    try:
        pool.set_mla_kv_buffer(Layer(), torch.tensor([7, 3, 12, 0]), nope, rope)
    finally:
        refmla.hook.uninstall()
    (f,) = sorted(tmp_path.glob("kvwrite-*.safetensors"))
    r = replay_file(f, ReplayOptions())
    assert r.verdict == "agree", r.diagnosis_text
    (note,) = [x for x in r.metadata.findings if x.check == "padding_slot"]
    assert note.severity == "note" and note.numbers["tokens"] == [3]
    cap = read_kv_write(f)
    t = {n: getattr(cap, n) for n in ("latent", "rope", "slots", "pool_slots", "rows_before", "rows_after")}
    other = tmp_path / "other.safetensors"
    write_kv_write(other, t, {**cap.meta.to_json(), "writer": "test.writer", "engine": None})
    e = replay_file(other, ReplayOptions()).backends["observed"].explanation
    assert e.hypothesis == "kv_tokens_not_written" and e.detail["tokens"] == [3] and e.detail["slots"] == [0]


# --- a call written into another layer's buffer (refmla.chain.link_layers) -------------------------


def test_a_call_written_into_another_layers_buffer_is_named_with_the_layer(tmp_path, capsys):
    """Layer 1's call writes its rows into layer 2's buffer (the test's planted loop); layer 2's own
    call then captures those rows before overwriting them: replayed together, layer 1's capture
    names layer 2."""
    from refmla.batch import replay_many
    from refmla.chain import link_layers

    g = torch.Generator().manual_seed(4)
    pools = {layer: torch.randn(64, 576, generator=g).bfloat16() for layer in (1, 2)}
    slots = torch.tensor([5, 17, 40])
    keep = torch.unique(torch.cat([slots - 1, slots, slots + 1]))
    paths = []
    for layer, into in ((1, 2), (2, 2)):  # layer 1's writer indexes layer 2's buffer
        kv_c, k_pe = torch.randn(3, 512, generator=g).bfloat16(), torch.randn(3, 64, generator=g).bfloat16()
        before = pools[layer][keep].clone()
        for i, s in enumerate(slots.tolist()):
            pools[into][s] = torch.cat([kv_c[i], k_pe[i]])
        path = tmp_path / f"kvwrite-L{layer}.safetensors"
        write_kv_write(path, {"latent": kv_c, "rope": k_pe, "slots": slots, "pool_slots": keep, "rows_before": before,
                              "rows_after": pools[layer][keep].clone()},
                       {"mode": "kv_write", "writer": "vllm.concat_and_cache_mla", "kv_dtype": "bfloat16",
                        "kv_lora_rank": 512, "qk_rope_head_dim": 64, "layer_id": layer, "tp_rank": 0, "step": 3})  # fmt: skip
        paths.append(str(path))
    reports = replay_many(paths, ReplayOptions())
    assert reports[0].backends["observed"].explanation.hypothesis == "kv_tokens_not_written"
    assert reports[1].verdict == "agree"
    link_layers(reports)
    e = reports[0].backends["observed"].explanation
    assert e.hypothesis == "kv_written_to_other_layer" and e.detail["layer"] == 2 and e.detail["rows"] == "rows_before"
    assert e.other_causes[0].hypothesis == "kv_tokens_not_written"
    assert reports[0].diagnosis_text.startswith("kv_written_to_other_layer")
    from refmla.cli import main as refmla_main

    assert refmla_main(["replay", str(tmp_path), "--json"]) == 1  # the folder, as a user replays it
    doc = json.loads(capsys.readouterr().out)
    (first,) = [d for d in doc if d["capture"].endswith("kvwrite-L1.safetensors")]
    assert first["backends"]["observed"]["explanation"]["hypothesis"] == "kv_written_to_other_layer"

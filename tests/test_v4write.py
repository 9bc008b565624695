"""DeepSeek-V4's packed KV writers (kv_write captures with meta kv_layout v4): SGLang 0.5.23's real
DeepSeekV4TokenToKVPool with the hook on, writers planted at test time, the synth faults, bad input.

What runs: SGLang's real pool (tests/dsv4_kit.py: its DSV4 test kit's mock runner builds it on CPU
tensors) and its real writers: ``set_swa_key_buffer(_radix)`` / ``set_extra_key_buffer`` store a pack
through SetKAndS's Triton kernel (``_set_k_and_s_triton``), quantized by SGLang's own Triton pack
quantizer; ``set_swa_key_buffer_radix_fused`` / ``set_extra_key_buffer_fused`` quantize through
``fused_store_cache``, whose ROCm Triton kernel (``triton_fused_store_flashmla``) runs here -- the
CUDA JIT kernel cannot be built on a CPU -- chosen through SGLang's own ``is_hip_runtime`` switch.
All kernels run in the Triton interpreter. The faults are planted by wrapping SGLang's kernels here.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch

from refmla.cli import main as refmla_main
from refmla.hook.config import HookConfig
from refmla.kvwrite.io import read_kv_write, write_kv_write
from refmla.options import ReplayOptions
from refmla.pipeline import replay_file

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import dsv4_kit  # noqa: E402

PACK_STORE = "sglang.kernels.ops.kvcache.dsv4_main_kv_store"
FUSED_STORE = "sglang.kernels.ops.kvcache.triton_store_cache"


@pytest.fixture(scope="module")
def v4_pool():
    try:
        pool = dsv4_kit.token_to_kv_pool([0, 4, 128])
        dsv4_kit.pack_quantizer()
    except dsv4_kit.Unavailable as e:
        pytest.skip(str(e))
    return pool


@pytest.fixture
def pool(v4_pool):
    """The module's pool with every page zeroed, the ROCm store chosen, the hook off afterwards."""
    import refmla.hook

    for buf in [*v4_pool.swa_kv_pool.kv_buffer, *[b for p in v4_pool.kv_pools.values() if p for b in p.kv_buffer]]:
        buf.zero_()
    dsv4_kit.rocm_store()
    yield v4_pool
    dsv4_kit.rocm_store(False)
    refmla.hook.uninstall()


def install(tmp_path):
    """The hook for the KV writers; its HookState."""
    from refmla.hook import patching

    return patching.install(HookConfig(out_dir=str(tmp_path), backends=frozenset({"kvwrite"}), min_seq_len=0))


def captures(tmp_path) -> dict:
    """writer method -> its capture file."""
    return {f.name.split("-")[4]: f for f in sorted(tmp_path.glob("kvwrite-*.safetensors"))}


def test_sglangs_real_v4_writers_captures_replay_agree(tmp_path, pool):
    from refmla.sparse.layouts import LAYOUTS, token_bytes

    install(tmp_path)
    wrote = dsv4_kit.write_v4(pool)
    files = captures(tmp_path)
    # one capture per call: set_swa_key_buffer_radix delegates to set_swa_key_buffer (captured once)
    assert set(files) == {"set_swa_key_buffer", "set_extra_key_buffer", "set_swa_key_buffer_radix_fused",
                          "set_extra_key_buffer_fused"}  # fmt: skip
    where = {"set_swa_key_buffer": (pool.get_swa_raw_buffer(0), pool.get_swa_key_page_size(), "swa_pack", "pack"),
             "set_extra_key_buffer": (pool.layer_mapping[1][2].kv_buffer[0], 64, "c4_pack", "pack"),
             "set_swa_key_buffer_radix_fused": (pool.get_swa_raw_buffer(1), pool.swa_page_size, "swa_fused", "latent"),
             "set_extra_key_buffer_fused": (pool.layer_mapping[2][2].kv_buffer[0], 2, "c128_fused", "latent")}  # fmt: skip
    for method, f in files.items():
        r = replay_file(f, ReplayOptions())
        assert r.verdict == "agree", (method, r.diagnosis_text)
        cap = read_kv_write(f)
        buf, ps, key, given = where[method]
        assert cap.meta.kv_layout == "v4" and cap.meta.packed_input == given and cap.meta.page_size == ps
        assert cap.slots.tolist() == wrote["locs"][key].tolist()
        # the kept bytes are what refmla's sparse decoder reads from SGLang's pages at those slots
        tb = token_bytes(buf, LAYOUTS["v4"], ps)
        s = cap.slots.long()
        assert torch.equal(cap.rows_after[cap.positions()], torch.cat([tb.nope[s], tb.rope[s], tb.scales[s]], 1))
        if given == "latent":
            assert cap.meta.amax_floor == 1e-8 and cap.meta.extra["store_path"] == "rocm_triton"
        else:
            assert torch.equal(cap.tile_scales, wrote["pack"].scale_k_nope_ue8m0)


def test_the_amax_floor_tells_the_two_stores_apart(tmp_path, pool):
    """The ROCm store floors a tile's amax at 1e-8, the CUDA one at 1e-4: replayed under the CUDA rule,
    the ROCm store's all-zero tile (4) and its tile below 1e-4 (5) have other exponents, every token."""
    install(tmp_path)
    dsv4_kit.write_v4(pool)
    cap = read_kv_write(captures(tmp_path)["set_swa_key_buffer_radix_fused"])
    t = {k: getattr(cap, k) for k in ("latent", "rope", "slots", "pool_slots", "rows_before", "rows_after")}
    cuda = tmp_path / "as-cuda.safetensors"
    write_kv_write(cuda, t, {**cap.meta.to_json(), "amax_floor": 1e-4})
    e = replay_file(cuda, ReplayOptions()).backends["observed"].explanation
    assert e.hypothesis == "kv_ue8m0_exponent_off"
    assert e.detail["tiles"] == [[tok, j] for tok in range(cap.tokens) for j in (4, 5)]
    assert set(e.detail["fp8_values"].split("; ")) == {"as documented", "requantized at the stored exponent"}


def _planted(monkeypatch, path: str, fault: str, token: int = 2, tile: int = 3) -> None:
    """Wrap SGLang's store kernel of ``path`` (pack / fused) with a planted fault on one token."""
    import importlib

    if path == "pack":
        mod = importlib.import_module(PACK_STORE)
        real = mod._set_k_and_s_triton

        def store(buf, loc, pack, page_size):
            loc, pack = loc.clone(), pack.slice_pack(slice(None))
            if fault == "exponent":  # the tile's exponent byte one too big, its fp8 bytes as given
                pack.scale_k_nope_ue8m0 = pack.scale_k_nope_ue8m0.clone()
                pack.scale_k_nope_ue8m0[token, tile] += 1
            else:
                loc[token] += 1
            real(buf, loc, pack, page_size)

        monkeypatch.setattr(mod, "_set_k_and_s_triton", store)
        return
    mod = importlib.import_module(FUSED_STORE)
    real = mod.triton_fused_store_flashmla

    def fused(input, cache, indices, page_size):
        input, indices = input.clone(), indices.clone()
        if fault == "exponent":  # the tile doubled: its exponent one too big, the same fp8 bytes
            input[token, tile * 64 : (tile + 1) * 64] *= 2
        else:
            indices[token] += 1
        real(input, cache, indices, page_size)

    monkeypatch.setattr(mod, "triton_fused_store_flashmla", fused)


@pytest.mark.parametrize("path", ["pack", "fused"])
@pytest.mark.parametrize("fault", ["exponent", "neighbour_slot"])
def test_a_planted_v4_writer_is_named_with_its_rows(tmp_path, pool, monkeypatch, path, fault):
    _planted(monkeypatch, path, fault)
    install(tmp_path)
    wrote = dsv4_kit.write_v4(pool)
    which = {"pack": ("set_swa_key_buffer", "swa_pack"), "fused": ("set_extra_key_buffer_fused", "c128_fused")}
    method, key = which[path]
    slot = int(wrote["locs"][key][2])
    r = replay_file(captures(tmp_path)[method], ReplayOptions())
    e = r.backends["observed"].explanation
    assert r.verdict == "diverged" and r.diagnosis == "kv_writer"
    assert r.backends["observed"].info["differing_tokens"] == [2]
    if fault == "exponent":
        assert e.hypothesis == "kv_ue8m0_exponent_off" and e.detail["tiles"] == [[2, 3]] and e.detail["offset"] == 1
        assert e.detail["slots"] == [slot] and e.detail["fp8_values"] == "as documented"
    else:
        assert e.hypothesis == "kv_row_to_other_slot" and e.detail["slots"] == [slot]
        assert e.detail["written_to"] == [slot + 1]
    if path == "pack":  # the other pack write (C4) went through the same planted kernel
        assert replay_file(captures(tmp_path)["set_extra_key_buffer"], ReplayOptions()).verdict == "diverged"


def test_the_hook_never_raises_into_the_v4_writer(tmp_path, pool, monkeypatch):
    state = install(tmp_path)
    monkeypatch.setattr(pool, "get_swa_key_page_size", lambda: "not a page size")  # what the capture reads is broken
    k = dsv4_kit.v4_latent(2)
    pool.set_swa_key_buffer(0, torch.tensor([5, 9], dtype=torch.int32), dsv4_kit.pack_quantizer()(k))
    assert state.disabled is not None and not captures(tmp_path)
    assert pool.get_swa_raw_buffer(0)[0, 576 * 9 + 448 : 576 * 9 + 576].view(torch.bfloat16).equal(k[1, 448:])


def test_a_uniform_fp8_compressed_pool_is_a_row_capture(tmp_path, pool, monkeypatch):
    from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4LayerItem, DeepSeekV4UniformFP8KVPool

    uniform = DeepSeekV4UniformFP8KVPool(64, 2, torch.bfloat16, 448, 64, 1, "cpu", False, global_page_size=256)
    mapping = list(pool.layer_mapping)
    mapping[2] = DeepSeekV4LayerItem(128, 0, uniform)
    monkeypatch.setattr(pool, "layer_mapping", mapping)
    install(tmp_path)
    k = (dsv4_kit.v4_latent(4) / 8).bfloat16()
    pool.set_extra_key_buffer_fused(layer_id=2, loc=torch.tensor([3, 10, 11, 40]), cache_k=k)
    (f,) = captures(tmp_path).values()
    r = replay_file(f, ReplayOptions())
    assert r.verdict == "agree", r.diagnosis_text
    assert r.meta.writer == "sglang.DeepSeekV4UniformFP8KVPool.set_key_buffer_fused" and r.meta.kv_layout is None
    assert r.meta.kv_dtype == "float8_e4m3fn" and r.meta.scale_applied == "caller"


# --- the synth presets and faults, bad input, inspect (no SGLang) ---------------------------------


@pytest.mark.parametrize("preset,fault,hypothesis", [
    ("kv-write-v4", "ue8m0_exponent", "kv_ue8m0_exponent_off"),
    ("kv-write-v4-pack", "ue8m0_exponent", "kv_ue8m0_exponent_off"),
    ("kv-write-v4-fnuz", "scale_missing", "kv_scale_not_applied"),
    ("kv-write-v4-c128", "rope_offset", "kv_rope_offset"),
    ("kv-write-v4-pack", "neighbour_slot", "kv_row_to_other_slot"),
    ("kv-write-v4-c128", "neighbour_overwritten", "kv_neighbour_overwritten"),
])  # fmt: skip
def test_each_packed_synth_fault_is_named_and_the_clean_preset_agrees(tmp_path, preset, fault, hypothesis):
    from refmla.kvwrite.synth import synth_kv_write

    clean, bad = tmp_path / "clean.safetensors", tmp_path / "bad.safetensors"
    synth_kv_write(clean, preset)
    planted = synth_kv_write(bad, preset, fault)
    assert replay_file(clean, ReplayOptions()).verdict == "agree"
    r = replay_file(bad, ReplayOptions())
    e = r.backends["observed"].explanation
    assert r.diagnosis == "kv_writer" and e is not None and e.hypothesis == hypothesis
    assert planted["slot"] in e.detail["slots"] + e.detail.get("next_to_written_slot", [])
    if fault == "ue8m0_exponent":
        assert e.detail["tiles"] == [[planted["token"], planted["tile"]]] and e.detail["offset"] == 1
    if fault == "rope_offset":
        assert e.detail["offset"] == 0 and e.detail["expected_offset"] == 448 and e.detail["unit"] == "bytes"


def test_the_token_columns_are_the_sparse_decoders_bytes():
    from refmla.kvwrite.packed import token_columns
    from refmla.sparse.layouts import LAYOUTS, token_bytes

    lay, ps = LAYOUTS["v4"], 4
    pages = torch.randint(0, 256, (3, lay.page_bytes(ps)), dtype=torch.uint8)
    slots = torch.arange(3 * ps)
    got = pages[(slots // ps)[:, None], token_columns(slots % ps, lay, ps)]
    tb = token_bytes(pages, lay, ps)
    assert torch.equal(got, torch.cat([tb.nope, tb.rope, tb.scales], 1))


def _packed_raw(tmp_path, change) -> str:
    """A packed synth capture rewritten by plain safetensors with one thing broken."""
    from safetensors.torch import load_file, save_file

    from refmla.kvwrite.synth import synth_kv_write

    good = tmp_path / "good.safetensors"
    synth_kv_write(good, "kv-write-v4-pack")
    t = load_file(str(good))
    m = read_kv_write(good).meta.to_json()
    change(t, m)
    bad = tmp_path / "bad.safetensors"
    save_file(t, str(bad), metadata={"format": "refmla.capture/1", "meta": json.dumps(m)})
    return str(bad)


@pytest.mark.parametrize("change,key", [
    (lambda t, m: m.update(kv_layout="v5"), "meta key 'kv_layout'"),
    (lambda t, m: m.update(kv_dtype="bfloat16"), "meta key 'kv_dtype'"),
    (lambda t, m: m.pop("packed_input"), "meta key 'packed_input'"),
    (lambda t, m: m.update(packed_input="latent"), "meta key 'amax_floor'"),
    (lambda t, m: m.update(kv_lora_rank=512), "meta key 'kv_lora_rank'"),
    (lambda t, m: m.pop("page_size"), "meta key 'page_size'"),
    (lambda t, m: t.pop("tile_scales"), "tensor 'tile_scales'"),
    (lambda t, m: t.update(latent=t["latent"].view(torch.uint8)), "tensor 'latent'"),
    (lambda t, m: t.update(rows_after=t["rows_after"][:, :576].contiguous()), "tensor 'rows_after'"),
    (lambda t, m: t.update(scale=torch.tensor([0.5])), "tensor 'scale'"),
])  # fmt: skip
def test_bad_packed_input_exits_2_naming_the_file_and_key(tmp_path, capsys, change, key):
    bad = _packed_raw(tmp_path, change)
    assert refmla_main(["replay", bad]) == 2
    err = capsys.readouterr().err
    assert bad in err and key in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_inspect_describes_a_packed_writer_capture(tmp_path, capsys):
    from refmla.kvwrite.synth import synth_kv_write

    f = tmp_path / "w.safetensors"
    synth_kv_write(f, "kv-write-v4-c128")
    assert refmla_main(["inspect", str(f), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)["description"]
    assert d["kv_layout"] == "v4" and d["packed_input"] == "latent" and d["page_size"] == 2 and d["row_bytes"] == 584
    assert d["amax_floor"] == 1e-4 and d["head_dim"] == "448 + 64" and d["pages_written_count"] == 8
    cap = read_kv_write(f)
    assert d["pages_written"] == sorted({int(s) // 2 for s in cap.slots})


def test_a_rope_written_past_its_row_is_named_with_the_row_it_overwrote(tmp_path):
    """The bf16 rope offset counted in bytes (448 * 2 = 896): the rope lands in the next slot's data row."""
    from refmla.kvwrite.synth import synth_kv_write

    clean = tmp_path / "clean.safetensors"
    synth_kv_write(clean, "kv-write-v4")
    cap = read_kv_write(clean)
    after = cap.rows_after.clone()
    t = 3
    p = int(cap.positions()[t])
    rope = after[p, 448:576].clone()
    after[p, 448:576] = cap.rows_before[p, 448:576]  # its own rope bytes never written
    after[p + 1, 896 - 576 : 896 - 576 + 128] = rope  # ... but 896 bytes into its row: the next slot's
    t_ = {k: getattr(cap, k) for k in ("latent", "rope", "slots", "pool_slots", "rows_before")}
    bad = tmp_path / "bad.safetensors"
    write_kv_write(bad, {**t_, "rows_after": after}, cap.meta.to_json())
    e = replay_file(bad, ReplayOptions()).backends["observed"].explanation
    assert e.hypothesis == "kv_rope_offset" and e.detail["offset"] == 896 and e.detail["tokens"] == [t]
    assert e.detail["also_overwritten"] == [int(cap.slots[t]) + 1]

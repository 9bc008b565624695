"""The bytes between writer and reader across captures and encodings: rows written through a stale
slot mapping (``kv_written_to_stale_rows``, in the writer capture alone or found in the decode
capture of the step), e5m2 pools read and written, and the writer -> reader chain for vLLM block
tables and DeepSeek-V4 sparse decode (refmla.chain, refmla.api.replay_folder).

Test data by this file's own loops and tools/planting_vllm.py's: writers storing ``x / scale`` by
torch's own fp8 casts (vLLM's concat_and_cache_mla reference loop), decode "kernels" reading the
pool's bytes through torch's fp8 views with a plain softmax (tests/helpers.dense_reference,
planting_vllm.attention, tests/test_kv_bytes_sparse.py's byte-level V4 decoder). Faults are planted
here, never by refmla's reference."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from helpers import dense_reference, load_tool
from refmla.batch import replay_many
from refmla.capture import write_capture
from refmla.chain import link
from refmla.kvwrite.io import write_kv_write
from refmla.options import ReplayOptions
from refmla.pipeline import replay_file

pv = load_tool("planting_vllm")
D, DV = 576, 512
KEY = {"layer_id": 3, "tp_rank": 0, "step": 7}


def cast(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """vLLM's convert_fp8: x / scale, saturated, torch's own cast."""
    m = torch.finfo(dtype).max
    return (x.float() / scale).clamp(-m, m).to(dtype)


def writer_capture(path, latent, rope, slots, keep, before, after, kv_dtype: str, scale: float = 1.0, **meta):
    t = {"latent": latent, "rope": rope, "slots": slots, "pool_slots": keep, "rows_before": before, "rows_after": after}
    if kv_dtype.startswith("float8"):
        t["scale"] = torch.tensor([scale])
    write_kv_write(path, t, {"mode": "kv_write", "writer": "vllm.concat_and_cache_mla", "kv_dtype": kv_dtype,
                             "kv_lora_rank": DV, "qk_rope_head_dim": D - DV, **KEY, **meta})  # fmt: skip


# --- rows written through a stale slot mapping --------------------------------------------------------------


def stale_step(tmp_path, mapping_shift: int = 0, stale=None, dtype=torch.float8_e4m3fn):
    """Layer 3, step 7: two requests each get a new token (slots 39, 80); the writer writes them at
    ``slots + mapping_shift`` or at the slots ``stale`` (step 6's mapping), keeping each slot's
    neighbours as the hook does; the decode kernel then reads the pool as it is."""
    g = torch.Generator().manual_seed(0)
    pool = cast(torch.randn(96, D, generator=g) * 4, dtype)
    before = pool.clone()
    slots = torch.tensor([39, 80])
    latent, rope = torch.randn(2, DV, generator=g).bfloat16(), torch.randn(2, D - DV, generator=g).bfloat16()
    to = slots + mapping_shift if stale is None else torch.tensor(stale)
    for i, s in enumerate(to.tolist()):
        pool.view(torch.uint8)[s] = cast(torch.cat([latent[i], rope[i]]), dtype).view(torch.uint8)
    keep = torch.unique(torch.cat([slots - 1, slots, slots + 1]))
    writer_capture(tmp_path / "kvwrite-s7.safetensors", latent, rope, slots, keep, before[keep], pool[keep], str(dtype)[6:])
    idx = torch.cat([torch.arange(0, 40), torch.arange(60, 81)])  # request 0: slots 0..39, request 1: 60..80
    indptr = torch.tensor([0, 40, 61])
    q = torch.randn(2, 4, D, generator=g).bfloat16()
    out, lse = dense_reference(q, pool[:, None], indptr, idx, DV, 0.1)
    write_capture(tmp_path / "decode-s7.safetensors",
                  {"q": q, "kv_buffer": pool[:, None], "kv_indptr": indptr, "kv_indices": idx,
                   "seq_lens": torch.tensor([40, 21]), "out": out.bfloat16(), "lse": lse.float()},
                  {"mode": "decode", "backend": "unknown", "kv_lora_rank": DV, "qk_rope_head_dim": D - DV, "sm_scale": 0.1,
                   "logit_cap": 0.0, "page_size": 1, **KEY})  # fmt: skip
    return slots


def test_rows_written_one_slot_back_are_named_stale_rows_with_the_rows(tmp_path):
    """Each request's new token written over its previous token (a slot mapping one behind): the
    writer capture alone holds the rows it landed on (each slot's neighbour)."""
    stale_step(tmp_path, mapping_shift=-1)
    r = replay_file(tmp_path / "kvwrite-s7.safetensors", ReplayOptions())
    e = r.backends["observed"].explanation
    assert e.hypothesis == "kv_written_to_stale_rows", r.diagnosis_text
    assert e.detail == {"tokens": [0, 1], "slots": [39, 80], "written_to": [38, 79], "every_token": True, "slot_offset": -1}


def test_one_token_at_its_neighbour_stays_row_to_other_slot(tmp_path):
    g = torch.Generator().manual_seed(2)
    pool = torch.randn(32, D, generator=g).bfloat16()
    before, slots = pool.clone(), torch.tensor([5, 9, 20])
    latent, rope = torch.randn(3, DV, generator=g).bfloat16(), torch.randn(3, D - DV, generator=g).bfloat16()
    for i, s in enumerate(slots.tolist()):
        pool[s + (1 if i == 1 else 0)] = torch.cat([latent[i], rope[i]])
    keep = torch.unique(torch.cat([slots - 1, slots, slots + 1]))
    writer_capture(tmp_path / "w.safetensors", latent, rope, slots, keep, before[keep], pool[keep], "bfloat16")
    e = replay_file(tmp_path / "w.safetensors", ReplayOptions()).backends["observed"].explanation
    assert e.hypothesis == "kv_row_to_other_slot" and e.detail["written_to"] == [10]


def test_rows_written_through_the_previous_steps_mapping_are_found_in_the_decode_capture(tmp_path):
    """The writer used step 6's slot mapping (17, 70): its own capture keeps only its slots'
    neighbourhood (tokens not written); the decode capture of the step holds the rows at 17 and
    70, and step 6's writer capture names the mapping."""
    stale_step(tmp_path, stale=[17, 70])
    g = torch.Generator().manual_seed(9)
    old = torch.tensor([17, 70])
    keep = torch.unique(torch.cat([old - 1, old, old + 1]))
    rows = cast(torch.randn(len(keep), D, generator=g), torch.float8_e4m3fn)
    writer_capture(tmp_path / "kvwrite-s6.safetensors", torch.randn(2, DV, generator=g).bfloat16(),
                   torch.randn(2, D - DV, generator=g).bfloat16(), old, keep, rows, rows.clone(), "float8_e4m3fn",
                   step=6)  # its own verdict does not matter here  # fmt: skip
    from refmla.api import replay_folder

    reports = replay_folder(tmp_path, backends=["reference"])
    (w,) = [r for r in reports if r.capture.endswith("kvwrite-s7.safetensors")]
    e = w.backends["observed"].explanation
    assert e.hypothesis == "kv_written_to_stale_rows", w.diagnosis_text
    assert e.detail["written_to"] == [17, 70] and e.detail["slots"] == [39, 80]
    assert e.detail["seen_in"].endswith("decode-s7.safetensors") and e.detail["slot_mapping_of"]["step"] == 6
    assert e.other_causes[0].hypothesis == "kv_tokens_not_written"
    assert w.diagnosis_text.startswith("kv_written_to_stale_rows")


def test_a_writer_that_wrote_its_own_slots_has_no_stale_link(tmp_path):
    stale_step(tmp_path)
    reports = replay_many([str(tmp_path / "kvwrite-s7.safetensors"), str(tmp_path / "decode-s7.safetensors")],
                          ReplayOptions(backends=["reference"]))  # fmt: skip
    link(reports)
    assert [r.verdict for r in reports] == ["agree", "agree"]


# --- e5m2 pools ----------------------------------------------------------------------------------------


SPEC = pv.VllmSpec(block=16, fp8=True, seq_lens=(70, 33, 141), heads=2)


def e5m2_capture():
    t, _, _ = pv.capture(SPEC)
    t["kv_buffer"] = t["kv_buffer"].float().to(torch.float8_e5m2)  # torch's own cast (NaN stays NaN)
    return t


def replay_decode(tmp_path, t):
    from refmla.capture import read_capture
    from refmla.pipeline import replay_capture

    cap = read_capture(write_capture(tmp_path / "c.safetensors", t, pv.meta(SPEC), compact=False))
    return replay_capture(cap, ReplayOptions(backends=["reference"]))


def test_a_clean_e5m2_decode_agrees(tmp_path):
    t = e5m2_capture()
    out, lse = pv.attention(t, SPEC)
    t["out"], t["lse"] = out.to(torch.bfloat16), lse.float()
    assert replay_decode(tmp_path, t).verdict == "agree"


def test_an_e5m2_pool_read_as_e4m3fn_is_named(tmp_path):
    t = e5m2_capture()
    out, lse = pv.attention({**t, "kv_buffer": t["kv_buffer"].view(torch.uint8).view(torch.float8_e4m3fn)}, SPEC)
    t["out"], t["lse"] = out.to(torch.bfloat16), lse.float()
    r = replay_decode(tmp_path, t)
    e = r.backends["observed"].explanation
    assert e is not None and e.hypothesis == "kv_fp8_encoding_mismatch", r.diagnosis_text
    assert e.detail == {"written": "float8_e5m2", "read": "float8_e4m3fn"}


@pytest.mark.parametrize("written", ["float8_e5m2", "float8_e4m3fn"])
def test_an_e5m2_writer_agrees_and_other_bytes_in_its_pool_are_named(tmp_path, written):
    g = torch.Generator().manual_seed(5)
    pool = cast(torch.randn(48, D, generator=g), torch.float8_e5m2)
    before, slots = pool.clone(), torch.tensor([4, 11, 30])
    latent, rope = torch.randn(3, DV, generator=g).bfloat16(), torch.randn(3, D - DV, generator=g).bfloat16()
    for i, s in enumerate(slots.tolist()):
        pool.view(torch.uint8)[s] = cast(torch.cat([latent[i], rope[i]]), getattr(torch, written), 0.5).view(torch.uint8)
    keep = torch.unique(torch.cat([slots - 1, slots, slots + 1]))
    writer_capture(tmp_path / "w.safetensors", latent, rope, slots, keep, before[keep], pool[keep], "float8_e5m2", 0.5)
    r = replay_file(tmp_path / "w.safetensors", ReplayOptions())
    if written == "float8_e5m2":
        assert r.verdict == "agree", r.diagnosis_text
        return
    e = r.backends["observed"].explanation
    assert r.diagnosis == "kv_contract" and (e.detail["written"], e.detail["read"]) == (written, "float8_e5m2")


# --- the chain for vLLM block tables ----------------------------------------------------------------------


def test_a_vllm_writer_that_stored_e4m3fn_into_its_e4m3fnuz_pool_is_named_for_a_block_table_decode(tmp_path):
    """vLLM's loop: the step's writer stores each request's newest token (e4m3fn bytes, its pool
    declared e4m3fnuz, as on an image mixing components); the block-table decode kernel reads e4m3fn."""
    t, meta, _ = pv.capture(SPEC)
    g = torch.Generator().manual_seed(11)
    table, P = t["block_table"].long(), SPEC.block
    slots = torch.stack([table[b, (L - 1) // P] * P + (L - 1) % P for b, L in enumerate(SPEC.seq_lens)])
    latent, rope = torch.randn(3, DV, generator=g).bfloat16(), torch.randn(3, D - DV, generator=g).bfloat16()
    kv = t["kv_buffer"].reshape(-1, D)
    before = kv.clone()
    for i, s in enumerate(slots.tolist()):
        kv.view(torch.uint8)[s] = cast(torch.cat([latent[i], rope[i]]), torch.float8_e4m3fn, SPEC.k_scale).view(torch.uint8)
    keep = torch.unique(torch.cat([slots - 1, slots, slots + 1]))
    fnuz = lambda x: x.view(torch.uint8).view(torch.float8_e4m3fnuz)  # noqa: E731
    writer_capture(tmp_path / "kvwrite.safetensors", latent, rope, slots, keep, fnuz(before[keep]), fnuz(kv[keep]),
                   "float8_e4m3fnuz", SPEC.k_scale, page_size=P)  # fmt: skip
    out, lse = pv.attention(t, SPEC)  # the kernel reads the bytes as e4m3fn
    t.update(out=out.to(torch.bfloat16), lse=lse.float(), kv_buffer=fnuz(t["kv_buffer"]))
    write_capture(tmp_path / "decode.safetensors", t, {**meta, **KEY})
    from refmla.api import replay_folder

    decode, writer = sorted(replay_folder(tmp_path, backends=["reference"]), key=lambda r: "kvwrite" in r.capture)
    assert writer.diagnosis == "kv_contract"
    assert decode.diagnosis_text.startswith("kv_fp8_encoding_mismatch (the writer's)"), decode.diagnosis_text
    (f,) = [f for f in decode.metadata.findings if f.check == "kv_writer_link"]
    assert f.numbers["slots"] == sorted(slots.tolist())


# --- the chain for DeepSeek-V4 sparse decode ---------------------------------------------------------------


def test_a_v4_decode_read_as_e4m3fnuz_is_the_readers_when_its_writer_stored_e4m3fn(tmp_path):
    """The V4 window cache's newest tokens stored by a pack writer (the bytes it is given, copied by
    this file into the capture), the step's sparse decode read e4m3fnuz by tests/test_kv_bytes_sparse.py's
    byte-level kernel: the writer kept the contract, the reader did not."""
    import test_kv_bytes_sparse as tks

    from refmla.sparse.layouts import LAYOUTS, token_rows
    from refmla.sparse.presets import sparse_preset
    from refmla.sparse.synth import build_case
    from refmla.sparse.validation import write_sparse

    case = build_case(dataclasses.replace(sparse_preset(tks.SWA), seq_lens=(40, 130), page_size=64))
    lay, P = LAYOUTS["v4"], case.main.page_size
    rows = token_rows(case.main.pages, lay, P)  # [tokens, 584] the pages' bytes, one row a token
    newest = [int(case.indices[b, 0, int(case.topk_length[b]) - 1]) for b in range(2)]
    slots = torch.tensor(newest)
    keep = torch.unique(torch.cat([slots - 1, slots, slots + 1]))
    before = rows[keep].clone()
    before[torch.isin(keep, slots)] = 0  # what the slots held before this step's write
    write_kv_write(tmp_path / "kvwrite.safetensors",
                   {"latent": rows[slots, :448].contiguous().view(torch.float8_e4m3fn),
                    "rope": rows[slots, 448:576].contiguous().view(torch.bfloat16), "tile_scales": rows[slots, 576:583].contiguous(),
                    "slots": slots, "pool_slots": keep, "rows_before": before, "rows_after": rows[keep]},
                   {"mode": "kv_write", "writer": "sglang.DeepSeekV4TokenToKVPool.set_swa_key_buffer", "kv_dtype": "float8_e4m3fn",
                    "kv_lora_rank": 448, "qk_rope_head_dim": 64, "kv_layout": "v4", "packed_input": "pack", "page_size": P,
                    **KEY})  # fmt: skip
    out, lse = tks.kernel(case, fnuz=True, stride=int(case.main.pages.shape[1]))
    write_sparse(tmp_path / "sparse.safetensors", {**case.tensors(), "out": out.to(torch.bfloat16), "lse": lse.float()},
                 {**case.meta(), **KEY})  # fmt: skip
    from refmla.api import replay_folder

    decode, writer = sorted(replay_folder(tmp_path, backends=["reference", "observed"]), key=lambda r: "kvwrite" in r.capture)
    assert writer.verdict == "agree", writer.diagnosis_text
    assert decode.diagnosis_text.startswith("kv_fp8_encoding_mismatch (the reader's)"), decode.diagnosis_text
    (f,) = [f for f in decode.metadata.findings if f.check == "kv_writer_link"]
    assert f.numbers["slots"] == sorted(newest)


@pytest.mark.parametrize("read", ["float8_e5m2", "float8_e4m3fn"])
def test_an_e5m2_sparse_cache_is_read_and_its_e4m3_reading_named(tmp_path, read):
    """A V4 window cache whose meta says e5m2: this file's kernel reads the nope bytes by torch's
    view as ``read`` (the tile exponents and rope as stored), a plain softmax with the sink."""
    import math

    import test_kv_bytes_sparse as tks

    from refmla.sparse.presets import sparse_preset
    from refmla.sparse.synth import build_case
    from refmla.sparse.validation import write_sparse

    case = build_case(dataclasses.replace(sparse_preset(tks.SWA), seq_lens=(40, 130), page_size=64))
    p, pool = case.preset, case.main
    flat, W, P = pool.pages.reshape(-1), int(pool.pages.shape[1]), pool.page_size
    data = pool.pages[:, : P * 576].reshape(-1, 576)  # [tokens, 576] data rows: 448 fp8, 128 rope bytes
    nope = data[:, :448].contiguous().view(torch.float8_e4m3fn).float().to(torch.float8_e5m2)  # torch's own cast
    data[:, :448] = nope.view(torch.uint8)
    pool.pages[:, : P * 576] = data.reshape(pool.pages.shape[0], -1)  # the cache as an e5m2 writer stores it

    def token(t: int) -> torch.Tensor:
        base, s = (t // P) * W, t % P
        data = flat[base + s * 576 : base + s * 576 + 576]
        e = flat[base + P * 576 + s * 8 :][:7].double()
        nope = data[:448].contiguous().view(getattr(torch, read)).double() * torch.exp2(e - 127).repeat_interleave(64)
        return torch.cat([nope, data[448:].contiguous().view(torch.bfloat16).double()])

    B, _, H, _ = case.q.shape
    out, lse = torch.zeros(B, 1, H, p.head_dim_v, dtype=torch.float64), torch.zeros(B, 1, H, dtype=torch.float64)
    for b in range(B):
        k = torch.stack([token(int(i)) for i in case.indices[b, 0, : int(case.topk_length[b])] if int(i) >= 0])
        w = case.q[b, 0].double() @ k.T * p.softmax_scale  # [H, n]
        lse[b, 0] = torch.logsumexp(w, -1)
        out[b, 0] = torch.softmax(w, -1) @ k / (1 + torch.exp(case.sink.double() - lse[b, 0]))[:, None]
    assert bool(torch.isfinite(out).all()) and not math.isnan(float(lse.sum()))
    path = tmp_path / "e5m2.safetensors"
    write_sparse(path, {**case.tensors(), "out": out.to(torch.bfloat16), "lse": lse.float()},
                 {**case.meta(), "kv_fp8_dtype": "float8_e5m2"})  # fmt: skip
    r = replay_file(str(path), ReplayOptions(backends=["reference", "observed"]))
    if read == "float8_e5m2":
        assert r.verdict == "agree", r.diagnosis_text
        return
    e = r.backends["observed"].explanation
    assert e is not None and e.detail == {"written": "float8_e5m2", "read": "float8_e4m3fn"}, r.diagnosis_text

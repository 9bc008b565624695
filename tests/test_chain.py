"""A decode capture and the KV writer capture of the same step in one folder (refmla.chain): the
decode's divergence named as the writer's or the contract's, not the decode kernel's.

Test data by this file's own loops: a writer storing each new token's row with torch's own fp8
cast (x / scale, saturated) at its slot, and a decode "kernel" reading the pool's bytes through
torch's fp8 views, with a plain per-request softmax (tests/helpers.dense_reference)."""

from __future__ import annotations

import pytest
import torch

from helpers import dense_reference
from refmla.batch import replay_many
from refmla.capture import write_capture
from refmla.chain import link_writers
from refmla.kvwrite.io import write_kv_write
from refmla.options import ReplayOptions

D, DV, N = 576, 512, 96
LENS = (40, 23)


def step(tmp_path, written: torch.dtype, declared: torch.dtype, kernel_reads: torch.dtype) -> list:
    """One decode step of layer 3: the writer stores 2 new tokens (``written`` bytes, its pool
    declared ``declared``), then the decode kernel reads the pool as ``kernel_reads``."""
    g = torch.Generator().manual_seed(0)
    pool = (torch.randn(N, 1, D, generator=g) * 4).to(written)  # every row written before this step
    before = pool.clone()
    new_slots = torch.tensor([39, 80])  # request 0's newest token, request 1's
    latent, rope = torch.randn(2, DV, generator=g).bfloat16(), torch.randn(2, D - DV, generator=g).bfloat16()
    for i, s in enumerate(new_slots.tolist()):  # the writer: torch's cast, saturated, scale 1
        m = torch.finfo(written).max
        pool[s, 0] = torch.cat([latent[i].float(), rope[i].float()]).clamp(-m, m).to(written)
    keep = torch.unique(torch.cat([new_slots - 1, new_slots, new_slots + 1]))
    as_declared = lambda p: p.view(torch.uint8).view(declared)  # noqa: E731
    key = {"layer_id": 3, "tp_rank": 0, "step": 7}
    write_kv_write(tmp_path / "kvwrite.safetensors",
                   {"latent": latent, "rope": rope, "slots": new_slots, "scale": torch.tensor([1.0]), "pool_slots": keep,
                    "rows_before": as_declared(before[keep, 0]), "rows_after": as_declared(pool[keep, 0])},
                   {"mode": "kv_write", "writer": "test.writer", "kv_dtype": str(declared)[6:], "kv_lora_rank": DV,
                    "qk_rope_head_dim": D - DV, **key})  # fmt: skip
    idx = torch.cat([torch.arange(0, 40), torch.tensor([60 + i for i in range(22)] + [80])])
    indptr = torch.tensor([0, 40, 63])
    q = torch.randn(2, 4, D, generator=g).bfloat16()
    out, lse = dense_reference(q, pool.view(torch.uint8).view(kernel_reads), indptr, idx, DV, 0.1)
    t = {"q": q, "kv_buffer": as_declared(pool), "kv_indptr": indptr, "kv_indices": idx, "seq_lens": torch.tensor(LENS),
         "out": out.bfloat16(), "lse": lse.float()}  # fmt: skip
    meta = {"mode": "decode", "backend": "unknown", "kv_lora_rank": DV, "qk_rope_head_dim": D - DV, "sm_scale": 0.1,
            "logit_cap": 0.0, "page_size": 1, **key}  # fmt: skip
    write_capture(tmp_path / "decode.safetensors", t, meta)
    opts = ReplayOptions(backends=["reference"])
    reports = replay_many([str(tmp_path / "decode.safetensors"), str(tmp_path / "kvwrite.safetensors")], opts)
    link_writers(reports)
    return reports


FN, FNUZ = torch.float8_e4m3fn, torch.float8_e4m3fnuz


def test_a_writer_that_stored_e4m3fn_into_its_e4m3fnuz_pool_is_named_for_the_decodes_divergence(tmp_path):
    decode, writer = step(tmp_path, written=FN, declared=FNUZ, kernel_reads=FN)
    assert writer.diagnosis == "kv_contract"
    assert decode.backends["observed"].explanation.hypothesis == "kv_fp8_encoding_mismatch"
    assert decode.diagnosis == "kv_contract" and decode.diagnosis_text.startswith("kv_fp8_encoding_mismatch (the writer's)")
    (link,) = [f for f in decode.metadata.findings if f.check == "kv_writer_link"]
    assert link.numbers["whose"] == "the writer's" and link.numbers["slots"] == [39, 80]


def test_a_reader_that_read_the_other_encoding_is_named_the_readers(tmp_path):
    decode, writer = step(tmp_path, written=FNUZ, declared=FNUZ, kernel_reads=FN)
    assert writer.verdict == "agree"
    assert decode.diagnosis == "kv_contract" and decode.diagnosis_text.startswith("kv_fp8_encoding_mismatch (the reader's)")


def test_a_clean_step_has_no_link(tmp_path):
    decode, writer = step(tmp_path, written=FN, declared=FN, kernel_reads=FN)
    assert decode.verdict == "agree" and writer.verdict == "agree"
    assert not [f for f in decode.metadata.findings if f.check == "kv_writer_link"]

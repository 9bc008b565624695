"""diff-kv across fp8 encodings: a prefill node's e4m3fn pool transferred byte for byte to a decode
node that reads its pool as e4m3fnuz (refmla.diffkv.diff.encoding_notes). Rows by torch's own fp8
cast, written by this file's loop."""

from __future__ import annotations

import torch

from refmla.capture import write_capture
from refmla.diffkv import diff_kv_files

D, DV, LENS = 576, 512, (20, 9)


def side(path, rows: torch.Tensor, slots: list[torch.Tensor], dtype: torch.dtype) -> str:
    pool = torch.zeros(64, 1, D, dtype=torch.uint8)
    for s, r in zip(slots, rows):
        pool[s, 0] = r.view(torch.uint8)
    t = {"q": torch.zeros(2, 1, D).bfloat16(), "kv_buffer": pool.view(dtype), "kv_indptr": torch.tensor([0, 20, 29]),
         "kv_indices": torch.cat(slots).int(), "seq_lens": torch.tensor(LENS).int()}  # fmt: skip
    meta = {"mode": "decode", "backend": "unknown", "kv_lora_rank": DV, "qk_rope_head_dim": D - DV, "sm_scale": 0.1,
            "logit_cap": 0.0, "page_size": 1, "rids": ["a", "b"]}  # fmt: skip
    write_capture(path, t, meta)
    return str(path)


def test_the_same_bytes_read_in_another_encoding_are_named(tmp_path):
    g = torch.Generator().manual_seed(0)
    rows = [(torch.randn(L, D, generator=g) * 8).to(torch.float8_e4m3fn) for L in LENS]  # the prefill's cast
    p = side(tmp_path / "p.safetensors", rows, [torch.arange(1, 21), torch.arange(30, 39)], torch.float8_e4m3fn)
    d_same = side(tmp_path / "d.safetensors", rows, [torch.arange(40, 60), torch.arange(5, 14)], torch.float8_e4m3fn)
    d_fnuz = side(tmp_path / "e.safetensors", rows, [torch.arange(40, 60), torch.arange(5, 14)], torch.float8_e4m3fnuz)
    clean = diff_kv_files([p], d_same)
    assert not any("kv_fp8_encoding_mismatch" in n for n in clean.notes)
    res = diff_kv_files([p], d_fnuz)
    (note,) = [n for n in res.notes if n.startswith("kv_fp8_encoding_mismatch")]
    assert "written=float8_e4m3fn, read=float8_e4m3fnuz" in note

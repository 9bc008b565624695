"""Block-table captures: the reader builds the token rows, and every inconsistency is one line."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from helpers import dense_reference, raw_write
from refmla import blocktable
from refmla.capture import CaptureError, read_capture, write_capture
from refmla.reference import mla_decode_ref

P = 4
META = dict(mode="decode", backend="vllm_triton", kv_lora_rank=512, qk_rope_head_dim=64, sm_scale=0.125,
            logit_cap=0.0, page_size=P, split_schedule="uniform", null_block=0, engine="vllm")  # fmt: skip


def _case(seed=0):
    """A pool of 10 pages whose unused rows are NaN (page 0 too: the null block), a shuffled table
    padded with the null block, a zero-length request."""
    g = torch.Generator().manual_seed(seed)
    pool = torch.full((10 * P, 1, 576), math.nan)
    table = torch.tensor([[7, 2, 0, 0], [0, 0, 0, 0], [5, 9, 3, 0]], dtype=torch.int32)
    seq = torch.tensor([6, 0, 10], dtype=torch.int32)
    for b, L in enumerate(seq.tolist()):
        rows = blocktable.token_rows(table[b : b + 1], seq[b : b + 1], P)[1]
        pool[rows, 0] = torch.randn(L, 576, generator=g)
    q = torch.randn(3, 4, 576, generator=g)
    return q, pool, table, seq


def test_token_rows_follow_the_pages():
    table = torch.tensor([[3, 1], [2, 0]])
    indptr, rows = blocktable.token_rows(table, torch.tensor([6, 3]), P)
    assert indptr.tolist() == [0, 6, 9]
    assert rows.tolist() == [12, 13, 14, 15, 4, 5, 8, 9, 10]


def test_reader_builds_rows_and_the_reference_reads_them(tmp_path):
    q, pool, table, seq = _case()
    path = tmp_path / "bt.safetensors"
    raw_write(path, {"q": q, "kv_buffer": pool, "seq_lens": seq, "block_table": table}, META)
    cap = read_capture(path)
    out, lse = mla_decode_ref(cap.q, cap.kv_buffer, cap.attended(), cap.scales())
    want, want_lse = dense_reference(q, pool, cap.kv_indptr, cap.kv_indices, 512, 0.125)
    assert torch.isfinite(out[[0, 2]]).all()  # the NaN rows (null block, page tails) are never read
    torch.testing.assert_close(out[[0, 2]].double(), want[[0, 2]], rtol=1e-9, atol=1e-9)
    assert cap.split_block == 1


def test_writer_keeps_whole_pages_and_the_physical_rows(tmp_path):
    q, pool, table, seq = _case()
    cap = read_capture(write_capture(tmp_path / "c.safetensors", dict(q=q, kv_buffer=pool, seq_lens=seq, block_table=table), META))
    assert cap.kv_buffer.shape[0] % P == 0 and cap.kv_buffer.shape[0] < pool.shape[0]
    assert torch.equal(cap.kv_buffer[cap.kv_indices.long()].nan_to_num(), pool[cap.orig_kv_indices.long()].nan_to_num())
    assert cap.warnings == []  # the padding null block is outside every sequence


def test_every_inconsistency_is_one_line(tmp_path):
    q, pool, table, seq = _case()
    table[0, 1] = -1  # -1 inside request 0
    table[2, 0] = 12  # past the 10-page pool
    seq[1] = 20  # request 1: 4 pages cover 16 positions
    path = tmp_path / "bad.safetensors"
    raw_write(path, {"q": q, "kv_buffer": pool, "seq_lens": seq, "block_table": table}, META)
    with pytest.raises(CaptureError) as e:
        read_capture(path)
    text = str(e.value)
    assert "tensor 'block_table'" in text and "3 inconsistencies" in text
    assert "\n" not in text  # one line for the CLI, one clause per inconsistency
    lines = text.split(": ", 3)[3].split("; ")
    assert len(lines) == 3
    assert any("block_table[0, 1]=-1" in l for l in lines)
    assert any("block_table[2, 0]=12 is past the pool (10 pages" in l for l in lines)
    assert any("request 1" in l and "seq_len 20 needs 5" in l for l in lines)


def test_null_block_inside_a_sequence_is_warned(tmp_path):
    q, pool, table, seq = _case()
    pool[1:P] = 1.0  # the null block holds garbage that is finite
    table[2, 1] = 0
    cap = read_capture(write_capture(tmp_path / "n.safetensors", dict(q=q, kv_buffer=pool, seq_lens=seq, block_table=table), META))
    assert any("request 2" in w and "null block 0" in w and "first 4" in w for w in cap.warnings)


def test_kv_indices_that_disagree_with_the_table_are_refused(tmp_path):
    q, pool, table, seq = _case()
    indptr, rows = blocktable.token_rows(table, seq, P)
    rows[3] = 39
    path = tmp_path / "dis.safetensors"
    raw_write(path, {"q": q, "kv_buffer": pool, "seq_lens": seq, "block_table": table, "kv_indptr": indptr,
                     "kv_indices": rows}, META)  # fmt: skip
    with pytest.raises(CaptureError, match="kv_indices\\[3\\]=39 but block_table gives row"):
        read_capture(path)


def test_bad_split_schedule_names_the_key(tmp_path):
    q, pool, table, seq = _case()
    path = tmp_path / "s.safetensors"
    raw_write(path, {"q": q, "kv_buffer": pool, "seq_lens": seq, "block_table": table}, {**META, "split_schedule": "x"})
    with pytest.raises(CaptureError, match="meta key 'split_schedule'"):
        read_capture(path)


def test_cli_exit_2_one_line_per_inconsistency(tmp_path):
    q, pool, table, seq = _case()
    table[0, 0] = 99
    path = tmp_path / "cli.safetensors"
    raw_write(path, {"q": q, "kv_buffer": pool, "seq_lens": seq, "block_table": table}, META)
    r = subprocess.run([sys.executable, "-m", "refmla", "inspect", str(path)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    assert "block_table[0, 0]=99 is past the pool" in r.stderr + r.stdout


def test_query_start_loc_must_cover_the_rows(tmp_path):
    q, pool, table, seq = _case()
    path = tmp_path / "qsl.safetensors"
    raw_write(path, {"q": q, "kv_buffer": pool, "seq_lens": seq, "block_table": table,
                     "query_start_loc": torch.tensor([0, 2], dtype=torch.int32)}, META)  # fmt: skip
    with pytest.raises(CaptureError, match="query_start_loc"):
        read_capture(path)


def test_attended_block_table_is_the_capture_layout(tmp_path):
    """Capture.attended() of a block-table capture is Attended.block_table: the rows the table names."""
    from refmla.attended import Attended

    q, pool, table, seq = _case()
    path = tmp_path / "att.safetensors"
    raw_write(path, {"q": q, "kv_buffer": pool, "seq_lens": seq, "block_table": table}, META)
    att = read_capture(path).attended()
    assert att.indptr.tolist() == [0, 6, 6, 16]
    assert att.group_rows(0).tolist() == [28, 29, 30, 31, 8, 9]  # pages 7 and 2 of 4 rows
    assert att.group_rows(2).tolist()[4:6] == [36, 37]  # page 9
    multi = Attended.block_table(table[[0]], seq[[0]], P, query_start_loc=torch.tensor([0, 2]))
    assert multi.causal_len.tolist() == [5, 6]  # two query rows, bottom-right causal

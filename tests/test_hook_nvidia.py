"""The SGLang hook on SGLang's NVIDIA block-table backends (FlashMLA): the token slots it records
are the block table's rows, and a table that cannot be read is a skip, never a raise."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from refmla.hook.call import Skip
from refmla.hook.config import BACKENDS, DEFAULT_BACKENDS, HookConfig
from refmla.hook.modes import decode_indices
from refmla.hook.sglang_paths import BACKEND_CLASSES


def _ctx(table, seq, page=64, rows=64 * 8):
    pool = torch.zeros(rows, 1, 576)
    return SimpleNamespace(
        q=torch.zeros(len(seq), 16, 576), md=SimpleNamespace(block_kv_indices=table),
        backend=SimpleNamespace(page_size=page), forward_batch=SimpleNamespace(seq_lens=torch.tensor(seq)),
        pool=SimpleNamespace(get_key_buffer=lambda layer_id: pool), layer=SimpleNamespace(layer_id=0),
    )  # fmt: skip


def test_block_kv_indices_become_token_slots():
    table = torch.tensor([[5, 2, -1], [7, -1, -1]], dtype=torch.int32)  # FlashMLA pads with -1
    idx = decode_indices(_ctx(table, [70, 3]))
    assert idx.kv_indptr.tolist() == [0, 70, 73]
    assert idx.kv_indices[:2].tolist() == [320, 321] and idx.kv_indices[64:70].tolist() == list(range(128, 134))
    assert idx.kv_indices[70:].tolist() == [448, 449, 450]


def test_an_unreadable_table_is_a_skip():
    table = torch.tensor([[5, -1]], dtype=torch.int32)
    with pytest.raises(Skip, match="block_table\\[0, 1\\]=-1 inside the sequence"):
        decode_indices(_ctx(table, [100]))


def test_flashmla_is_known_and_opt_in():
    assert "flashmla" in BACKENDS and "flashmla" not in DEFAULT_BACKENDS
    assert BACKEND_CLASSES["flashmla"][0][1] == "FlashMLABackend"
    assert HookConfig.from_env({"REFMLA_CAPTURE_DIR": "/tmp/x", "REFMLA_CAPTURE_BACKENDS": "flashmla"}).backends == {"flashmla"}

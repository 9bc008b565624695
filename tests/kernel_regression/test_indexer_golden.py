"""Every indexer golden (golden/indexer/: DeepSeek V3.2 fp8, V3.2 bf16, V4 C4) x every indexer backend:
``reference`` finds the stored set to be this machine's exact fp64 top-k and its k-th logits to round
to the stored fp32; SGLang's and vLLM's indexer code (and the DeepGEMM / tilelang / aiter adapters
where installed; skipped with the reason elsewhere) choose a set the set judge accepts. A kernel that
chooses wrong and a golden whose set was tampered with fail (the check can fail)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from refmla.golden import indexer as golden
from refmla.indexer import backends
from refmla.indexer.io import read_indexer, write_indexer

INDEXER_DIR = Path(__file__).resolve().parents[2] / "golden" / "indexer"
CASES = [c["file"] for c in golden.load_manifest(INDEXER_DIR)["cases"]]


@pytest.mark.parametrize("backend", golden.CHECK_BACKENDS)
@pytest.mark.parametrize("name", CASES)
def test_indexer_golden(name, backend):
    result = golden.check(INDEXER_DIR / name, backend)
    if result.status == "skipped":
        pytest.skip(f"{backend}: {result.reason}")
    assert result.passed, f"{name} {backend}: {result.reason}"


def test_indexer_goldens_regenerate_to_the_same_bytes(tmp_path):
    golden.generate(tmp_path)
    for name in CASES + [golden.MANIFEST]:
        assert (tmp_path / name).read_bytes() == (INDEXER_DIR / name).read_bytes(), name


def test_a_kernel_that_ignores_the_key_scales_fails_the_golden(monkeypatch):
    def no_scales(cap):  # the engine's own torch path over keys whose scales all read 1.0
        ps, D = cap.meta.page_size, cap.q.shape[2]
        k = cap.k_cache.clone()
        k[:, ps * D : ps * (D + 4)] = torch.ones(k.shape[0], ps).view(torch.uint8)
        return backends.vllm_indexer_torch(type(cap)(path=cap.path, meta=cap.meta, q=cap.q, weights=cap.weights,
                                                     k_cache=k, page_table=cap.page_table, seq_lens=cap.seq_lens,
                                                     indices=cap.indices))  # fmt: skip

    monkeypatch.setitem(backends.BACKENDS, "vllm_indexer_torch", no_scales)
    result = golden.check(INDEXER_DIR / "indexer-v32-fp8-h64.safetensors", "vllm_indexer_torch")
    assert result.status == "fail" and "chose the wrong entries" in result.reason


def test_a_tampered_golden_set_fails_the_reference_self_check(tmp_path):
    cap = read_indexer(INDEXER_DIR / "indexer-v4-c4-h64.safetensors")
    idx = cap.indices.clone()
    row = int(torch.argmax(cap.seq_lens))  # a request with more entries than K: one chosen entry swapped out
    left_out = sorted(set(range(int(cap.entries[row]))) - set(idx[row].tolist()))[0]
    idx[row, 0] = left_out
    tensors = {k: getattr(cap, k) for k in ("q", "weights", "k_cache", "page_table", "seq_lens")}
    write_indexer(tmp_path / "t.safetensors", {**tensors, "indices": idx}, cap.meta.to_json())
    result = golden.check(tmp_path / "t.safetensors", "reference")
    assert result.status == "fail" and f"request {row}" in result.reason

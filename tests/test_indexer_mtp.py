"""MTP / speculative decode in the indexer kind: N query tokens per request (q [B, N, H, D]; weights
and indices one row a token, request-major, as SGLang and vLLM flatten them), each token its own
causal bound (seq_len - N + 1 + t). The calls are SGLang's own decode indexer over the rows (its
torch paged logits, block table repeated per token, each token's context length, then its top-k
transform), the cache built by SGLang's helpers (tests/indexer_kit.py); the wrong bound is planted
by the test's own code."""

from __future__ import annotations

import pytest
import torch

import indexer_kit as kit
from helpers import raw_write
from refmla.capture import CaptureError
from refmla.compare import Tolerance
from refmla.context import ReplayOptions
from refmla.indexer.io import read_indexer
from refmla.indexer.judge import judge_indexer

SEQ, N, K = [100, 700, 1333], 3, 256


def mtp_call(path, seed=0, whole_length=False, kind="positions"):
    """An MTP indexer call written to ``path``; ``whole_length``: every token scored to the request's
    full length (the earlier tokens see entries past their own bound)."""
    _, ind = kit.sglang()
    t, meta = kit.call(SEQ, topk=K, seed=seed, kind=kind)  # the fp8 cache, its pages, q's dtype and scale folding
    B, H, D = t["q"].shape
    g = torch.Generator().manual_seed(seed + 7)
    q = (torch.randn(B, N, H, D, generator=g) * 2).to(torch.float8_e4m3fn)
    w = torch.randn(B * N, H, generator=g) * H**-0.5 * D**-0.5
    seq = torch.tensor(SEQ)
    own = (seq[:, None] - N + 1 + torch.arange(N)[None, :]).reshape(-1)  # [B * N] each token's context
    lens = seq.repeat_interleave(N) if whole_length else own
    table = t["page_table"].repeat_interleave(N, 0)  # one row a token, as SGLang's split path hands it over
    kv = t["k_cache"].view(t["k_cache"].shape[0], kit.PS, 1, D + 4)
    logits = ind.fp8_paged_mqa_logits_torch(q.view(B * N, 1, H, D), kv, w.float(), lens.int(), table.clamp(min=0), None,
                                            table.shape[1] * kit.PS, clean_logits=False)  # fmt: skip
    slots, raw = (torch.empty(B * N, K, dtype=torch.int32) for _ in range(2))
    ind.topk_transform_pytorch_vectorized(logits, lens.int(), table.clamp(min=0), slots, kit.PS, out_raw_indices=raw)
    t.update(q=q, weights=w.float(), indices=raw if kind == "positions" else slots)
    raw_write(path, t, meta)
    return path


def judged(path, backends=()):
    return judge_indexer(read_indexer(path), ReplayOptions(backends=list(backends), tol=Tolerance()))


@pytest.mark.parametrize("kind", ["positions", "slots"])
def test_a_clean_mtp_call_agrees_row_by_row_and_the_engines_code_too(tmp_path, kind):
    r = judged(mtp_call(tmp_path / "m.safetensors", seed=1, kind=kind), ["sglang_indexer_torch", "vllm_indexer_torch"])
    assert r.verdict == "agree", r.diagnosis_text
    assert r.kind_keys["query_tokens"] == N and r.backends["observed"].info["index_sets"]["requests"] == len(SEQ) * N
    assert all(r.backends[n].status == "pass" for n in ("sglang_indexer_torch", "vllm_indexer_torch"))


def test_every_token_scored_to_the_whole_length_fails_the_earlier_tokens_only(tmp_path):
    r = judged(mtp_call(tmp_path / "m.safetensors", seed=2, whole_length=True))
    assert r.verdict == "diverged" and r.diagnosis == "indexer"
    failing = r.backends["observed"].info["index_sets"]["failing_requests"]  # rows b * N + t
    assert {0 * N + t for t in range(N - 1)} <= set(failing)  # request 0 (100 < K entries): every earlier token
    assert not any(row % N == N - 1 for row in failing)  # the last token's bound is the whole length: right
    assert "request 0 token 0" in r.diagnosis_text and "past bound" in r.diagnosis_text


def test_an_mtp_capture_with_a_row_per_request_is_refused_naming_the_tensor(tmp_path):
    path = mtp_call(tmp_path / "m.safetensors", seed=3)
    cap = read_indexer(path)
    t = {k: getattr(cap, k) for k in ("q", "k_cache", "page_table", "seq_lens", "indices")}
    raw_write(tmp_path / "bad.safetensors", {**t, "weights": cap.weights[::N].contiguous()}, cap.meta.to_json())
    with pytest.raises(CaptureError, match="tensor 'weights'.*9 rows"):
        read_indexer(tmp_path / "bad.safetensors")

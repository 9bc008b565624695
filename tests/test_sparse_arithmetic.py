"""Each sparse decode kernel is judged at its own declared arithmetic (refmla.sparse.arithmetic), as
the dense kernels are: its own output on a clean capture passes, the entry names the declaration it
was judged at, observed is judged at the producer's, and a kernel is never given another kernel's
looser allowance. The kernels' outputs are this file's own emulations of their arithmetic, written
from their sources (SGLang's Triton sparse decode, SGLang's tilelang ``dpsk_v4_fp8_attention_fwd``,
aiter's ``pa_decode_sparse``, FlashMLA's sparse decode), never refmla's control."""

from __future__ import annotations

import math

import pytest
import torch

from refmla.options import ReplayOptions
from refmla.pipeline import replay_file
from refmla.sparse import backends as sparse_backends
from refmla.sparse.arithmetic import (AITER_SPARSE, DECLARED, FLASHMLA_SPARSE, SGLANG_TRITON_SPARSE, TILELANG_SPARSE,
                                      SparseArithmetic)
from refmla.sparse.backends import PathOutput
from refmla.sparse.presets import sparse_preset
from refmla.sparse.synth import build_case
from refmla.sparse.validation import write_sparse

V4 = "deepseek-v4-flash-tp8"
BF16 = torch.bfloat16


def entries(case, b: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Request b's list of each cache as the kernel walks it: (keys [K, D] fp32, read [K] bool), list
    positions kept (-1 and past topk_length not read). V4 keys are fp8 times a power of two: exact
    in bf16, so the quantizer's values are the kernel's bf16 keys."""
    out = []
    for pool, idx, ln in ((case.main, case.indices, case.topk_length), (case.extra, case.extra_indices, case.extra_topk_length)):
        if pool is None:
            continue
        i = idx[b, 0].long()  # [K]
        read = (i != -1) & (torch.arange(i.numel()) < int(ln[b]))
        out.append((pool.values[i.clamp(min=0)].nan_to_num(0.0).float(), read))
    return out


def online(q: torch.Tensor, k: torch.Tensor, read: torch.Tensor, scale: float, dv: int):
    """One pass over k [K, D] for q [H, D] (bf16 values): P.V accumulator [H, Dv] with P in bf16, l, m (fp32)."""
    s = (q @ k.T) * scale  # [H, K] fp32
    s = s.masked_fill(~read[None], -math.inf)
    m = s.amax(-1)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(s - m[:, None])
    return p.to(BF16).float() @ k[:, :dv], p.sum(-1), m


def emulate(case, kernel: str) -> PathOutput:
    """out [B, 1, H, Dv] bf16 (and lse [B, 1, H] fp32 where the kernel returns one), per kernel."""
    p = case.preset
    B, H, dv = case.q.shape[0], case.q.shape[2], p.head_dim_v
    sink = case.sink.float() if case.sink is not None else torch.full((H,), -math.inf)
    out, lse = torch.zeros(B, 1, H, dv, dtype=BF16), torch.zeros(B, 1, H)
    for b in range(B):
        q = case.q[b, 0].to(BF16).float()
        lists = entries(case, b)
        if kernel in ("triton", "aiter_sparse"):  # SGLang's Triton: one pass; aiter: 4 fp32 split-K partials, one reduce
            k, read = torch.cat([x[0] for x in lists]), torch.cat([x[1] for x in lists])
            chunks = 1 if kernel == "triton" else 4
            parts = [online(q, kc, rc, p.softmax_scale, dv) for kc, rc in zip(k.chunk(chunks), read.chunk(chunks))]
            M = torch.stack([m for _, l, m in parts]).amax(0)
            acc = sum(a * torch.exp(m - M)[:, None] for a, l, m in parts)
            l = sum(l * torch.exp(m - M) for a, l, m in parts)
            o = acc / torch.where(l + torch.exp(sink - M) == 0, 1.0, l + torch.exp(sink - M))[:, None]
            ls = M + torch.log(torch.where(l == 0, 1.0, l))
        else:  # tilelang: 64-position splits of each list, output bf16; FlashMLA: 128-position splits, fp32
            size, store = (64, BF16) if kernel == "tilelang" else (128, torch.float32)
            outs, lses = [], []
            for k, read in lists:
                for kc, rc in zip(k.split(size), read.split(size)):
                    a, l, m = online(q, kc, rc, p.softmax_scale, dv)
                    outs.append((a / torch.where(l == 0, 1.0, l)[:, None]).to(store).float())
                    lses.append(torch.where(l == 0, -math.inf, m + torch.log(torch.where(l == 0, 1.0, l))))
            L = torch.stack(lses)  # [n, H]
            top = L.amax(0)
            top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
            w = torch.exp(L - top)
            o = (w[..., None] * torch.stack(outs)).sum(0) / torch.where(w.sum(0) == 0, 1.0, w.sum(0))[:, None]
            ls = top + torch.log(torch.where(w.sum(0) == 0, 1.0, w.sum(0)))
            o = o / (1.0 + torch.exp(sink - ls))[:, None]
        lonely = ~torch.cat([x[1] for x in lists]).any()
        out[b, 0] = torch.zeros_like(o).to(BF16) if lonely else o.to(BF16)
        lse[b, 0] = math.inf if lonely else ls
    return PathOutput(out, None if kernel == "aiter_sparse" else lse, f"emulated {kernel}")


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    case = build_case(sparse_preset(V4))
    path = tmp_path_factory.mktemp("arith") / "clean.safetensors"
    o = emulate(case, "triton")  # the producer: SGLang's Triton kernel (meta backend "synth" reads as it)
    write_sparse(path, {**case.tensors(), "out": o.out, "lse": o.lse}, case.meta())
    return case, path


def replay_as(monkeypatch, path, outputs: dict):
    for name, got in outputs.items():
        monkeypatch.setitem(sparse_backends.BACKENDS, name, lambda cap, got=got: got)
    return replay_file(str(path), ReplayOptions(backends=["reference", "observed", *outputs], explain=False))


def test_the_declarations_are_the_ones_read_from_each_kernel():
    assert DECLARED == {"triton": SGLANG_TRITON_SPARSE, "tilelang": TILELANG_SPARSE, "aiter_sparse": AITER_SPARSE,
                        "flashmla_sparse": FLASHMLA_SPARSE}  # fmt: skip
    common = {"q_dtype": "bfloat16", "key_dtype": "bfloat16", "p_dtype": "bfloat16", "accum": "float32", "out_dtype": "bfloat16"}
    for a in DECLARED.values():
        assert {k: v for k, v in a.to_json().items() if k in common} == common
    assert [(a.partials, a.group, a.lse_base) for a in DECLARED.values()] == [
        ("none", 0, "ln"), ("bf16", 64, "ln"), ("fp32", 0, "none"), ("fp32", 0, "ln")]
    with pytest.raises(ValueError):
        SparseArithmetic(partials="bf16")  # bf16 partials need their split size


@pytest.mark.parametrize("kernel", sorted(DECLARED))
def test_each_kernels_own_output_on_clean_data_passes_at_its_declaration(monkeypatch, clean, kernel):
    case, path = clean
    r = replay_as(monkeypatch, path, {kernel: emulate(case, kernel)})
    e = r.backends[kernel]
    assert r.verdict == "agree" and e.status == "pass", (e.status, e.reason)
    assert e.info["arithmetic"] == DECLARED[kernel].to_json()
    assert (e.lse is None) == (kernel == "aiter_sparse") and (e.lse is None or e.lse.status == "pass")


def test_a_kernel_is_not_given_another_kernels_looser_allowance(monkeypatch, clean):
    """The same output (rounded as tilelang rounds) returned by triton, flashmla_sparse and tilelang:
    tilelang's bf16 split partials make its control noisier, so its allowance is wider; triton's is
    its own (flashmla_sparse's one-pass-equivalent declaration gives the very same), never tilelang's."""
    case, path = clean
    got = emulate(case, "tilelang")
    r = replay_as(monkeypatch, path, {"triton": got, "flashmla_sparse": got, "tilelang": got})
    t, f, tl = (r.backends[n].comparison for n in ("triton", "flashmla_sparse", "tilelang"))
    assert [r.backends[n].info["arithmetic"]["partials"] for n in ("triton", "flashmla_sparse", "tilelang")] == ["none", "fp32", "bf16"]
    assert torch.equal(t.row_tol, f.row_tol) and not torch.equal(t.row_tol, tl.row_tol)
    assert float(tl.row_tol.sum()) > float(t.row_tol.sum())  # wider in all, at tilelang's own arithmetic only
    assert t.worst.ratio > tl.worst.ratio  # the same error is a larger share of triton's allowance


def test_observed_is_judged_at_the_producers_declaration(monkeypatch, tmp_path):
    case = build_case(sparse_preset(V4))
    for producer, want in (("tilelang", TILELANG_SPARSE), ("flashmla", FLASHMLA_SPARSE), ("synth", SGLANG_TRITON_SPARSE)):
        kernel = {"flashmla": "flashmla_sparse", "synth": "triton"}.get(producer, producer)
        o = emulate(case, kernel)
        path = tmp_path / f"{producer}.safetensors"
        write_sparse(path, {**case.tensors(), "out": o.out, "lse": o.lse}, case.meta(backend=producer))
        obs = replay_file(str(path), ReplayOptions(backends=["reference", "observed"])).backends["observed"]
        assert obs.status == "pass" and obs.info["arithmetic"] == want.to_json(), (producer, obs.reason)

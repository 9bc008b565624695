"""A kernel's own arithmetic, declared by its backend (docs/contract.md section 5, issue 27).

Each kernel splits, rounds and logs in its own way; a replay judges it against a control built
from what it declares, never from what the capture's producer did:

    split_schedule  "sglang"   SGLang's Triton: splits of ceil(ceil(L / n) / 32) * 32 tokens
                    "uniform"  vLLM's TRITON_MLA: ceil(L / n) tokens, one batch-wide n
                    "none"     one pass over the whole sequence (extend, flex, the paged kernels)
    q_round         "latent_to_pool"  the latent part of q rounded to a narrower pool's dtype
                                      (SGLang's ``q.to(K_Buffer.dtype)``; the rope part meets K upcast)
                    "keep"            q kept as stored (vLLM's Triton: K is dequantized to q's dtype)
                    "whole_e4m3"      all of q quantized to e4m3 with a per-tensor scale
                                      (FlashMLA / TRT-LLM fp8 paths, the ``kernel_q_dtype`` hook key)
                    "whole_to_pool"   all of q, the rope part too, cast unscaled to a narrower pool's
                                      dtype where it meets the pool's K (SGLang's extend kernel over
                                      the cached prefix: ``q.to(k.dtype)``, ``qpe.to(kpe.dtype)``)
    dequant         "upcast"          an fp8 K / V upcast as stored, k_scale on the logits and
                                      v_scale on the output; P rounded to the pool dtype before P.V
                    "to_q_dtype"      K and V dequantized on load and rounded to q's dtype,
                                      ``(fp8 * scale).to(q.dtype)``; P rounded to q's dtype (vLLM,
                                      flex_attention)
                    "new_to_q_dtype"  the cached prefix as ``upcast``; the call's new tokens (the last
                                      n_b positions of request b, its n_b query rows; decode: the
                                      last one) arrive dequantized to q's dtype, as an extend
                                      kernel's ``k_extend`` / ``v_extend``: met by q as stored,
                                      P rounded to q's dtype (SGLang's extend; an unsplit kernel only)
    lse_base        "ln" | "log2"     the base of the lse the kernel returns (compared in ln)
    p_block         None              P rounded (to the pool / value dtype) relative to the row's final
                                      maximum, as one softmax pass over the row computes it
                    n                 an online softmax over blocks of n positions from each split's
                                      start (Triton's BLOCK_N): block i's P is rounded relative to the
                                      running maximum of blocks 0..i, then rescaled to the final one
                                      (SGLang's Triton decode: 32; 16 on HIP for a 576-wide head)

The capture's producer has one too (:func:`producer_arithmetic`): it describes only ``observed``
and is the control of a backend that declares none.
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass
from typing import Optional

import torch

from refmla.schedule import SGLANG_BLOCK_N, SPLIT_BLOCKS

FP8_E4M3 = torch.float8_e4m3fn
FP8_E4M3_MAX = 448.0  # the largest finite e4m3fn value
SCHEDULES = ("sglang", "uniform", "none")
Q_ROUNDS = ("latent_to_pool", "keep", "whole_e4m3", "whole_to_pool")
DEQUANTS = ("upcast", "to_q_dtype", "new_to_q_dtype")
LSE_BASES = ("ln", "log2")
# one base, two spellings (decode captures and backends say ln / log2, merge captures e / 2): either is
# accepted wherever an lse base is read, and names the same base
LSE_BASE_ALIASES = {"ln": "ln", "e": "ln", "log2": "log2", "2": "log2"}


def lse_base_of(value) -> Optional[str]:
    """The canonical name ("ln" | "log2") of an lse base in either spelling; None when it is neither."""
    return LSE_BASE_ALIASES.get(value) if isinstance(value, str) else None


@dataclass(frozen=True)
class Arithmetic:
    """Where a kernel splits and rounds, and the base of its lse (the module docstring lists the values)."""

    split_schedule: str = "sglang"
    q_round: str = "latent_to_pool"
    dequant: str = "upcast"
    lse_base: str = "ln"
    p_block: Optional[int] = None  # positions per online-softmax block (None: one pass over the row)

    def __post_init__(self):
        for name, allowed in (("split_schedule", SCHEDULES), ("q_round", Q_ROUNDS), ("dequant", DEQUANTS),
                              ("lse_base", LSE_BASES)):  # fmt: skip
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}")
        if self.dequant == "new_to_q_dtype" and self.split_schedule != "none":
            raise ValueError("dequant new_to_q_dtype (an extend kernel's new tokens) is for an unsplit kernel")
        if self.p_block is not None and (isinstance(self.p_block, bool) or not isinstance(self.p_block, int)
                                         or self.p_block < 1):  # fmt: skip
            raise ValueError(f"p_block must be a positive int or None, got {self.p_block!r}")

    @property
    def split_block(self) -> Optional[int]:
        """The split granularity (32 SGLang, 1 vLLM), None for an unsplit kernel."""
        return SPLIT_BLOCKS.get(self.split_schedule)

    def to_json(self) -> dict:
        """The fields; ``p_block`` only where a kernel declares one (one softmax pass says nothing new)."""
        d = asdict(self)
        if self.p_block is None:
            del d["p_block"]
        return d


# SGLang's Triton decode (refmla.backends.triton): 32-token splits, its stage 1 an online softmax over
# BLOCK_N = 32 positions (on CUDA and in the interpreter; the backend declares the block it ran)
SGLANG_TRITON = Arithmetic(p_block=SGLANG_BLOCK_N)
VLLM_TRITON = Arithmetic(split_schedule="uniform", q_round="keep", dequant="to_q_dtype")
UNSPLIT = Arithmetic(split_schedule="none")
# PyTorch's flex_attention (refmla.backends.flex): one pass in q's dtype, an fp8 pool dequantized into it
FLEX_ATTENTION = Arithmetic(split_schedule="none", q_round="keep", dequant="to_q_dtype")
# SGLang's Triton extend (refmla.backends.extend): one pass; over an fp8 prefix q rounded whole to the pool dtype,
# K / V upcast, P in the pool dtype; the new tokens' K / V in q's dtype, met by q as stored
SGLANG_EXTEND = Arithmetic(split_schedule="none", q_round="whole_to_pool", dequant="new_to_q_dtype")


def quantize_q(q: torch.Tensor) -> tuple[torch.Tensor, float]:
    """(q in e4m3 [B, H, D], its dequant scale) as the engines quantize q for an fp8 cache
    (``whole_e4m3``): scale 1 (vLLM's default ``_q_scale``; SGLang's TRT-LLM path casts, unscaled);
    amax / 448 only where q would saturate e4m3."""
    amax = float(q.float().abs().max()) if q.numel() else 0.0
    scale = amax / FP8_E4M3_MAX if amax > FP8_E4M3_MAX else 1.0
    return (q.float() / scale).to(FP8_E4M3), scale


def producer_arithmetic(cap) -> Arithmetic:
    """The arithmetic of the kernel that wrote the capture's ``out`` (the ``observed`` backend):
    vLLM's TRITON_MLA for a vLLM capture, SGLang's extend kernel for an extend or verify capture of
    SGLang's Triton backend (it runs extend_attention_fwd), else the capture's ``split_schedule``
    (SGLang's by default) with q quantized whole where the hook saw it go in as e4m3; the lse base
    of meta ``lse_base``; a decode capture of SGLang's Triton backend with its stage-1 online softmax
    (``p_block`` SGLANG_BLOCK_N: the hook does not record a HIP launch's 16)."""
    m = cap.meta
    base = lse_base_of(m.extra.get("lse_base", "ln")) or "ln"  # an unknown spelling is refused when read
    vllm = m.backend == "vllm_triton" or m.engine_backend == "TRITON_MLA"
    if not vllm and not cap.is_decode and m.backend in (None, "triton"):
        return dataclasses.replace(SGLANG_EXTEND, lse_base=base)
    e4m3_q = m.extra.get("kernel_q_dtype") == "float8_e4m3fn" and cap.kv_buffer.dtype.itemsize == 1
    q_round = "whole_e4m3" if e4m3_q else ("keep" if vllm else "latent_to_pool")
    p_block = SGLANG_BLOCK_N if m.backend == "triton" and cap.is_decode and not vllm else None
    return Arithmetic(m.split_schedule or "sglang", q_round, "to_q_dtype" if vllm else "upcast", base, p_block)


__all__ = ["Arithmetic", "DEQUANTS", "FLEX_ATTENTION", "FP8_E4M3", "FP8_E4M3_MAX", "quantize_q", "LSE_BASES",
           "LSE_BASE_ALIASES", "lse_base_of", "Q_ROUNDS", "SCHEDULES", "SGLANG_EXTEND",
           "SGLANG_TRITON", "UNSPLIT", "VLLM_TRITON",
           "producer_arithmetic"]  # fmt: skip

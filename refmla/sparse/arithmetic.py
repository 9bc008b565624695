"""What each sparse decode kernel declares of its arithmetic, read from its source; its control (the
tolerance's noise floor, refmla.sparse.reference.sparse_control) is built from the declaration, never
from another kernel's (docs/contract.md section 5, per-backend arithmetic).

Every sparse kernel read so far does the same inside one pass: q in bf16, each key decoded to bf16
(fp8 times its tile's scale), q.k accumulated in fp32, P = exp(s - m) in fp32 rounded to bf16 before
P.V, l and the P.V accumulator in fp32. They differ in what they do between passes and at the end:

    partials   "none"  one pass over the row's entries (SGLang's Triton ``triton_fp8_attention_fwd``)
               "fp32"  split-K partials kept in fp32 and merged in fp32 (aiter's ``pa_decode_sparse``:
                       acc / m / l partials fp32, a reduce kernel; FlashMLA's sparse decode: o_accum
                       and lse_accum fp32, its combine kernel): below the output's rounding, so the
                       control computes them as one pass
               "bf16"  each split's normalized output stored in bf16, its lse in fp32, merged in fp32
                       (SGLang's tilelang ``dpsk_v4_fp8_attention_fwd``: Partial_O bf16, the combine
                       kernel); ``group`` entries of each cache per split (its block_I 64, the finest
                       split it makes)
    out_dtype  the dtype the output is stored in (bf16 for all four)
    lse_base   "ln" the lse returned in natural log (Triton, tilelang's combine, FlashMLA);
               "none" no lse returned (aiter's ``pa_decode_sparse`` returns out only)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

PARTIALS = ("none", "fp32", "bf16")
SPARSE_LSE_BASES = ("ln", "log2", "none")


@dataclass(frozen=True)
class SparseArithmetic:
    """Where a sparse kernel rounds (the module docstring lists the values)."""

    q_dtype: str = "bfloat16"  # q as the kernel reads it
    key_dtype: str = "bfloat16"  # each key: fp8 -> bf16 times its scale, rounded to bf16
    p_dtype: str = "bfloat16"  # P rounded to it before P.V
    accum: str = "float32"  # q.k, l and the P.V accumulator
    partials: str = "none"
    group: int = 0  # entries of one cache per split (partials "bf16")
    out_dtype: str = "bfloat16"
    lse_base: str = "ln"

    def __post_init__(self):
        if self.partials not in PARTIALS or self.lse_base not in SPARSE_LSE_BASES:
            raise ValueError(f"partials one of {PARTIALS}, lse_base one of {SPARSE_LSE_BASES}: got {self.partials!r}, {self.lse_base!r}")
        if (self.partials == "bf16") != (self.group > 0):
            raise ValueError("a split size (group) goes with bf16 partials, and only with them")

    @property
    def one_pass(self) -> bool:
        """The control computes one pass (fp32 partials round below the output's dtype)."""
        return self.partials != "bf16"

    def to_json(self) -> dict:
        return asdict(self)


SGLANG_TRITON_SPARSE = SparseArithmetic()
TILELANG_SPARSE = SparseArithmetic(partials="bf16", group=64)
AITER_SPARSE = SparseArithmetic(partials="fp32", lse_base="none")
FLASHMLA_SPARSE = SparseArithmetic(partials="fp32")

# each kernel path's declaration; meta ``backend`` (the producer) -> the same, for ``observed``
DECLARED = {"triton": SGLANG_TRITON_SPARSE, "tilelang": TILELANG_SPARSE, "aiter_sparse": AITER_SPARSE,
            "flashmla_sparse": FLASHMLA_SPARSE}  # fmt: skip
PRODUCERS = {"triton": SGLANG_TRITON_SPARSE, "tilelang": TILELANG_SPARSE, "aiter_sparse": AITER_SPARSE,
             "flashmla": FLASHMLA_SPARSE}  # fmt: skip


def producer_sparse_arithmetic(backend) -> SparseArithmetic:
    """The arithmetic of the kernel meta ``backend`` names (it wrote ``observed``); SGLang's Triton
    kernel's for any other (``torch``, ``aiter``, ``synth``, ``unknown``, none)."""
    return PRODUCERS.get(backend, SGLANG_TRITON_SPARSE)


__all__ = ["AITER_SPARSE", "DECLARED", "FLASHMLA_SPARSE", "PARTIALS", "PRODUCERS", "SGLANG_TRITON_SPARSE", "SparseArithmetic",
           "TILELANG_SPARSE", "producer_sparse_arithmetic"]  # fmt: skip

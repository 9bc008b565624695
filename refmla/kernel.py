"""Bring your own kernel: the interface an MLA decode kernel outside refmla is checked through
(docs/own-kernel.md; docs/contract.md section 9). Stable across refmla releases: fields are only
ever added, with defaults, never renamed or removed.

A kernel is a callable ``fn(inputs: KernelInputs) -> KernelOutputs`` (or the ``out`` tensor
alone). refmla hands it one captured decode call in the layout it declares (:class:`KernelSpec`,
set with :func:`declare`), converting when the capture has the other one:

    token_slots   SGLang's kv_indptr [B + 1] int32 / kv_indices [sum L] int64: position j of request
                  b is pool row kv_indices[kv_indptr[b] + j] (a block-table capture: its token rows)
    block_table   vLLM's block_table [B, M] int32 of pages of page_size rows: position j of request
                  b is row block_table[b, j // page_size] * page_size + j % page_size
                  (a token-slot capture: a page-size-1 table of its slots, as vLLM's ROCm AITER MLA)

A kernel may also declare qlen > 1 (``modes=("decode", "verify")``: speculative verify, each
request's query rows ``q[qo_indptr[b]:qo_indptr[b + 1]]``, causal over the request's last
positions, or a tree mask where it declares ``tree_mask``), or the sparse top-k layout
(``layout="sparse_topk"``: DeepSeek V3.2 / V4 sparse decode, handed :class:`SparseKernelInputs`:
the packed fp8 caches as stored, their exact decode, FlashMLA-shaped top-k indices with -1 padding).

refmla judges what it returns exactly as it judges refmla's own backends (isolation in a child
process, repeats, the control at the arithmetic it declares, localization, explanation, JSON).
Everything is a plain tensor on ``inputs.device``; the buffers are allocated by refmla and filled
with NaN (the sweep's ``nan_fill`` check) or 0 first: a kernel may write them and return them,
or return tensors of its own.

The shapes: B requests, H heads, D = kv_lora_rank + rope dims (576 for DeepSeek / Kimi), Dv =
kv_lora_rank (512), N pool rows, S = max_kv_splits. V is the first Dv columns of the pool rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from refmla.arithmetic import Arithmetic

LAYOUTS = ("token_slots", "block_table", "sparse_topk")
MODES = ("decode", "verify")  # the dense capture modes a kernel may declare (sparse_topk: sparse decode captures)
SPEC_ATTR = "refmla_kernel"  # the attribute declare() sets on the callable


class InterfaceError(ValueError):
    """A callable that does not meet this interface (its signature, what it returned): one line
    naming what it gave against what was expected. The command line exits 2 on it."""


@dataclass(frozen=True)
class KernelSpec:
    """What a kernel declares before it runs (default: token slots, SGLang's split schedule)."""

    layout: str = "token_slots"  # LAYOUTS: the index layout it reads
    # where it splits and rounds, and its lse base (refmla.arithmetic): its control is built from
    # this; a KernelOutputs.arithmetic overrides it per call
    arithmetic: Arithmetic = field(default_factory=Arithmetic)
    writes_buffers: bool = True  # it writes the buffers it is handed (the sweep's nan_fill check applies)
    defines_empty_rows: bool = False  # a zero-length request's output row is defined (compared) or not
    modes: tuple = ("decode",)  # MODES it takes: "verify" adds qlen > 1 (KernelInputs.qo_indptr, causal)
    tree_mask: bool = False  # verify: it reads a tree mask too (custom_mask / mask_indptr); else a tree capture is skipped
    # sparse_topk: its refmla.sparse.arithmetic.SparseArithmetic (None: SGLang's Triton sparse kernel's)
    sparse_arithmetic: Any = None
    applies_inv_rope: bool = False  # sparse_topk: it applies inv_rope itself (else refmla does, to what it returns)

    def __post_init__(self):
        if self.layout not in LAYOUTS:
            raise InterfaceError(f"KernelSpec layout must be one of {', '.join(LAYOUTS)}, got {self.layout!r}")
        if not self.modes or any(m not in MODES for m in self.modes):
            raise InterfaceError(f"KernelSpec modes must be some of {', '.join(MODES)}, got {self.modes!r}")
        if not isinstance(self.arithmetic, Arithmetic):
            raise InterfaceError(f"KernelSpec arithmetic must be a refmla.arithmetic.Arithmetic, got {type(self.arithmetic).__name__}")


@dataclass(frozen=True)
class KernelInputs:
    """One decode (or verify) call, as the kernel asked for it. R query rows: B in decode, the
    requests' query tokens (qo_indptr[-1]) in verify."""

    layout: str  # "token_slots" | "block_table"
    q: torch.Tensor  # [R, H, D] the absorbed query (q_nope @ w_kc | q_pe), the capture's dtype
    kv_buffer: torch.Tensor  # [N, 1, D] latent KV pool rows (bf16, fp16, fp32 or fp8); V = [..., :Dv]
    seq_lens: torch.Tensor  # [B] int32 tokens attended per request (verify: its drafts included)
    kv_indptr: Optional[torch.Tensor]  # [B + 1] int32 (token_slots; None for block_table)
    kv_indices: Optional[torch.Tensor]  # [sum L] int64 pool rows in position order (token_slots)
    block_table: Optional[torch.Tensor]  # [B, M] int32 pages (block_table; None for token_slots)
    page_size: int  # rows per page of block_table (1 for token_slots)
    num_kv_splits: torch.Tensor  # [B] int32 split count per request (the capture's, else SGLang's rule)
    max_kv_splits: int  # S: the split buffers' width
    kv_lora_rank: int  # Dv
    sm_scale: float  # softmax scale as production passed it (yarn mscale included)
    logit_cap: float  # tanh soft cap, 0: off
    k_scale: float  # an fp8 pool's K dequant scale (multiplies the logits), 1 otherwise
    v_scale: float  # an fp8 pool's V dequant scale (multiplies the output), 1 otherwise
    out: torch.Tensor  # [R, H, Dv] buffer in the dtype production stores the output in
    lse: torch.Tensor  # [R, H] fp32 buffer: natural log of the scaled logits' sum-exp
    attn_logits: torch.Tensor  # [R, H, S, Dv] fp32 buffer: each split's normalized partial, before v_scale
    attn_lse: torch.Tensor  # [R, H, S] fp32 buffer: each split's lse
    mode: str = "decode"  # "decode" (R = B) | "verify" (qlen > 1)
    # verify: request b's query rows are q[qo_indptr[b]:qo_indptr[b + 1]] (n_b of them); causal: its
    # query i sees positions 0 .. seq_lens[b] - n_b + i
    qo_indptr: Optional[torch.Tensor] = None  # [B + 1] int32 (verify; None in decode)
    # a tree verify (a kernel that declares tree_mask): row i of request b sees position j where
    # custom_mask[mask_indptr[b] + i * seq_lens[b] + j] (uint8 / bool, row-major [n_b, L_b])
    custom_mask: Optional[torch.Tensor] = None
    mask_indptr: Optional[torch.Tensor] = None  # [B + 1] int32

    @property
    def device(self) -> torch.device:
        return self.q.device


@dataclass(frozen=True)
class SparseKernelInputs:
    """One sparse decode call (layout ``sparse_topk``): DeepSeek V3.2 DSA or V4 (a window cache and
    optionally a compressed one). B requests, S query tokens each (MTP), H heads, K top-k entries.
    The caches are handed as stored (what FlashMLA's and SGLang's sparse kernels read) and decoded
    (``k_values``: each token's value in fp32, fp8 x its tile's scale and the bf16 rope, exact for
    the power-of-two scales the writers store); a kernel reads whichever it wants. refmla allocates
    no buffer: the kernel returns out [B, S, H, Dv] bf16 and, optionally, lse [B, S, H] (ln, the
    sink not included, +inf on a row with no valid entry)."""

    layout: str  # "sparse_topk"
    q: torch.Tensor  # [B, S, H, D] bf16 (D: 576 v32, 512 v4)
    k_cache: torch.Tensor  # [P, page_size, 1, bytes_per_token] uint8 pages as stored (v32: 656, v4: 584 bytes a token)
    k_values: torch.Tensor  # [P * page_size, D] fp32: token t = page * page_size + offset, decoded
    kv_layout: str  # "v32" | "v4" (refmla.sparse.layouts: the packing)
    page_size: int
    kv_fp8_dtype: str  # "float8_e4m3fn" | "float8_e4m3fnuz"
    indices: torch.Tensor  # [B, S, K] int32 flat token indices into k_cache; -1: no entry
    topk_length: Optional[torch.Tensor]  # [B] int32: entries at position >= topk_length[b] are not read (None: all)
    attn_sink: Optional[torch.Tensor]  # [H] fp32: adds exp(sink - max) to each row's denominator (None: no sink)
    extra_k_cache: Optional[torch.Tensor]  # the compressed cache (V4 C4 / C128), as k_cache; None without one
    extra_k_values: Optional[torch.Tensor]  # its decoded values, as k_values
    extra_kv_layout: Optional[str]
    extra_page_size: Optional[int]
    extra_indices: Optional[torch.Tensor]  # [B, S, K2] int32 into extra_k_cache, -1: no entry
    extra_topk_length: Optional[torch.Tensor]  # [B] int32
    softmax_scale: float  # as passed to production's kernel
    head_dim_v: int  # Dv (512): out is the first Dv columns of the values (v32), all 512 (v4)
    # SGLang's inv_rope (a kernel declaring applies_inv_rope applies it; else refmla applies it to out)
    inv_rope_freqs: Optional[torch.Tensor] = None  # [M, d_rope]
    inv_rope_positions: Optional[torch.Tensor] = None  # [B * S]

    @property
    def device(self) -> torch.device:
        return self.q.device


@dataclass(frozen=True)
class KernelOutputs:
    """What a kernel returns: ``out`` always; the rest when it has them (each one returned is judged)."""

    out: torch.Tensor  # [R, H, Dv] in inputs.out's dtype (sparse_topk: [B, S, H, Dv] bf16)
    lse: Optional[torch.Tensor] = None  # [R, H] in the declared lse base (ln unless arithmetic says log2); sparse [B, S, H]
    attn_logits: Optional[torch.Tensor] = None  # [R, H, S', Dv] split partials (before v_scale), with attn_lse
    attn_lse: Optional[torch.Tensor] = None  # [R, H, S'] split lse
    num_kv_splits: Optional[torch.Tensor] = None  # [B] the split counts it ran with (default: inputs')
    arithmetic: Optional[Any] = None  # this call's Arithmetic (sparse: SparseArithmetic; default: the KernelSpec's)
    info: dict = field(default_factory=dict)  # anything to show in the report (versions, notes)


def declare(layout: str = "token_slots", arithmetic: Optional[Any] = None, *, writes_buffers: bool = True,
            defines_empty_rows: bool = False, modes: tuple = ("decode",), tree_mask: bool = False,
            applies_inv_rope: bool = False) -> Callable[[Callable], Callable]:  # fmt: skip
    """Decorator: ``@declare(layout="block_table", arithmetic=Arithmetic("uniform"))`` on a kernel;
    ``modes=("decode", "verify")`` for qlen > 1; ``layout="sparse_topk"`` with a
    refmla.sparse.arithmetic.SparseArithmetic (default SGLang's Triton sparse kernel's)."""
    sparse = layout == "sparse_topk"
    spec = KernelSpec(layout, Arithmetic() if sparse or arithmetic is None else arithmetic, writes_buffers,
                      defines_empty_rows, tuple(modes), tree_mask, arithmetic if sparse else None, applies_inv_rope)  # fmt: skip

    def mark(fn: Callable) -> Callable:
        setattr(fn, SPEC_ATTR, spec)
        return fn

    return mark


def spec_of(fn: Any) -> KernelSpec:
    """The KernelSpec ``fn`` declares (the default one when it declares none)."""
    spec = getattr(fn, SPEC_ATTR, None)
    if spec is None:
        return KernelSpec()
    if not isinstance(spec, KernelSpec):
        raise InterfaceError(f"{SPEC_ATTR} is a {type(spec).__name__}; expected a refmla.kernel.KernelSpec")
    return spec


__all__ = ["InterfaceError", "KernelInputs", "KernelOutputs", "KernelSpec", "LAYOUTS", "MODES", "SparseKernelInputs", "declare",
           "spec_of"]  # fmt: skip

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

and judges what it returns exactly as it judges refmla's own backends (isolation in a child
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

LAYOUTS = ("token_slots", "block_table")
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

    def __post_init__(self):
        if self.layout not in LAYOUTS:
            raise InterfaceError(f"KernelSpec layout must be one of {', '.join(LAYOUTS)}, got {self.layout!r}")
        if not isinstance(self.arithmetic, Arithmetic):
            raise InterfaceError(f"KernelSpec arithmetic must be a refmla.arithmetic.Arithmetic, got {type(self.arithmetic).__name__}")


@dataclass(frozen=True)
class KernelInputs:
    """One decode call, as the kernel asked for it."""

    layout: str  # "token_slots" | "block_table"
    q: torch.Tensor  # [B, H, D] the absorbed query (q_nope @ w_kc | q_pe), the capture's dtype
    kv_buffer: torch.Tensor  # [N, 1, D] latent KV pool rows (bf16, fp16, fp32 or fp8); V = [..., :Dv]
    seq_lens: torch.Tensor  # [B] int32 tokens attended per request
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
    out: torch.Tensor  # [B, H, Dv] buffer in the dtype production stores the output in
    lse: torch.Tensor  # [B, H] fp32 buffer: natural log of the scaled logits' sum-exp
    attn_logits: torch.Tensor  # [B, H, S, Dv] fp32 buffer: each split's normalized partial, before v_scale
    attn_lse: torch.Tensor  # [B, H, S] fp32 buffer: each split's lse

    @property
    def device(self) -> torch.device:
        return self.q.device


@dataclass(frozen=True)
class KernelOutputs:
    """What a kernel returns: ``out`` always; the rest when it has them (each one returned is judged)."""

    out: torch.Tensor  # [B, H, Dv] in inputs.out's dtype
    lse: Optional[torch.Tensor] = None  # [B, H] in the declared lse base (ln unless arithmetic says log2)
    attn_logits: Optional[torch.Tensor] = None  # [B, H, S', Dv] split partials (before v_scale), with attn_lse
    attn_lse: Optional[torch.Tensor] = None  # [B, H, S'] split lse
    num_kv_splits: Optional[torch.Tensor] = None  # [B] the split counts it ran with (default: inputs')
    arithmetic: Optional[Arithmetic] = None  # this call's arithmetic (default: the KernelSpec's)
    info: dict = field(default_factory=dict)  # anything to show in the report (versions, notes)


def declare(layout: str = "token_slots", arithmetic: Optional[Arithmetic] = None, *, writes_buffers: bool = True,
            defines_empty_rows: bool = False) -> Callable[[Callable], Callable]:  # fmt: skip
    """Decorator: ``@declare(layout="block_table", arithmetic=Arithmetic("uniform"))`` on a kernel."""
    spec = KernelSpec(layout, arithmetic or Arithmetic(), writes_buffers, defines_empty_rows)

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


__all__ = ["InterfaceError", "KernelInputs", "KernelOutputs", "KernelSpec", "LAYOUTS", "declare", "spec_of"]

"""The ``extend`` backend: the local-extend baseline.

The same token computed the way the prefill / extend / verify path computes it. In extend
attention the cache holds only the *prefix*; the new tokens' latent K/V arrive as separate
tensors (the layer's freshly projected ``k``/``v``), and the new tokens attend causally,
bottom-right aligned:

    prefix   positions 0 .. L-n-1 of request b, read through kv_indptr / kv_indices (k_scale, v_scale)
    new      positions L-n .. L-1, passed directly as k_extend [T, 1, D], v_extend [T, 1, Dv]
    token i  (0-based among the n new ones) attends the prefix and new tokens 0 .. i

A decode capture is a one-token extend (n = 1): the current token's K/V come in as k_extend, the
other L-1 positions from the cache. Where the decode kernel and this path disagree on the same
captured state, the decode compute path is the suspect (refmla.diagnosis).

Two implementations, both run and both reported:

* :func:`mla_extend_local`, pure PyTorch at the kernel's rounding points with extend semantics
  (any number of new tokens, so ``extend`` captures replay too);
* SGLang's Triton ``extend_attention_fwd`` (``sglang.kernels.ops.attention.extend_attention`` from
  0.5.16, ``sglang.srt.layers.attention.triton_ops.extend_attention`` before), located and called
  by keyword from its signature, in the Triton interpreter on a machine without a GPU.

The backend's output is SGLang's kernel when it can run (that *is* the production extend path),
else the PyTorch one (``info["implementation"]`` says which, and why). The other implementation's
comparison with the reference goes in ``info`` (``info["torch_extend"]`` /
``info["sglang_triton_extend"]``), and aiter's ``mla_prefill_fwd`` in ``info["aiter_prefill"]``
where a real aiter (``aiter.mla``) is installed. ``REFMLA_EXTEND_IMPL=torch|triton|auto`` (or
``opts.extend_impl``) picks the primary by hand.

Where the new tokens' K/V come from. Production passed the layer's bf16 ``k``/``v``; the capture
has them only as cache rows. For a bf16 pool the row *is* that tensor; for an fp8 pool (stored as
value / k_scale) the row is dequantized, ``(row * k_scale).to(q.dtype)``, which differs from what
production passed by the fp8 rounding of those n rows only.

fp8 pools: SGLang's extend kernel rounds all of q (the rope part too) to the pool dtype for the
prefix dot, and P to the pool dtype before P.V; the PyTorch implementation does the same. That is
noisier than the decode control the comparator measures against, so an fp8 capture can fail the
extend path by a small margin without a fault; and the Triton interpreter's fp8 conversions are
not covered by refmla's bf16 fix (``info["triton"]["note"]`` says so).

    inputs.py         the capture as an extend call: ExtendInputs, as_extend, scatter_rows
    local.py          mla_extend_local, pure PyTorch at the kernel's rounding points
    sglang_triton.py  SGLang's Triton extend kernel: located, checked, called by keyword
    aiter_prefill.py  aiter's mla_prefill_fwd (real aiter only)
    backend.py        ExtendBackend: the primary, the others judged in ``info``
"""

from refmla.backends.extend.aiter_prefill import run_aiter_prefill
from refmla.backends.extend.backend import IMPL_ENV, ExtendBackend, summarize
from refmla.backends.extend.inputs import ExtendInputs, as_extend, dequant_rows, scatter_rows
from refmla.backends.extend.local import mla_extend_local
from refmla.backends.extend.sglang_triton import (
    EXTEND_KERNEL_MODULES,
    locate_extend_kernel,
    run_triton_extend,
    triton_extend_status,
)

__all__ = [
    "EXTEND_KERNEL_MODULES",
    "IMPL_ENV",
    "ExtendBackend",
    "ExtendInputs",
    "as_extend",
    "dequant_rows",
    "locate_extend_kernel",
    "mla_extend_local",
    "run_aiter_prefill",
    "run_triton_extend",
    "scatter_rows",
    "summarize",
    "triton_extend_status",
]

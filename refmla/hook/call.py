"""One wrapped attention call, as the hook sees it: the types that its stages hand on.

* :class:`Call` -- what the wrapper knows: filled before the kernel (backend, mode, layer,
  step, rank) by :func:`refmla.hook.filters.before`, then with the call's arguments and the
  kernel probes' notes after it;
* :class:`CallContext` -- what :mod:`refmla.hook.extract` reads about the call after the
  kernel ran, filled stage by stage (geometry, the mode's :class:`Indices`, the KV pool, the
  kernel's schedule); the mode readers (:mod:`refmla.hook.modes`) fill it and the meta
  providers (:mod:`refmla.hook.meta`) read it;
* :class:`Skip` -- raised by any stage when the call is not one ``refmla.capture/1`` describes;
* :func:`dressed_as` -- a wrapper given its original's name, qualname, doc and ``__wrapped__``.

Torch-free: this module is imported when the hook is installed.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Optional


class Skip(Exception):
    """The call is not captured; the message says why (counted and logged once per reason)."""


@dataclass
class Call:
    backend: str  # "triton" | "aiter"
    mode: str  # the capture mode: "decode" | "extend" | "verify" (a key of refmla.hook.modes.READERS)
    layer: Any  # SGLang's RadixAttention layer
    forward_batch: Any  # SGLang's ForwardBatch
    layer_id: int
    step: int  # index of this call of (backend, layer) in this process
    rank: int  # TP rank
    q: Any = None  # the call's arguments, set after the kernel ran
    k: Any = None
    llama_4_scaling: Any = None  # TRT-LLM's query scale (not in refmla.capture/1: such a call is skipped)
    q_rope: Any = None  # the rope part when the backend takes it apart (TRT-LLM, FlashInfer, FA3 MLA)
    sinks: Any = None
    kernel_notes: dict = field(default_factory=dict)  # what the kernel-module probes saw during the call


@dataclass
class VllmCall:
    """One wrapped vLLM ``forward_mqa`` call that passed the filters (refmla.hook.vllm_patch)."""

    backend: str  # the capture's meta backend (refmla.hook.vllm_paths)
    engine_backend: str  # vLLM's own name, e.g. TRITON_MLA
    layer: Any  # vLLM's MLAAttention layer (its _k_scale, layer_name)
    layer_id: int
    step: int
    rank: int


@dataclass(frozen=True)
class Indices:
    """What the kernel attended, whole sequences, on the host (int64), from a mode reader."""

    kv_indptr: Any  # [B + 1] from 0
    kv_indices: Any  # [kv_indptr[-1]] physical pool slots
    qo_indptr: Any  # [B + 1] query tokens per request (extend), None for one token each (decode)
    batch_size: int  # B


@dataclass
class CallContext:
    """One call after its kernel ran. Device tensors here are views: read, never written."""

    call: Call
    backend: Any  # the backend instance whose forward_* ran
    md: Any  # backend.forward_metadata
    pool: Any  # backend.token_to_kv_pool
    heads: int  # H = layer.tp_q_head_num
    qk_head_dim: int  # D = kv_lora_rank + qk_rope_head_dim
    kv_lora_rank: int  # = v_head_dim (absorbed MLA)
    q: Any  # [T, H, D] device view (T = B for decode, tokens for extend)
    out: Any  # [T, H, Dv] the kernel's output, device view
    # -- filled in order by refmla.hook.extract --
    idx: Optional[Indices] = None  # the mode reader's indices
    seq_lens: Any = None  # [B] int32 host: tokens each request attended
    k_buf: Any = None  # [N, 1, D] the layer's KV pool buffer, device
    req_to_token: Any = None  # [B, M] host, physical slots (None when the backend has none)
    num_kv_splits: Any = None  # [B] int32 host, the split counts the kernel used (Triton decode)
    attn_logits: Any = None  # [B, H, S, Dv] device view of the stage-1 partials (Triton decode)
    attn_lse: Any = None  # [B, H, S] device view
    block_table: Any = None  # [B, M] int64 host: the block table a block-table kernel read (refmla.hook.nvidia)
    page_size: Optional[int] = None  # the page size that kernel read it with
    custom_mask: Any = None  # verify: [sum n_b * L_b] bool host, SGLang's tree mask as the kernel read it
    mask_indptr: Any = None  # verify: [B + 1] int64 host, from 0
    notes: dict = field(default_factory=dict)  # extra meta keys found on the way

    @property
    def layer(self) -> Any:
        return self.call.layer

    @property
    def forward_batch(self) -> Any:
        return self.call.forward_batch

    @property
    def batch_size(self) -> int:
        return self.idx.batch_size if self.idx is not None else 0


@contextlib.contextmanager
def guarded(state: Any):
    """The hook's part of one call: a :class:`Skip` is counted with its reason (``state.skip``),
    any other exception disables the hook (``state.fail``); nothing raises into the server."""
    try:
        yield
    except Skip as s:
        state.skip(str(s))
    except Exception as e:  # the hook never raises into the server
        state.fail(e)


def dressed_as(wrapper: Callable, original: Callable) -> Callable:
    """``wrapper`` with ``original``'s ``__name__``, ``__qualname__``, ``__doc__`` and ``__wrapped__``
    (inspect.signature(wrapper) is the original's: callers binding by name still work)."""
    wrapper.__wrapped__ = original  # type: ignore[attr-defined]
    for attr in ("__name__", "__qualname__", "__doc__"):
        setattr(wrapper, attr, getattr(original, attr, None))
    return wrapper

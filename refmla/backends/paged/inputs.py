"""A capture as the paged inputs a block-table kernel takes, and the backend they share.

A kernel with a fixed page size P (FlashMLA 64, TRT-LLM-gen 32 / 64, CUTLASS 128) reads the
capture's own pool and block table when the capture's page size is P; otherwise each request's
rows are copied, in position order, into fresh pages of P rows (the same KV, laid out as that
kernel's engine would have written it), noted in the result's info. Pages past a sequence hold
NaN, so a kernel that reads past its sequence shows it.

An fp8 pool (e4m3, OCP: what the NVIDIA kernels read) goes to a kernel only through its fp8 path
(:meth:`PagedKernelBackend.refuses_fp8` says why not, else the backend's ``fp8_attr``): q is
quantized to e4m3 as the engines do before these kernels (:func:`quantize_q`), and the capture's ``k_scale`` goes in as the kernel takes it (FlashMLA's
``descale_k``, TRT-LLM's ``bmm1_scale`` / ``bmm2_scale``); those kernels apply one scale to the
latent K and V, so ``k_scale != v_scale`` is refused with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch

from refmla.backends.base import Backend, BackendResult, BackendUnavailable
from refmla.backends.calling import KernelNotFound, KernelSignatureError, find_function
from refmla.arithmetic import FP8_E4M3, FP8_E4M3_MAX, Arithmetic, producer_arithmetic, quantize_q  # noqa: F401
from refmla.util import cdiv

def declared_arithmetic(cap) -> Arithmetic:
    """These kernels' arithmetic: over an fp8 pool q goes in as e4m3 whole (:func:`quantize_q`, the
    rope part too); the split schedule the control models is the capture's (refmla.arithmetic)."""
    schedule = producer_arithmetic(cap).split_schedule
    return Arithmetic(split_schedule=schedule, q_round="whole_e4m3" if is_fp8(cap) else "latent_to_pool")



@dataclass(frozen=True)
class PagedInputs:
    q: torch.Tensor  # [B, H, D]
    pool: torch.Tensor  # [pages, P, D]
    block_table: torch.Tensor  # [B, M] int32, M a multiple of table_multiple
    seq_lens: torch.Tensor  # [B] int32
    page_size: int
    layout: str  # "capture block_table" | "re-paged from ..."


def paged_inputs(cap, page_sizes: Sequence[int], device, table_multiple: int = 1) -> PagedInputs:
    """The capture's rows for a kernel taking one of ``page_sizes`` (the first is used to re-page)."""
    seq = cap.seq_lens.to(torch.int32)
    D = cap.kv_buffer.shape[-1]
    if cap.block_table is not None and cap.meta.page_size in page_sizes:
        P = cap.meta.page_size
        pool, table, layout = cap.kv_buffer.reshape(-1, P, D), cap.block_table, "capture block_table"
    else:
        P = int(page_sizes[0])
        pool, table = repage(cap, P)
        layout = f"re-paged from page {cap.meta.page_size} to {P}"
    M = cdiv(max(table.shape[1], 1), table_multiple) * table_multiple
    padded = torch.zeros(table.shape[0], M, dtype=torch.int32)  # padding: page 0, never read
    padded[:, : table.shape[1]] = table.to(torch.int32)
    return PagedInputs(cap.q.to(device), pool.to(device), padded.to(device), seq.to(device), P, layout)


def repage(cap, P: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(pool [pages, P, D] with NaN past each sequence, block table [B, max pages]) of the capture's rows."""
    D, lens = cap.kv_buffer.shape[-1], cap.seq_lens.long().tolist()
    need = [cdiv(L, P) for L in lens]
    pool = torch.full((sum(need) + 1, P, D), float("nan"), dtype=torch.float32).to(cap.kv_buffer.dtype)
    table = torch.zeros(len(lens), max(need + [1]), dtype=torch.int32)
    page = 1  # page 0 stays NaN: the padding every table entry past a sequence points at
    for b, L in enumerate(lens):
        rows = cap.kv_indices[int(cap.kv_indptr[b]) : int(cap.kv_indptr[b]) + L].long()
        flat = pool[page : page + need[b]].view(-1, D)  # [need * P, D]
        flat[:L] = cap.kv_buffer[rows, 0]
        table[b, : need[b]] = torch.arange(page, page + need[b], dtype=torch.int32)
        page += need[b]
    return pool, table


class PagedKernelBackend(Backend):
    """Find ``attr`` in ``modules``; run :meth:`call` on the capture's paged inputs."""

    modes = ("decode",)
    modules: tuple = ()
    attr: str = ""
    fp8_attr: str = ""  # the kernel's fp8-cache entry point, when it has one (else fp8 is refused)
    fp8_why: str = "bf16 / fp16 pools only"  # why not, when it has none
    what: str = ""
    page_sizes: tuple = (64,)
    table_multiple: int = 1

    def locate(self, attr: Optional[str] = None) -> tuple[Callable, str]:
        fn, where = find_function(self.modules, attr or self.attr, self.what)
        why = unavailable_stub(fn, where)
        if why:
            raise BackendUnavailable(why)
        return fn, where

    def availability(self) -> tuple[bool, str]:
        try:
            fn, where = self.locate()
        except Exception as e:
            return False, str(e)
        if not runs_here(where):
            return False, f"{where}.{self.attr} found, but it needs a CUDA GPU and there is none"
        return True, f"{where}.{self.attr}" + (" (a test stand-in, not a kernel)" if is_standin(where) else "")

    def run(self, cap, opts) -> BackendResult:
        if cap.meta.mode != "decode":
            raise BackendUnavailable(f"decode kernel; capture is {cap.meta.mode} mode")
        ok, why = self.availability()
        if not ok:
            raise BackendUnavailable(why)
        why = self.refuses(cap)
        if why:
            raise BackendUnavailable(why)
        try:
            fn, where = self.locate(self.fp8_attr) if is_fp8(cap) else self.locate()
        except KernelNotFound as e:  # the fp8 entry point of this release may be absent
            raise BackendUnavailable(str(e)) from e
        attr = self.fp8_attr if is_fp8(cap) else self.attr
        if not runs_here(where):
            raise BackendUnavailable(f"{where}.{attr} found, but it needs a CUDA GPU and there is none")
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        inputs = paged_inputs(cap, self.page_sizes, device, self.table_multiple)
        try:
            out, lse = self.call(fn, inputs, cap)
        except KernelSignatureError as e:
            raise BackendUnavailable(str(e)) from e
        info = {"kernel": f"{where}.{attr}", "layout": inputs.layout, "page_size": inputs.page_size,
                "device": str(device), "standin": is_standin(where)}  # fmt: skip
        res = BackendResult(out=out.cpu(), lse=None if lse is None else lse.float().cpu(), info=info,
                            defines_empty_rows=False)  # fmt: skip
        res.arithmetic = declared_arithmetic(cap)  # q in e4m3 whole on an fp8 pool: that rounding's noise floor
        if is_fp8(cap):
            info["control"] = "q quantized to e4m3 whole (latent and rope), as this fp8 path takes it"
        return res

    def refuses(self, cap) -> Optional[str]:
        """Why this kernel cannot take the capture (shape, scales), or None."""
        m = cap.meta
        if (m.kv_lora_rank, m.qk_rope_head_dim) != (512, 64):
            return f"{self.what} takes 512 + 64 (DeepSeek / Kimi MLA); this capture has {m.kv_lora_rank} + {m.qk_rope_head_dim}"
        if m.logit_cap:
            return f"{self.what} has no logit cap"
        if is_fp8(cap):
            return self.refuses_fp8(cap)
        if m.k_scale != 1.0 or m.v_scale != 1.0:
            return f"{self.what}: KV scales on a {str(cap.kv_buffer.dtype)[6:]} pool (scales go with an fp8 cache)"
        return None

    def refuses_fp8(self, cap) -> Optional[str]:
        """Why this kernel cannot take the capture's fp8 pool, or None (the kernel's fp8 path exists)."""
        dtype = str(cap.kv_buffer.dtype)[6:]
        if not self.fp8_attr:
            return f"{self.what} has no fp8 KV cache path: {self.fp8_why}"
        if cap.kv_buffer.dtype != FP8_E4M3:
            return f"{self.what} reads fp8 e4m3 (float8_e4m3fn) caches; this pool is {dtype}"
        if cap.meta.k_scale != cap.meta.v_scale:
            return (f"{self.what} applies one KV scale to the latent K and V; this capture has k_scale "
                    f"{cap.meta.k_scale:g}, v_scale {cap.meta.v_scale:g}")  # fmt: skip
        return None

    def call(self, fn: Callable, x: PagedInputs, cap) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        raise NotImplementedError


def is_fp8(cap) -> bool:
    return cap.kv_buffer.dtype.itemsize == 1


def runs_here(module_path: str) -> bool:
    """A CUDA GPU is present, or the module is one of the tests' stand-ins (they run on CPU)."""
    return torch.cuda.is_available() or is_standin(module_path)


def is_standin(module_path: str) -> bool:
    import sys

    return bool(getattr(sys.modules.get(module_path), "__refmla_standin__", False))


def unavailable_stub(fn: Callable, where: str) -> Optional[str]:
    """vLLM binds its kernel names to a raiser when the extension is absent, and its fp8 entry
    points raise from inside (they ask ``_is_flashmla_available`` first): neither is a kernel."""
    import sys

    probe = getattr(sys.modules.get(where), "_is_flashmla_available", None)
    try:
        available, reason = probe() if callable(probe) else (True, None)
    except Exception as e:
        available, reason = False, f"{type(e).__name__}: {e}"
    if getattr(fn, "__name__", "").startswith("_raise_") or not available:
        return f"{where}: kernel not built here ({reason or fn.__name__})"
    return None


def call_result(value: Any, out: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(out, lse) from what a kernel returned: (out, lse), out, or None (it wrote ``out``)."""
    if isinstance(value, (tuple, list)):
        return value[0], (value[1] if len(value) > 1 and torch.is_tensor(value[1]) and value[1].numel() else None)
    return (value if torch.is_tensor(value) else out), None


__all__ = ["FP8_E4M3", "PagedInputs", "PagedKernelBackend", "call_result", "declared_arithmetic", "is_fp8", "is_standin", "paged_inputs",
           "quantize_q", "repage", "runs_here"]

"""The compute paths a sparse decode capture replays through, picked by name:

    reference  the fp64 truth (refmla.sparse.reference)
    observed   the capture's ``out`` / ``lse``: what production wrote
    triton     SGLang's Triton sparse decode kernel, ``triton_fp8_attention_fwd`` (the entrypoint's
               backend "triton"), interpreted on CPU, compiled on a GPU; V4 layout only (d_qk 512)
    aiter_sparse  aiter's gfx950 gluon kernel ``pa_decode_sparse`` (the entrypoint's default on
               MI355X), through SGLang's own ``aiter_sparse_decode_fwd``; ROCm only
    tilelang   SGLang's ``dpsk_v4_fp8_attention_fwd`` where tilelang is installed
    flashmla_sparse  FlashMLA's sparse decode, ``flash_mla_with_kvcache(..., indices=...)`` with
               ``get_mla_metadata()``, from the first of flash_mla, sgl_kernel.flash_mla, vLLM's
               third_party.flashmla that imports (NVIDIA SM90 / SM100); its lse [B, H, S] transposed

:func:`availability` says whether a path can run here without running it (``refmla doctor``).
:class:`SparseBackend` is each path as a :class:`refmla.backends.base.Backend` (``availability()``,
``run()``), what the one replay (refmla.pipeline) runs; it calls the path's function in
:data:`BACKENDS`, where a function of your own may take a kernel's place.

Each function returns out [B, S, H, Dv] and lse [B, S, H] (or None) as the kernel returned them, or raises
:class:`Unavailable` with the reason (reported as skipped). A kernel that raises is a finding.
"""

from __future__ import annotations

import importlib
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

import torch

from refmla.backends import ALL_NAMES
from refmla.backends.base import Backend, BackendResult, BackendUnavailable
from refmla.backends.calling import first_module_with
from refmla.sparse.arithmetic import DECLARED, SGLANG_TRITON_SPARSE, SparseArithmetic, producer_sparse_arithmetic
from refmla.sparse.format import SparseCapture
from refmla.sparse.reference import inverse_rope, sparse_reference

TRITON_ENTRY = "sglang.kernels.ops.attention.dsv4.triton_sparse_decode"
TRITON_FUSED = TRITON_ENTRY + ".triton_mla_kernels_decode_fused"


class Unavailable(BackendUnavailable):
    """This path cannot run here or on this capture; the message says why (a BackendUnavailable, so
    it crosses the isolation boundary as itself: skipped, never an error)."""


@dataclass
class PathOutput:
    out: torch.Tensor  # [B, S, H, Dv]
    lse: Optional[torch.Tensor]  # [B, S, H], natural log, or None
    note: str = ""
    info: dict = field(default_factory=dict)


def run_reference(cap: SparseCapture) -> PathOutput:
    r = sparse_reference(cap)
    return PathOutput(r.out, r.lse, "pure PyTorch, fp64")


def run_observed(cap: SparseCapture) -> PathOutput:
    if cap.out is None:
        raise Unavailable("the capture has no `out` tensor")
    return PathOutput(cap.out, cap.lse, f"the capture's `out` (production kernel: {cap.meta.backend})")


def kernel_kwargs(cap: SparseCapture, device: str = "cpu") -> dict:
    """The entrypoint's keyword arguments as SGLang's _forward_attention builds them: each cache
    viewed [pages, page_size, 1, bytes per token] over its padded page rows."""
    m = cap.meta

    def view(cache, layout, page):
        return cache.to(device)[:, : page * layout.bytes_per_token].view(cache.shape[0], page, 1, layout.bytes_per_token)

    kw = dict(q=cap.q.to(device, torch.bfloat16), k_cache=view(cap.k_cache, m.layout, m.page_size),
              head_dim_v=m.head_dim_v, softmax_scale=m.softmax_scale, indices=cap.indices.to(device, torch.int32),
              topk_length=None if cap.topk_length is None else cap.topk_length.to(device, torch.int32),
              attn_sink=None if cap.attn_sink is None else cap.attn_sink.to(device, torch.float32),
              block_table=None, cache_seqlens=None, tile_scheduler_metadata=None, is_fp8_kvcache=True)  # fmt: skip
    if cap.extra_k_cache is not None:
        kw.update(extra_k_cache=view(cap.extra_k_cache, m.extra_layout, m.extra_page_size),
                  extra_indices_in_kvcache=cap.extra_indices.to(device, torch.int32),
                  extra_topk_length=None if cap.extra_topk_length is None else cap.extra_topk_length.to(device, torch.int32))  # fmt: skip
    return kw


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _triton_module():
    from refmla.backends.triton_interp import ensure_interpreter, install_bf16_dot_fix, interpreter_active

    interpreting, note = ensure_interpreter()
    if not interpreting and "GPU" not in note:
        raise Unavailable(note)
    if interpreter_active():
        ok, why = install_bf16_dot_fix()
        if not ok:
            raise Unavailable(why)
    try:
        return importlib.import_module(TRITON_ENTRY), note
    except Exception as e:
        raise Unavailable(f"{TRITON_ENTRY} not importable: {type(e).__name__}: {e}") from None


@contextmanager
def one_config_each(module_name: str, interpreting: bool) -> Iterator[list[str]]:
    """Under the interpreter, every autotuned kernel of the module keeps its first config only (the
    autotuner benchmarks with a GPU driver the interpreter has none of); restored after. On a GPU
    nothing changes."""
    from triton.runtime.autotuner import Autotuner

    mod = importlib.import_module(module_name)
    tuned = [(n, k, k.configs) for n, k in vars(mod).items() if isinstance(k, Autotuner)] if interpreting else []
    try:
        for _, k, configs in tuned:
            k.configs = configs[:1]
        yield [f"{n}: {c[0]}" for n, _, c in tuned]
    finally:
        for _, k, configs in tuned:
            k.configs = configs


def run_triton(cap: SparseCapture) -> PathOutput:
    m = cap.meta
    if m.kv_layout != "v4" or (m.extra_kv_layout not in (None, "v4")):
        raise Unavailable(f"SGLang's Triton sparse kernel reads the V4 layout only (d_qk 512); this capture is {m.kv_layout}")
    if m.kv_fp8_dtype != "float8_e4m3fn" and not torch.cuda.is_available():
        raise Unavailable(f"the kernel reads {m.kv_fp8_dtype} only on gfx942; here it would read e4m3fn")
    mod, note = _triton_module()
    with one_config_each(TRITON_FUSED, "interpreter" in note) as configs:
        out, lse = mod.triton_fp8_attention_fwd(**kernel_kwargs(cap, _device()))
    out, lse = out.cpu(), lse.cpu()
    B, S, H, _ = cap.q.shape
    if cap.inv_rope_freqs is not None:  # the kernel ignores inv_rope; SGLang's model applies it after
        o = inverse_rope(out.reshape(B * S, H, cap.meta.head_dim_v).float(), cap.inv_rope_freqs, cap.inv_rope_positions[: B * S])
        out = o.to(out.dtype).reshape(out.shape)
    return PathOutput(out, lse, f"sglang {TRITON_ENTRY}.triton_fp8_attention_fwd, {note}",
                      {"autotune_configs_interpreted": configs} if configs else {})


def _need_aiter() -> str:
    module = "aiter.ops.triton.attention.pa_decode_sparse"
    try:
        importlib.import_module(module)
    except Exception as e:
        raise Unavailable(f"aiter is not installed (ROCm only; ships in SGLang's ROCm image): "
                          f"{module}: {type(e).__name__}") from None  # fmt: skip
    if not (torch.cuda.is_available() and getattr(torch.version, "hip", None)):
        raise Unavailable("aiter_sparse is aiter's gfx950 gluon kernel: needs a ROCm GPU")
    return module


def run_aiter_sparse(cap: SparseCapture) -> PathOutput:
    _need_aiter()
    from sglang.srt.layers.attention.hip_flash_mla import aiter_sparse_decode_fwd

    kw = kernel_kwargs(cap, "cuda")
    if cap.inv_rope_freqs is not None:
        kw["inv_rope"] = (cap.inv_rope_freqs.cuda(), cap.inv_rope_positions.cuda())
    out, lse = aiter_sparse_decode_fwd(**kw)
    return PathOutput(out.cpu(), None if lse is None else lse.cpu(), "aiter pa_decode_sparse via sglang aiter_sparse_decode_fwd")


def _need_tilelang() -> str:
    try:
        importlib.import_module("tilelang")
    except Exception:
        raise Unavailable("tilelang is not installed") from None
    if not torch.cuda.is_available():
        raise Unavailable("tilelang kernels need a GPU")
    return "tilelang"


def run_tilelang(cap: SparseCapture) -> PathOutput:
    _need_tilelang()
    from sglang.kernels.ops.attention.dsv4.tilelang_fp8_attention import dpsk_v4_fp8_attention_fwd

    out, lse = dpsk_v4_fp8_attention_fwd(**kernel_kwargs(cap, "cuda"))
    return PathOutput(out.cpu(), None if lse is None else lse.cpu(), "sglang dpsk_v4_fp8_attention_fwd (tilelang)")


FLASHMLA_MODULES = ("flash_mla", "sgl_kernel.flash_mla", "vllm.third_party.flashmla.flash_mla_interface")


def flashmla_module():
    """(the first FlashMLA module exposing flash_mla_with_kvcache and get_mla_metadata, its name), or
    Unavailable with why each was not."""
    mod, name, why = first_module_with(FLASHMLA_MODULES, ("flash_mla_with_kvcache", "get_mla_metadata"))
    if mod is not None:
        return mod, name
    raise Unavailable("FlashMLA's sparse decode is not importable (NVIDIA SM90 / SM100 builds): " + "; ".join(why))


def run_flashmla_sparse(cap: SparseCapture) -> PathOutput:
    mod, name = flashmla_module()
    kw = kernel_kwargs(cap, _device())  # its keyword names are FlashMLA's (SGLang's entrypoint mirrors them)
    kw["tile_scheduler_metadata"] = mod.get_mla_metadata()[0]
    out, lse = mod.flash_mla_with_kvcache(**kw)  # lse [B, H, S]
    out = out.cpu()
    B, S, H, _ = cap.q.shape
    if cap.inv_rope_freqs is not None:  # FlashMLA does not apply inv_rope; SGLang's model applies it after
        o = inverse_rope(out.reshape(B * S, H, cap.meta.head_dim_v).float(), cap.inv_rope_freqs, cap.inv_rope_positions[: B * S])
        out = o.to(out.dtype).reshape(out.shape)
    return PathOutput(out, lse.cpu().transpose(1, 2), f"{name}.flash_mla_with_kvcache (indices)")


def availability(name: str) -> tuple[bool, str]:
    """(usable here, the module or why not) of a sparse kernel path, without running it."""
    try:  # the reason is the one running it would give
        if name == "triton":
            return True, _triton_module()[1]
        if name == "flashmla_sparse":
            return True, flashmla_module()[1]
        return True, {"aiter_sparse": _need_aiter, "tilelang": _need_tilelang}[name]()
    except Unavailable as e:
        return False, str(e)
    except Exception as e:
        return False, f"not importable: {type(e).__name__}"


BACKENDS: dict[str, Callable[[SparseCapture], PathOutput]] = {
    "reference": run_reference, "observed": run_observed, "triton": run_triton,
    "aiter_sparse": run_aiter_sparse, "tilelang": run_tilelang, "flashmla_sparse": run_flashmla_sparse,
}  # fmt: skip


def declared_arithmetic(name: str, cap: SparseCapture) -> SparseArithmetic:
    """The arithmetic a path is judged at (refmla.sparse.arithmetic): each kernel's own declaration,
    observed's producer's (meta ``backend``), SGLang's Triton kernel's for any other path."""
    if name == "observed":
        return producer_sparse_arithmetic(cap.meta.backend)
    return DECLARED.get(name, SGLANG_TRITON_SPARSE)


DEFAULT_BACKENDS = ("reference", "observed", "triton", "aiter_sparse", "tilelang", "flashmla_sparse")
KERNELS = DEFAULT_BACKENDS[2:]  # the kernel paths: run in a child process (refmla.isolation)
SPARSE_ONLY = [n for n in KERNELS if n not in ALL_NAMES]  # aiter_sparse, tilelang, flashmla_sparse: sparse captures only
_OWN = dict(BACKENDS)  # refmla's own function of each path (what availability() speaks for)


class SparseBackend(Backend):
    """One path of a sparse capture as a Backend: ``run`` calls its function in :data:`BACKENDS`
    (out [B, S, H, Dv], lse [B, S, H]); ``availability`` says whether refmla's own can run here (a
    function put in its place is taken as available: it says itself, by raising Unavailable)."""

    def __init__(self, name: str):
        if name not in BACKENDS:
            raise KeyError(f"unknown sparse path {name!r}; choose from {', '.join(BACKENDS)}")
        self.name = name
        self.in_process = name not in KERNELS  # observed only reads the capture: no child process

    def availability(self) -> tuple[bool, str]:
        fn = BACKENDS[self.name]
        if fn is not _OWN.get(self.name):
            return True, f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', fn)}"
        return availability(self.name) if self.name in KERNELS else (True, "")

    def run(self, cap: SparseCapture, opts=None) -> BackendResult:
        got = BACKENDS[self.name](cap)
        return BackendResult(got.out, got.lse, info={"version": got.note, **got.info})

__all__ = ["BACKENDS", "DEFAULT_BACKENDS", "FLASHMLA_MODULES", "KERNELS", "SPARSE_ONLY", "SparseBackend", "availability", "declared_arithmetic", "flashmla_module", "PathOutput", "Unavailable", "kernel_kwargs"]

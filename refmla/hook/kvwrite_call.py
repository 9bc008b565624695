"""(torch) The MLA KV cache writers, captured around their call (meta ``mode`` ``kv_write``,
``REFMLA_CAPTURE_BACKENDS=kvwrite``):

    SGLang  MLATokenToKVPool.set_mla_kv_buffer(layer, loc, cache_k_nope, cache_k_rope) and
            .set_kv_buffer(layer, loc, cache_k, cache_v): the pool casts (fp8: ``x.to(fp8)``), its
            caller divided k by layer.k_scale before the call (scale_applied "caller")
    SGLang  on ROCm, aiter's fused_qk_rope_cat_and_cache_mla(q_nope, q_pe, k_nope, k_pe, kv_cache,
            slot_mapping, positions, cos, sin, k_scale, is_neox, ...): rope, x / k_scale, cache write;
            its rope part is the rotated k_pe it returns (third output)
    vLLM    _custom_ops.concat_and_cache_mla(kv_c, k_pe, kv_cache, slot_mapping, kv_cache_dtype, scale):
            x / scale (fp8), slots < 0 are padding and not written

DeepSeek-V4's packed pool writers are read by refmla.hook.v4write_call into the same
:class:`WriteCall` (a ``gather`` of each kept slot's bytes from the block-split pages).

Before the original runs, the rows of the written slots and their two neighbours are copied (a
small gather); after it, the same rows again. Same filters (layer, rank, ``EVERY``, graph capture)
and budget as every capture; any exception disables the hook once, logged, never raised. A writer
called inside another captured writer (a pool method delegating to another) is not captured twice.
"""

from __future__ import annotations

import os
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from refmla.hook.call import dressed_as
from refmla.hook.filters import after_call_filters
from refmla.hook.runtime import versions
from refmla.hook.writer import HookState, capture_name
from refmla.kvwrite.io import write_kv_write
from refmla.util import dtype_name


@dataclass
class WriteCall:
    """One writer call as the capture needs it."""

    writer: str  # e.g. "sglang.MLATokenToKVPool.set_mla_kv_buffer"
    engine: str
    rows: torch.Tensor  # [S, D] the pool's rows, in its logical dtype (a view: written through by the call)
    slots: torch.Tensor  # [T] token-level slots (padding already dropped)
    latent: torch.Tensor  # [T, L]
    rope: Optional[torch.Tensor]  # [T, R] (None: read from the result, rope_of)
    layer_id: int
    scale: Optional[float] = None  # the writer divides by this (None: it applies none)
    scale_applied: str = "writer"
    meta: dict = field(default_factory=dict)
    rope_of: Optional[Callable[[Any], torch.Tensor]] = None  # the rope part from the call's result
    keep: Optional[torch.Tensor] = None
    before: Optional[torch.Tensor] = None
    # packed pages (refmla.hook.v4write_call): the kept slots' bytes [N, row_bytes], and how many slots
    gather: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
    slot_count: Optional[int] = None
    row_bytes: Optional[int] = None
    tensors: dict = field(default_factory=dict)  # more inputs as given (a pack's tile_scales)
    prepare: Optional[Callable[["WriteCall"], None]] = None  # device work the capture needs (after the filters)

    def take(self, keep: torch.Tensor) -> torch.Tensor:
        """The kept rows now, on the host."""
        return (self.gather(keep) if self.gather is not None else self.rows.index_select(0, keep)).cpu()

    def count(self) -> int:
        return self.slot_count if self.slot_count is not None else int(self.rows.shape[0])

    def bytes_per_row(self) -> int:
        return self.row_bytes if self.row_bytes is not None else int(self.rows.shape[1] * self.rows.element_size())


_inside = threading.local()  # a writer call being captured on this thread (nested writers run plainly)


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(t.shape[0], -1)


def _kept(call: WriteCall) -> torch.Tensor:
    s = call.slots.long()
    return torch.unique(torch.cat([s - 1, s, s + 1]).clamp(0, call.count() - 1))


def capture_write(state: HookState, call: WriteCall, run: Callable[[], Any]) -> Any:
    """Filters, rows before, the original (``run``), rows after, write; returns the original's result."""
    prepared = None
    try:
        wanted = after_call_filters(state, "kvwrite", call.layer_id)
        if wanted is not None:
            estimate = int(call.latent.numel() * 2 * call.latent.element_size()) + 6 * call.slots.numel() * call.bytes_per_row()
            if state.admit(estimate):
                if call.prepare is not None:
                    call.prepare(call)
                call.keep = _kept(call).to(call.rows.device)
                call.before = call.take(call.keep)
                prepared = wanted
    except Exception as e:  # the hook never raises into the server
        state.fail(e)
    result = run()
    if prepared is None:
        return result
    try:
        _write(state, call, result, *prepared)
    except Exception as e:
        state.fail(e)
    return result


def _write(state: HookState, call: WriteCall, result: Any, rank: int, step: int) -> None:
    after = call.take(call.keep)
    rope = call.rope if call.rope_of is None else call.rope_of(result)
    t = {"latent": call.latent.detach().cpu(), "slots": call.slots.detach().cpu().long(),
         "pool_slots": call.keep.cpu().long(), "rows_before": call.before, "rows_after": after}  # fmt: skip
    if rope is not None and rope.numel():
        t["rope"] = _flat(rope).detach().cpu()
    if call.scale is not None:
        t["scale"] = torch.tensor([call.scale], dtype=torch.float32)
    t.update({k: v.detach().cpu() for k, v in call.tensors.items()})
    layer = max(call.layer_id, 0)
    meta = {"mode": "kv_write", "writer": call.writer, "kv_dtype": dtype_name(call.rows.dtype),
            "kv_lora_rank": int(t["latent"].shape[1]), "qk_rope_head_dim": int(t["rope"].shape[1]) if "rope" in t else 0,
            "scale_applied": call.scale_applied, "engine": call.engine, "layer_id": layer, "tp_rank": rank,
            "step": step, "engine_version": versions().get("sglang_version") if call.engine == "sglang" else None,
            **call.meta}  # fmt: skip
    name = capture_name(mode="kvwrite", rank=rank, layer=layer, step=step, backend=call.writer.split(".")[-1], pid=os.getpid())
    path = Path(state.cfg.out_dir) / name
    write_kv_write(path, t, {k: v for k, v in meta.items() if v is not None})
    state.note_written(path)


# ---------------------------------------------------------------------------------------------
# The calls of each writer, read from its own arguments
# ---------------------------------------------------------------------------------------------


def _write_loc(pool: Any, loc_info: Any) -> torch.Tensor:
    """SGLang's loc from a KVWriteLoc (or a plain tensor), through the pool module's own unwrap."""
    unwrap = getattr(sys.modules.get(type(pool).__module__), "unwrap_write_loc", None)
    if isinstance(loc_info, torch.Tensor) or unwrap is None:
        return loc_info
    return unwrap(loc_info)[0]


def sglang_pool_call(pool: Any, method: str, layer: Any, loc_info: Any, a: torch.Tensor, b: Optional[torch.Tensor],
                     layer_id_override: Optional[int] = None) -> Optional[WriteCall]:  # fmt: skip
    """The WriteCall of MLATokenToKVPool.set_mla_kv_buffer / set_kv_buffer, or None when not this layout."""
    if getattr(pool, "dsa_kv_cache_store_fp8", False) or getattr(pool, "use_dsa", False):
        return None  # DSA's packed fp8 rows are not this kind's layout
    layer_id = layer_id_override if layer_id_override is not None else int(getattr(layer, "layer_id", -1))
    buf = pool.kv_buffer[layer_id - getattr(pool, "start_layer", 0)]
    rows = buf.view(pool.dtype) if getattr(pool, "store_dtype", pool.dtype) != pool.dtype else buf
    L = int(pool.kv_lora_rank)
    if method == "set_kv_buffer":
        k = _flat(a)
        latent, rope = k[:, :L], k[:, L:]
    else:
        latent, rope = _flat(a), (_flat(b) if b is not None and b.numel() else None)
    scale = getattr(layer, "k_scale_float", None) or getattr(layer, "k_scale", None)
    meta = {"page_size": int(getattr(pool, "page_size", 1))}
    if scale is not None:
        meta["caller_k_scale"] = float(scale)
    return WriteCall(f"sglang.MLATokenToKVPool.{method}", "sglang", _flat(rows), _write_loc(pool, loc_info).reshape(-1),
                     latent, rope, layer_id, scale=None, scale_applied="caller", meta=meta)  # fmt: skip


FP8_OF_VLLM = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def vllm_concat_call(kv_c, k_pe, kv_cache, slot_mapping, kv_cache_dtype: str, scale, layer_id: int = -1) -> WriteCall:
    """The WriteCall of vLLM's concat_and_cache_mla (kv_cache [blocks, block_size, D])."""
    dtype = FP8_OF_VLLM.get(kv_cache_dtype, kv_cache.dtype) if kv_cache.dtype == torch.uint8 else kv_cache.dtype
    try:  # ROCm MI300 stores e4m3fnuz: vLLM's platform says which
        from vllm.platforms import current_platform

        if kv_cache_dtype.startswith("fp8") and kv_cache_dtype != "fp8_e5m2":  # e5m2 is e5m2 on every platform
            dtype = current_platform.fp8_dtype()
    except Exception:
        pass
    rows = kv_cache.view(dtype) if kv_cache.dtype != dtype else kv_cache
    slots = slot_mapping.reshape(-1)
    real = slots >= 0  # vLLM pads with -1: not written
    fp8 = kv_cache_dtype.startswith("fp8")
    return WriteCall("vllm.concat_and_cache_mla", "vllm", rows.reshape(-1, rows.shape[-1]), slots[real], _flat(kv_c)[real],
                     _flat(k_pe)[real], layer_id, scale=float(scale.reshape(-1)[0]) if fp8 else None,
                     meta={"page_size": int(kv_cache.shape[1])})  # fmt: skip


def aiter_fused_call(q_nope, q_pe, k_nope, k_pe, kv_cache, slot_mapping, positions, cos, sin, k_scale, is_neox,
                     layer_id: int = -1) -> WriteCall:  # fmt: skip
    """The WriteCall of aiter's fused_qk_rope_cat_and_cache_mla: its stored rope part is the rotated
    k_pe it returns (third output), so that is what the capture records."""
    fp8 = kv_cache.dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2)
    scale = float(k_scale.reshape(-1)[0]) if fp8 and k_scale is not None else None
    return WriteCall("aiter.fused_qk_rope_cat_and_cache_mla", "sglang", kv_cache.reshape(-1, kv_cache.shape[-1]),
                     slot_mapping.reshape(-1), _flat(k_nope), None, layer_id, scale=scale,
                     rope_of=lambda result: result[2], meta={"is_neox": bool(is_neox)})  # fmt: skip




# ---------------------------------------------------------------------------------------------
# The wrappers the patcher installs (refmla.hook.patching): the original always runs, untouched
# ---------------------------------------------------------------------------------------------


def bound_arguments(original: Callable, args: tuple, kwargs: dict) -> dict:
    import inspect

    b = inspect.signature(original).bind(*args, **kwargs)
    b.apply_defaults()
    return dict(b.arguments)


def wrap_writer(original: Callable, make_call: Callable[[dict], Optional[WriteCall]],
                state_of: Callable[[], Optional[HookState]]) -> Callable:  # fmt: skip
    """A writer's wrapper: ``make_call`` reads the bound arguments into a WriteCall (None: not captured)."""

    def writer(*args, **kwargs):
        state = state_of()
        if state is None or not state.active or getattr(_inside, "on", False):
            return original(*args, **kwargs)
        try:
            call = make_call(bound_arguments(original, args, kwargs))
        except Exception as e:  # never into the server
            state.fail(e)
            call = None
        if call is None:
            return original(*args, **kwargs)
        _inside.on = True
        try:
            return capture_write(state, call, lambda: original(*args, **kwargs))
        finally:
            _inside.on = False

    return dressed_as(writer, original)


def sglang_pool_reader(method: str) -> Callable[[dict], Optional[WriteCall]]:
    names = ("cache_k_nope", "cache_k_rope") if method == "set_mla_kv_buffer" else ("cache_k", "cache_v")

    def read(a: dict) -> Optional[WriteCall]:
        return sglang_pool_call(a["self"], method, a.get("layer"), a.get("loc_info", a.get("loc")), a[names[0]],
                                a.get(names[1]) if method == "set_mla_kv_buffer" else None, a.get("layer_id_override"))  # fmt: skip

    return read


def vllm_concat_reader(a: dict) -> WriteCall:
    return vllm_concat_call(a["kv_c"], a["k_pe"], a["kv_cache"], a["slot_mapping"], a["kv_cache_dtype"], a["scale"])


def aiter_fused_reader(a: dict) -> WriteCall:
    """By position: SGLang passes (q_nope, q_pe, k_nope, k_pe, kv_cache, slot_mapping, positions,
    cos, sin, k_scale, is_neox) positionally, whatever aiter release names them."""
    return aiter_fused_call(*list(a.values())[:11])

def _pool_reader(a: dict) -> Optional[WriteCall]:
    """Either MLATokenToKVPool method, told apart by its arguments' names."""
    return sglang_pool_reader("set_mla_kv_buffer" if "cache_k_nope" in a else "set_kv_buffer")(a)


WRITER_READERS = {"sglang_pool": _pool_reader, "aiter_fused": aiter_fused_reader, "vllm_concat": vllm_concat_reader}

__all__ = ["WRITER_READERS", "WriteCall", "aiter_fused_call", "aiter_fused_reader", "capture_write", "sglang_pool_call", "sglang_pool_reader",
           "vllm_concat_call", "vllm_concat_reader", "wrap_writer"]  # fmt: skip

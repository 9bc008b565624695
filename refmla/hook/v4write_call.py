"""(torch) DeepSeek-V4's packed KV writers, captured around their call as kv_write captures with
meta ``kv_layout`` ``v4`` (``REFMLA_CAPTURE_BACKENDS=kvwrite``; refmla.kvwrite.packed). SGLang
0.5.23's ``DeepSeekV4TokenToKVPool``, the methods its attention backend and compressors call:

    set_swa_key_buffer(layer_id, loc, pack) /         the pack (fp8 nope [T, 448], bf16 rope [T, 64],
    set_extra_key_buffer(layer_id, loc, pack)         UE8M0 exponents [T, 7]) stored by SetKAndS
                                                      (_set_k_and_s_triton): meta packed_input "pack"
    set_swa_key_buffer_radix_fused(layer_id,          [T, 512] bf16 quantized and stored by
        swa_loc, cache_k) /                           fused_store_cache (CUDA: the JIT kernel, amax
    set_extra_key_buffer_fused(layer_id, loc,         floor 1e-4; ROCm: triton_fused_store_flashmla,
        cache_k)                                      1e-8): meta packed_input "latent", amax_floor

The pages written are the SWA pool's (``get_swa_raw_buffer``, the request window's included) or
the layer's compressed pool's (``layer_mapping``: c4, c128; a HiSparse C4 pool's slots translated
by its own ``translate_loc_to_hisparse_device``); ``layer_id`` is the model's. A compressed pool of
the uniform fp8 layout (TRT-LLM's ``DeepSeekV4UniformFP8KVPool``: ``cache_k.to(e4m3fn)``, 512 per
token, no scales) is captured as an ordinary row capture. Each kept slot's 584 bytes are gathered
from its page (its data row and scale row, refmla.kvwrite.packed.token_columns); slots < 0 are
padding, not written.

Not captured: ``set_swa_key_buffer_radix_fused_norm_rope``, the model's default SWA write, which
RMS-normalises, rotates and quantizes in one kernel from fp32 values no capture can see
(``SGLANG_DSV4_USE_BF16_KV_QUANT_SOURCE=1`` routes it through ``store_cache`` ->
``set_swa_key_buffer_radix_fused``, captured); the V4.1 layouts (``v41``, ``v41_fp4``: not this
kind's) and an fp4 cache's in-kernel rope (``freqs_cis``).
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Optional

import torch

from refmla.hook.kvwrite_call import WriteCall, _flat
from refmla.hook.sglang_paths import DSV4_AMAX_FLOOR, DSV4_STORE_PROBES
from refmla.kvwrite.packed import layout_of, token_columns
from refmla.util import dtype_name

CLASS = "sglang.DeepSeekV4TokenToKVPool"
LAYOUT = "v4"


def _layout_name(pool: Any) -> str:
    lay = getattr(pool, "kv_layout", None)
    return str(getattr(lay, "value", lay))


def store_rule() -> tuple[float, str, str]:
    """(amax floor, fp8 dtype, store path) of fused_store_cache in this process, by SGLang's own probes."""
    (attn, hip_name), (fp8_mod, fnuz_name) = DSV4_STORE_PROBES
    hip = getattr(sys.modules.get(attn), hip_name, None)
    if hip is None or not hip():
        return DSV4_AMAX_FLOOR["cuda"], "float8_e4m3fn", "cuda"
    fnuz = getattr(sys.modules.get(fp8_mod), fnuz_name, None)
    fp8 = "float8_e4m3fnuz" if fnuz is not None and fnuz() else "float8_e4m3fn"
    return DSV4_AMAX_FLOOR["rocm_triton"], fp8, "rocm_triton"


def _target(pool: Any, layer_id: int, extra: bool, fused: bool) -> tuple[torch.Tensor, int, Any, str]:
    """(pages [P, stride], page size, the sub-pool, its role) a method of ``pool`` writes."""
    if extra:
        ratio, local, sub = pool.layer_mapping[layer_id]
        return sub.kv_buffer[local], int(sub.page_size), sub, f"c{ratio}"
    ps = pool.swa_page_size if fused else pool.get_swa_key_page_size()
    return pool.get_swa_raw_buffer(layer_id), int(ps), pool, "swa"


def _drop_padding(call: WriteCall) -> None:
    real = call.slots >= 0
    if not bool(real.all()):
        call.slots, call.latent, call.rope = call.slots[real], call.latent[real], call.rope[real]
        call.tensors = {k: v[real] for k, v in call.tensors.items()}


def packed_call(method: str, buf: torch.Tensor, page_size: int, loc: torch.Tensor, latent: torch.Tensor,
                rope: torch.Tensor, layer_id: int, meta: dict, tensors: Optional[dict] = None,
                translate: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> Optional[WriteCall]:  # fmt: skip
    """The WriteCall of one packed write into ``buf``'s block-split pages (None: not the v4 layout)."""
    lay = layout_of(LAYOUT)
    if buf.dtype != torch.uint8 or buf.dim() != 2 or buf.shape[1] < lay.page_bytes(page_size):
        return None

    def gather(keep: torch.Tensor) -> torch.Tensor:
        return buf[(keep // page_size)[:, None], token_columns(keep % page_size, lay, page_size)]

    def prepare(call: WriteCall) -> None:
        if translate is not None:
            call.slots = translate(call.slots)
        _drop_padding(call)

    return WriteCall(f"{CLASS}.{method}", "sglang", buf, loc.reshape(-1), latent, rope, layer_id,
                     meta={"kv_layout": LAYOUT, "page_size": page_size, **meta}, gather=gather,
                     slot_count=int(buf.shape[0]) * page_size, row_bytes=lay.bytes_per_token,
                     tensors=dict(tensors or {}), prepare=prepare)  # fmt: skip


def _hisparse(sub: Any) -> Optional[Callable[[torch.Tensor], torch.Tensor]]:
    return getattr(sub, "translate_loc_to_hisparse_device", None)


def pack_reader(method: str, extra: bool) -> Callable[[dict], Optional[WriteCall]]:
    def read(a: dict) -> Optional[WriteCall]:
        pool, layer_id, pack = a["self"], int(a["layer_id"]), a["cache_nope_fp8_rope_bf16_pack"]
        buf, ps, sub, role = _target(pool, layer_id, extra, fused=False)
        if _layout_name(sub) != LAYOUT:
            return None
        meta = {"kv_dtype": dtype_name(pack.k_nope_fp8.dtype), "packed_input": "pack", "kv_pool": role,
                "store_path": "set_k_and_s_triton"}  # fmt: skip
        return packed_call(method, buf, ps, a["loc"], pack.k_nope_fp8, pack.k_rope_bf16, layer_id, meta,
                           {"tile_scales": pack.scale_k_nope_ue8m0}, _hisparse(sub) if extra else None)  # fmt: skip

    return read


def fused_reader(method: str, extra: bool) -> Callable[[dict], Optional[WriteCall]]:
    def read(a: dict) -> Optional[WriteCall]:
        pool, layer_id = a["self"], int(a["layer_id"])
        if a.get("freqs_cis") is not None or (not extra and getattr(pool, "uniform_fp8", False)):
            return None  # an fp4 cache's in-kernel rope; a uniform SWA pool is not written here
        buf, ps, sub, role = _target(pool, layer_id, extra, fused=True)
        k = _flat(a["cache_k"])
        lay = layout_of(LAYOUT)
        loc = a["swa_loc"] if "swa_loc" in a else a["loc"]
        if extra and buf.dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz):
            return _uniform_call(buf, ps, loc, k, layer_id, role)
        if _layout_name(sub) != LAYOUT:
            return None
        floor, fp8, path = store_rule()
        meta = {"kv_dtype": fp8, "packed_input": "latent", "amax_floor": floor, "kv_pool": role, "store_path": path}
        return packed_call(method, buf, ps, loc, k[:, : lay.d_nope], k[:, lay.d_nope :], layer_id, meta,
                           translate=_hisparse(sub) if extra else None)  # fmt: skip

    return read


def _uniform_call(buf: torch.Tensor, ps: int, loc: torch.Tensor, k: torch.Tensor, layer_id: int,
                  role: str) -> WriteCall:  # fmt: skip
    """TRT-LLM's uniform fp8 compressed pool: 512 e4m3 per token, ``cache_k.to(e4m3fn)`` (unit scale)."""
    lay = layout_of(LAYOUT)
    rows = buf.view(-1, lay.head_dim)
    call = WriteCall("sglang.DeepSeekV4UniformFP8KVPool.set_key_buffer_fused", "sglang", rows, loc.reshape(-1),
                     k[:, : lay.d_nope], k[:, lay.d_nope :], layer_id, scale=None, scale_applied="caller",
                     meta={"page_size": ps, "kv_pool": role})  # fmt: skip
    call.prepare = _drop_padding
    return call


V4_WRITER_READERS = {
    "dsv4_swa_pack": pack_reader("set_swa_key_buffer", extra=False),
    "dsv4_extra_pack": pack_reader("set_extra_key_buffer", extra=True),
    "dsv4_swa_fused": fused_reader("set_swa_key_buffer_radix_fused", extra=False),
    "dsv4_extra_fused": fused_reader("set_extra_key_buffer_fused", extra=True),
}

__all__ = ["V4_WRITER_READERS", "fused_reader", "pack_reader", "packed_call", "store_rule"]

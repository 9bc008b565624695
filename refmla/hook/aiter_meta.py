"""aiter: which MLA decode path production ran, as meta, and its persistent work buffers, as tensors.

Read after the call from the kernel probes' notes (:mod:`refmla.hook.kernel_probes`), SGLang's
``AiterAttnBackend`` attributes and its module's globals (``_use_mla_ps_kernel``, ``fast_mode``,
``intra_batch_mode``: SGLang 0.5.23 sets them in ``__init__``). The meta keys are listed in
docs/contract.md section 1 ("aiter path"). Everything here is best effort: a missing attribute
leaves its key out, nothing raises into the server (the provider is wrapped by the caller's
guard and each read is defensive).
"""

from __future__ import annotations

import os
import sys
from typing import Any, Optional

import torch

from refmla.hook.call import CallContext
from refmla.util import dtype_name

BUFFER_MAX_BYTES = 4 << 20  # the persistent work buffers are captured when all five fit
FULL_ENV = "REFMLA_CAPTURE_AITER_META"  # "full": captured whatever their size (refmla inspect checks the plan)
CAPTURED_BUFFERS = ("work_indptr", "work_info_set", "reduce_indptr", "reduce_final_map", "reduce_partial_map")
ENV_PREFIXES = ("SGLANG_AITER_", "AITER_")


def _scalar(t: Any) -> Optional[float]:
    """A one-element scale tensor (or a number) as a float; None otherwise."""
    try:
        if torch.is_tensor(t):
            return float(t.reshape(-1)[0].item()) if t.numel() >= 1 else None
        return float(t) if t is not None else None
    except Exception:
        return None


def _path(notes: dict, backend: Any, md: Any) -> tuple[str, str]:
    """(aiter_path, how it is known): from the probes, else inferred from SGLang's state."""
    dcp = int(getattr(backend, "dcp_world_size", 1) or 1) > 1
    if notes.get("aiter_gluon") is not None:
        return ("dcp_gluon" if dcp else "gluon"), "probe"
    call = notes.get("aiter_kernel_tensors")
    if call is not None:
        if "work_meta_data" not in call:
            return "non_persistent", "probe"
        if notes.get("aiter_gate_persistent") is False:
            return "non_persistent", "probe (aiter's _use_persistent_mla_decode fell back)"
        return ("dcp_asm" if dcp else "persistent"), "probe"
    persistent = getattr(md, "work_metadata", None) is not None
    return ("persistent" if persistent else "non_persistent"), "inferred (no probe saw the kernel call)"


def _sglang_state(backend: Any) -> dict[str, Any]:
    """The backend's knobs and its module's globals, as SGLang 0.5.23 names them."""
    out: dict[str, Any] = {}
    attrs = {"head_pad_mode": "aiter_head_pad_mode", "num_head_padded": "aiter_num_head_padded",
             "mla_kernel_num_head_padded": "aiter_mla_kernel_num_head_padded",
             "max_split_per_batch": "aiter_max_split_per_batch", "mla_decode_backend": "aiter_mla_decode_backend",
             "use_mla_auto_kv_splits": "aiter_auto_kv_splits"}  # fmt: skip
    for attr, key in attrs.items():
        v = getattr(backend, attr, None)
        if isinstance(v, (bool, int, str)):
            out[key] = v
    mod = sys.modules.get(type(backend).__module__)
    for name, key in (("_use_mla_ps_kernel", "aiter_persist_enabled"), ("fast_mode", "aiter_fast_mode"),
                      ("intra_batch_mode", "aiter_intra_batch_mode")):  # fmt: skip
        v = getattr(mod, name, None)
        if isinstance(v, bool):
            out[key] = v
    return out


def aiter_path_meta(ctx: CallContext) -> dict[str, Any]:
    """The aiter path meta group (docs/contract.md section 1); empty for other backends and modes."""
    if ctx.call.backend != "aiter" or ctx.call.mode != "decode":
        return {}
    notes, backend = ctx.call.kernel_notes or {}, ctx.backend
    path, how = _path(notes, backend, ctx.md)
    meta: dict[str, Any] = {"aiter_path": path, "aiter_path_source": how, **_sglang_state(backend)}
    page_size = int(getattr(backend, "page_size", 1) or 1)
    meta["aiter_kv_granularity"] = max(page_size, 16)
    call = notes.get("aiter_kernel_call") or {}
    if "intra_batch_mode" in call:
        meta["aiter_intra_batch_mode"] = bool(call["intra_batch_mode"])  # what the kernel got wins
    q_dtype, heads = notes.get("aiter_q") or (None, None)
    if q_dtype:
        meta["aiter_q_dtype"] = q_dtype
    if heads:
        meta["aiter_kernel_heads"] = heads
    if notes.get("aiter_kv_dtype"):
        meta["aiter_kv_dtype"] = notes["aiter_kv_dtype"]
    tensors = notes.get("aiter_kernel_tensors") or {}
    for name in ("q_scale", "kv_scale"):
        v = _scalar(tensors.get(name))
        if v is not None:
            meta[f"aiter_{name}"] = v
    sizes = [_nbytes(tensors.get(n)) for n in CAPTURED_BUFFERS]
    if all(n is not None for n in sizes):
        meta["aiter_buffers_bytes"] = sum(sizes)  # recorded whether or not the buffers are captured
    gluon = notes.get("aiter_gluon")
    if gluon is not None:
        meta["aiter_gluon_call"] = gluon
        if _scalar(gluon.get("kv_scale")) is not None:
            meta["aiter_kv_scale"] = _scalar(gluon.get("kv_scale"))
    for key in ("aiter_kernel_call", "aiter_metadata_call", "aiter_metadata_info_call", "aiter_gate_persistent"):
        if notes.get(key) is not None:
            meta[key] = notes[key]
    meta["aiter_env"] = {k: v for k, v in sorted(os.environ.items()) if k.startswith(ENV_PREFIXES)}
    return meta


def _nbytes(t: Any) -> Optional[int]:
    return int(t.numel() * t.element_size()) if torch.is_tensor(t) else None


def aiter_buffers(ctx: CallContext) -> tuple[dict[str, torch.Tensor], Optional[str]]:
    """({"aiter_<name>": host copy} of the persistent work buffers the kernel read, why not or None):
    whole when they fit BUFFER_MAX_BYTES, or whatever their size under REFMLA_CAPTURE_AITER_META=full."""
    if ctx.call.backend != "aiter" or ctx.call.mode != "decode":
        return {}, None
    found = (ctx.call.kernel_notes or {}).get("aiter_kernel_tensors") or {}
    bufs = {n: found.get(n) for n in CAPTURED_BUFFERS}
    if any(b is None for b in bufs.values()):
        return {}, None
    nbytes = sum(b.numel() * b.element_size() for b in bufs.values())
    if nbytes > BUFFER_MAX_BYTES and os.environ.get(FULL_ENV, "").strip().lower() != "full":
        return {}, f"{nbytes} bytes > {BUFFER_MAX_BYTES}: not captured ({FULL_ENV}=full captures them whole)"
    out = {}
    for name, b in bufs.items():
        if b.dtype not in (torch.int32, torch.int64):
            return {}, f"{name} is {dtype_name(b.dtype)}, not an index dtype: not captured"
        out[f"aiter_{name}"] = b.detach().to("cpu").clone()
    return out, None


__all__ = ["BUFFER_MAX_BYTES", "aiter_buffers", "aiter_path_meta"]

"""Probes inside SGLang's kernel modules: which path the kernel took during the current call.

A probe replaces one function of a kernel module with a wrapper that calls it unchanged and
notes what it saw (the batch-wide split count SGLang's gfx950 tuning chose, that the Lean kernel
ran) in a per-thread dict. The method wrapper opens the dict before the original ``forward_*``
runs (:func:`start_notes`) and hands it to the call afterwards (:func:`take_notes`). The kernel
looks these helpers up in its module at call time, so wrapping the module attributes sees every
call.

To probe another kernel, add ``{attribute: factory}`` for its module to :data:`KERNEL_PROBES`; a
factory takes the original function and returns the noting wrapper. The aiter probes note which
MLA decode path SGLang's aiter backend dispatched (``mla_decode_fwd`` with or without the
persistent buffers, ``mla_gluon_decode``, aiter's own persistent gate) and the metadata calls
(refmla.hook.aiter_meta reads the notes). A probe never raises into the server and never syncs
the device: tensors are kept by reference and read after the call.
"""

from __future__ import annotations

import inspect
import threading
from typing import Any, Callable, Optional

from refmla.hook.sglang_paths import AITER_PROBED_MODULES, DCP_COMBINE_MODULES, DECODE_KERNEL_MODULES, MARK

_TLS = threading.local()  # per-thread notes from the kernel probes of the current call


def start_notes() -> None:
    _TLS.notes = {}


def take_notes() -> dict:
    return getattr(_TLS, "notes", {}) or {}


def clear_notes() -> None:
    """Close the notes: probes outside a captured call note nothing (and keep no tensor alive)."""
    _TLS.notes = None


def _open_notes() -> Optional[dict]:
    """The notes of the call running on this thread (None on a thread no wrapper has run on)."""
    return getattr(_TLS, "notes", None)


def _launch_plan_probe(plan: Callable) -> Callable:
    """``_mla_launch_plan`` -> (tuned, forced): gfx950's tuned geometry and batch-wide split count."""

    def mla_launch_plan(*args, **kwargs):
        tuned, forced = plan(*args, **kwargs)
        notes = _open_notes()
        if notes is not None:
            notes["mla_tuned"], notes["forced_kv_splits"] = bool(tuned), int(forced)
        return tuned, forced

    return mla_launch_plan


def _lean_probe(lean: Callable) -> Callable:
    """``_decode_lean_attention_fwd``: the Lean kernel ran (no splits, no partials)."""

    def decode_lean_attention_fwd(*args, **kwargs):
        notes = _open_notes()
        if notes is not None:
            notes["lean"] = True
        return lean(*args, **kwargs)

    return decode_lean_attention_fwd


# -- aiter: which MLA decode path ran (refmla.hook.aiter_meta turns the notes into meta) --------

# the latest metadata calls: SGLang builds the persistent buffers in init_forward_metadata, once
# per batch and before forward_decode, so outside the per-call notes; matched to the kernel call
# by the identity of the buffers it passes
_LAST_METADATA: dict[str, dict] = {}


def _plain(v: Any) -> Any:
    """A JSON-able stand-in for an argument, without importing torch (tensors by shape and dtype)."""
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    shape = getattr(v, "shape", None)
    if shape is not None:
        return f"tensor{list(shape)} {str(getattr(v, 'dtype', '?')).replace('torch.', '')}"
    return str(v).replace("torch.", "")


def _bind(fn: Callable) -> Callable[[tuple, dict], dict]:
    """(args, kwargs) -> {parameter name: value} by ``fn``'s signature (positional names as given)."""
    try:
        names = [p for p in inspect.signature(fn).parameters]
    except (TypeError, ValueError):
        names = []
    return lambda args, kwargs: {**{(names[i] if i < len(names) else f"arg{i}"): a for i, a in enumerate(args)}, **kwargs}


def _metadata_probe(name: str) -> Callable[[Callable], Callable]:
    """``get_mla_metadata_info_v1`` / ``get_mla_metadata_v1``: their arguments, kept until the next call."""

    def factory(fn: Callable) -> Callable:
        bind = _bind(fn)

        def probe(*args, **kwargs):
            try:
                bound = bind(args, kwargs)
                _LAST_METADATA[name] = {"args": {k: _plain(v) for k, v in bound.items()},
                                        "ids": {id(v) for v in bound.values() if hasattr(v, "shape")}}  # fmt: skip
            except Exception:
                pass  # a probe never raises into the server
            return fn(*args, **kwargs)

        return probe

    return factory


_KERNEL_TENSORS = ("q_scale", "kv_scale", "work_meta_data", "work_indptr", "work_info_set", "reduce_indptr",
                   "reduce_final_map", "reduce_partial_map")  # fmt: skip


def _mla_decode_probe(fn: Callable) -> Callable:
    """``mla_decode_fwd``: its scalar arguments, q / KV dtypes and heads, and references to the scales
    and persistent buffers (read on the host after the call: no device sync here)."""
    bind = _bind(fn)

    def mla_decode_fwd(*args, **kwargs):
        notes = _open_notes()
        if notes is not None:
            try:
                b = bind(args, kwargs)
                q, kv = b.get("q"), b.get("kv_buffer")
                notes["aiter_kernel_call"] = {k: _plain(v) for k, v in b.items() if not hasattr(v, "shape")}
                notes["aiter_q"] = (_plain(getattr(q, "dtype", None)), int(q.shape[1]) if q is not None else None)
                notes["aiter_kv_dtype"] = _plain(getattr(kv, "dtype", None))
                notes["aiter_kernel_tensors"] = {k: b[k] for k in _KERNEL_TENSORS if b.get(k) is not None}
                meta = _LAST_METADATA.get("get_mla_metadata_v1")
                if meta is not None and id(b.get("work_info_set")) in meta["ids"]:
                    notes["aiter_metadata_call"] = meta["args"]
                    info = _LAST_METADATA.get("get_mla_metadata_info_v1")
                    if info is not None:
                        notes["aiter_metadata_info_call"] = info["args"]
            except Exception:
                pass
        return fn(*args, **kwargs)

    return mla_decode_fwd


def _gluon_probe(fn: Callable) -> Callable:
    """``mla_gluon_decode`` (SGLang's wrapper of aiter's Gluon kernel): it ran, with which kv_scale."""

    def mla_gluon_decode(*args, **kwargs):
        notes = _open_notes()
        if notes is not None:
            notes["aiter_gluon"] = {k: _plain(v) for k, v in kwargs.items() if not hasattr(v, "shape") and k != "layer"}
        return fn(*args, **kwargs)

    return mla_gluon_decode


def _gate_probe(fn: Callable) -> Callable:
    """aiter's ``_use_persistent_mla_decode``: False means aiter itself fell back to non-persistent."""

    def _use_persistent_mla_decode(*args, **kwargs):
        kept = fn(*args, **kwargs)
        notes = _open_notes()
        if notes is not None:
            notes["aiter_gate_persistent"] = bool(kept)
        return kept

    return _use_persistent_mla_decode


# -- decode context parallelism: SGLang's Triton decode gathers q and combines inside forward_decode --


def _grouped_probe(fn: Callable) -> Callable:
    """``decode_attention_fwd_grouped`` (the MLA decode): the q it got, by reference (under DCP the
    heads the group gathered, which forward_decode's own q is not)."""

    def decode_attention_fwd_grouped(*args, **kwargs):
        notes = _open_notes()
        if notes is not None:
            notes["kernel_q"] = args[0] if args else kwargs.get("q")
        return fn(*args, **kwargs)

    return decode_attention_fwd_grouped


def _dcp_combine_probe(fn: Callable) -> Callable:
    """``cp_lse_ag_out_rs_mha`` as SGLang's Triton decode calls it under DCP: its inputs copied
    before it runs (it scales the partial out in place), its output, the group's size and rank."""

    def cp_lse_ag_out_rs_mha(cp_attn_out, cp_attn_lse, cp_group, *args, **kwargs):
        notes = _open_notes()
        if notes is not None:
            try:
                notes["dcp_in_out"], notes["dcp_in_lse"] = cp_attn_out.clone(), cp_attn_lse.clone()
                notes["dcp_group"] = (int(cp_group.world_size), int(cp_group.rank_in_group))
            except Exception:
                notes["dcp_in_out"] = None  # a probe never raises into the server
        result = fn(cp_attn_out, cp_attn_lse, cp_group, *args, **kwargs)
        if notes is not None:
            notes["dcp_out"] = result[0] if isinstance(result, tuple) else result
        return result

    return cp_lse_ag_out_rs_mha


# backend -> (kernel modules, {attribute: probe factory}); each module gets the attributes it has
KERNEL_PROBES: dict[str, tuple[tuple[str, ...], dict[str, Callable[[Callable], Callable]]]] = {
    "triton": (DECODE_KERNEL_MODULES + DCP_COMBINE_MODULES, {
        "_mla_launch_plan": _launch_plan_probe, "_decode_lean_attention_fwd": _lean_probe,
        "decode_attention_fwd_grouped": _grouped_probe, "cp_lse_ag_out_rs_mha": _dcp_combine_probe}),
    "aiter": (AITER_PROBED_MODULES, {
        "mla_decode_fwd": _mla_decode_probe, "mla_gluon_decode": _gluon_probe,
        "get_mla_metadata_v1": _metadata_probe("get_mla_metadata_v1"),
        "get_mla_metadata_info_v1": _metadata_probe("get_mla_metadata_info_v1"),
        "_use_persistent_mla_decode": _gate_probe,
    }),
}  # fmt: skip


def probe_module(module: Any, probes: dict[str, Callable[[Callable], Callable]],
                 record: Callable[[Any, str, Callable], None]) -> None:  # fmt: skip
    """Replace each probed function of ``module`` (once); ``record(module, attr, original)``."""
    for attr, make in probes.items():
        original = getattr(module, attr, None)
        if not callable(original) or getattr(original, MARK, None) is not None:
            continue
        wrapper = make(original)
        wrapper.__wrapped__ = original  # inspect.signature(wrapper) is the original's: keyword callers still work
        setattr(wrapper, MARK, original)
        setattr(module, attr, wrapper)
        record(module, attr, original)

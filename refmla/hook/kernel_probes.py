"""Probes inside SGLang's kernel modules: which path the kernel took during the current call.

A probe replaces one function of a kernel module with a wrapper that calls it unchanged and
notes what it saw (the batch-wide split count SGLang's gfx950 tuning chose, that the Lean kernel
ran) in a per-thread dict. The method wrapper opens the dict before the original ``forward_*``
runs (:func:`start_notes`) and hands it to the call afterwards (:func:`take_notes`). The kernel
looks these helpers up in its module at call time, so wrapping the module attributes sees every
call.

To probe another kernel (e.g. which aiter MLA path SGLang dispatched: persistent, non-persistent,
gluon), add ``{attribute: factory}`` for its module to :data:`KERNEL_PROBES`; a factory takes
the original function and returns the noting wrapper.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Optional

from refmla.hook.sglang_paths import DECODE_KERNEL_MODULES, MARK

_TLS = threading.local()  # per-thread notes from the kernel probes of the current call


def start_notes() -> None:
    _TLS.notes = {}


def take_notes() -> dict:
    return getattr(_TLS, "notes", {}) or {}


def clear_notes() -> None:
    _TLS.notes = {}


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


# backend -> (kernel modules, {attribute: probe factory}); probed in this order
KERNEL_PROBES: dict[str, tuple[tuple[str, ...], dict[str, Callable[[Callable], Callable]]]] = {
    "triton": (DECODE_KERNEL_MODULES, {"_mla_launch_plan": _launch_plan_probe,
                                       "_decode_lean_attention_fwd": _lean_probe}),  # fmt: skip
}


def probe_module(module: Any, probes: dict[str, Callable[[Callable], Callable]],
                 record: Callable[[Any, str, Callable], None]) -> None:  # fmt: skip
    """Replace each probed function of ``module`` (once); ``record(module, attr, original)``."""
    for attr, make in probes.items():
        original = getattr(module, attr, None)
        if not callable(original) or getattr(original, MARK, None) is not None:
            continue
        wrapper = make(original)
        setattr(wrapper, MARK, original)
        setattr(module, attr, wrapper)
        record(module, attr, original)

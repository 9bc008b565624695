"""(torch) vLLM's cross-rank combine under decode context parallelism, recorded with the rank's call.

vLLM's MLA layer calls ``forward_mqa`` and hands its (out, lse) straight to
``layer.dcp_manager.combine`` (``cp_lse_ag_out_rs`` / ``cp_lse_ag_out_ar`` / ``dcp_a2a_lse_reduce``
bound with the DCP group and the lse base: a ``functools.partial`` the manager keeps). The
forward_mqa wrapper holds the rank's capture here instead of writing it (:func:`hold`), and wraps
that manager's ``combine`` once (an instance attribute, restored on uninstall). The combine's
wrapper copies the inputs it was handed (``dcp_in_out``, ``dcp_in_lse``: the partial out and the
lse as the combine sees them, in their own dtypes) before the combine runs (it masks the lse of
empty shards in place), runs it, and writes the held capture with its output (``dcp_out``: this
rank's heads of the merge). The server gets the combine's own result, untouched.

A held capture whose combine never comes is written without it at the layer's next call (or on
uninstall). A Skip or an error here never reaches the server (the hook's usual rules).
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Optional

import torch

from refmla.hook.call import Skip
from refmla.hook.writer import HookState

MARK = "__refmla_dcp_combine__"  # on the wrapper: the combine it wraps
_HELD: dict[int, tuple] = {}  # id(manager) -> (state, name, tensors, meta) of the rank's last call
_LOCK = threading.Lock()


def hold(state: HookState, layer: Any, name: str, tensors: dict, meta: dict, installed: Optional[list]) -> bool:
    """Keep the rank's capture until ``layer``'s combine runs; False (write it now) when the layer
    has no combine to wrap. ``installed``: the installation's list of (owner, name, original)."""
    manager = getattr(layer, "dcp_manager", None)
    combine = getattr(manager, "combine", None)
    if manager is None or not callable(combine) or installed is None:
        return False
    if getattr(combine, MARK, None) is None:
        wrapper = _wrapper(manager, combine)
        setattr(wrapper, MARK, combine)
        try:
            manager.combine = wrapper
        except (AttributeError, TypeError):  # a manager that takes no attribute: the capture without its combine
            state.once("dcp_combine_unwrapped", logging.INFO, "the DCP manager's combine cannot be wrapped: not recorded")
            return False
        installed.append((manager, "combine", combine))
    meta["dcp_combine"] = _combine_name(combine)
    for k in ("out", "lse"):  # the combine corrects its out in place: the held copy must be the capture's own
        if k in tensors:
            tensors[k] = tensors[k].clone()
    with _LOCK:
        stale = _HELD.pop(id(manager), None)
        _HELD[id(manager)] = (state, name, tensors, meta)
    if stale is not None:  # its combine never came: written as it was
        _write(*stale)
    return True


def flush() -> None:
    """Write every held capture as it is (uninstall: no combine will come)."""
    with _LOCK:
        held = list(_HELD.values())
        _HELD.clear()
    for h in held:
        _write(*h)


def _combine_name(fn: Any) -> str:
    """The combine's function name (a functools.partial's underlying one): cp_lse_ag_out_rs, ..."""
    inner = getattr(fn, "func", fn)
    return str(getattr(inner, "__name__", type(inner).__name__))


def _write(state: HookState, name: str, tensors: dict, meta: dict) -> None:
    try:
        state.write(name, tensors, meta)
    except Exception as e:
        state.fail(e)


def _wrapper(manager: Any, original: Callable) -> Callable:
    key = id(manager)

    def combine(partial_output, partial_lse, *args, **kwargs):
        with _LOCK:
            held = _HELD.pop(key, None)
        if held is None:
            return original(partial_output, partial_lse, *args, **kwargs)
        state = held[0]
        inputs = None
        try:
            inputs = _inputs(partial_output, partial_lse, held[2])
        except Skip as s:
            state.skip(str(s))
        except Exception as e:
            state.fail(e)
        result = original(partial_output, partial_lse, *args, **kwargs)
        try:
            if inputs is not None:
                out = result[0] if isinstance(result, tuple) else result
                if torch.is_tensor(out) and out.dim() == 3:
                    held[2].update(inputs, dcp_out=out.detach().to("cpu"))
                else:
                    state.once("dcp_combine_out", logging.INFO, "the DCP combine returned no [B, H/W, Dv] output: not recorded")
        except Exception as e:
            state.fail(e)
        _write(*held)
        return result

    combine.__name__ = "combine"
    combine.__wrapped__ = original  # type: ignore[attr-defined]
    return combine


def _inputs(out: Any, lse: Any, tensors: dict) -> dict:
    """The combine's inputs on the host (copied before it runs: it masks the lse in place)."""
    if not torch.is_tensor(out) or not torch.is_tensor(lse):
        raise Skip("the DCP combine was handed no (out, lse) tensors")
    if out.dim() == 4 and out.shape[1] == 1:
        out = out.squeeze(1)
    if lse.dim() == 3 and lse.shape[-1] == 1:
        lse = lse.squeeze(-1)
    if out.shape != tensors["out"].shape or lse.shape != out.shape[:2]:
        raise Skip("the DCP combine's inputs are not shaped as the rank's call (B, H)")
    return {"dcp_in_out": out.detach().to("cpu", copy=True), "dcp_in_lse": lse.detach().to("cpu", copy=True)}


__all__ = ["MARK", "flush", "hold"]

"""Before the kernel: the cheap filters that decide whether a call is captured (no device work).

In order: CUDA/HIP graph capture and torch.compile tracing (never captured), the step count,
layer and ``EVERY`` filters, the rank, the forward kind (speculative modes the format cannot
describe yet), and the batch's longest request against ``MIN_SEQ_LEN`` from its host copy.
:func:`after_call_filters` is the same graph / layer / rank / ``EVERY`` decision for the wrappers
that decide after their kernel (DeepSeek-V4's sparse entrypoint, V3.2 DSA's aiter decode).
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from refmla.hook.call import Call
from refmla.hook.runtime import compiling, graph_capturing, longest_seq_len, tp_rank
from refmla.hook.writer import HookState

GRAPH_NOTE = (
    "a CUDA/HIP graph is being captured: the hook does nothing inside graph capture, and decode "
    "steps replayed from a graph never reach Python, so they are invisible to it. Run the server "
    "with --disable-cuda-graph to capture decode."
)

# forward kinds the wrapped methods also serve, with why they are not captured (none today: the
# speculative target_verify / draft_extend passes are captured in mode "verify")
NOT_CAPTURED: dict[str, str] = {}

# SGLang ForwardMode names of the speculative passes that run through forward_extend
VERIFY_FORWARD_MODES = ("TARGET_VERIFY", "DRAFT_EXTEND", "DRAFT_EXTEND_V2")


def forward_kind(mode: str, forward_mode: Any) -> str:
    """The capture mode of a call to the ``mode`` method, refined by SGLang's ForwardMode.

    ``forward_extend`` also runs speculative decoding's target-verify pass (several query tokens
    per request, the drafts' KV in the pool, a tree mask) and the draft model's draft-extend pass;
    both are captured as mode ``verify`` (:data:`refmla.hook.modes.READERS`).
    """
    fm = forward_mode
    if mode in ("extend", "verify"):  # both wrap forward_extend
        if fm is not None and hasattr(fm, "is_target_verify") and fm.is_target_verify():
            return "verify"
        if str(getattr(fm, "name", "")) in VERIFY_FORWARD_MODES:
            return "verify"
        return "extend"
    return mode


def before(state: HookState, backend: str, mode: str, layer, forward_batch) -> Optional[Call]:
    """A :class:`Call` when this call is to be captured, else None (skips are counted here)."""
    cfg = state.cfg
    if graph_capturing():
        state.once("graph", logging.WARNING, GRAPH_NOTE)
        return None
    if compiling():
        state.once("compile", logging.WARNING, "torch.compile is tracing the attention backend: not captured there")
        return None
    layer_id = int(getattr(layer, "layer_id", -1))
    step = state.next_step(backend, layer_id)
    if not cfg.wants_layer(layer_id) or step % cfg.every:
        return None
    rank = tp_rank()
    if not cfg.wants_rank(rank):
        return None
    kind = forward_kind(mode, getattr(forward_batch, "forward_mode", None))
    if kind in NOT_CAPTURED:
        state.skip(NOT_CAPTURED[kind])
        return None
    if kind not in cfg.modes:  # forward_extend serves extend and verify: only the kinds asked for
        return None
    if cfg.min_seq_len > 0:
        longest = longest_seq_len(forward_batch)
        if longest is not None and longest < cfg.min_seq_len:
            return None
    return Call(backend=backend, mode=kind, layer=layer, forward_batch=forward_batch,
                layer_id=layer_id, step=step, rank=rank)  # fmt: skip


def after_call_filters(state: HookState, family: str, layer_id: int) -> Optional[tuple[int, int]]:
    """The filters of a capture decided after its kernel ran (the sparse entrypoint, the DSA aiter
    decode): (rank, step) when the call is wanted; None when it is skipped (counted): inside graph
    capture, or by the layer, rank and ``EVERY`` filters (each call counts its step either way)."""
    cfg = state.cfg
    rank = tp_rank()
    step = state.next_step(family, layer_id)
    if graph_capturing():
        state.skip("graph capture", "tensors are placeholders while a graph is captured")
        return None
    if (layer_id >= 0 and not cfg.wants_layer(layer_id)) or not cfg.wants_rank(rank) or step % cfg.every:
        state.skip("filtered", "layer, rank or REFMLA_CAPTURE_EVERY")
        return None
    return rank, step

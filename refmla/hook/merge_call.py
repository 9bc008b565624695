"""(torch) The state merges, captured after their call (meta ``mode`` ``merge``,
``REFMLA_CAPTURE_BACKENDS=merge``), each with the lse base and layout its code documents:

    SGLang  merge_state / merge_state_v2 / merge_state_triton(prefix_output, prefix_lse,
            suffix_output, suffix_lse, output=None, output_lse=None) -> (out, lse); lse [T, H], natural log
    vLLM    merge_attn_states(output, prefix_output, prefix_lse, suffix_output, suffix_lse,
            output_lse=None, prefill_tokens_with_context=None, output_scale=None); lse [H, T],
            natural log; rows at or past prefill_tokens_with_context have no prefix (len_a 0)

A merge called inside another captured merge (SGLang's merge_state calling merge_state_triton) is
not captured twice; one inside a chunked prefill being recorded (refmla.hook.chunked_call) goes to
that capture instead of one of its own. Same filters and budget as every capture; never raises
into the server.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from refmla.hook.call import dressed_as
from refmla.hook.chunked_call import active_recorder, wrap_chunked
from refmla.hook.filters import after_call_filters
from refmla.hook.kvwrite_call import WRITER_READERS, bound_arguments, wrap_writer
from refmla.hook.v4write_call import V4_WRITER_READERS
from refmla.hook.writer import HookState, capture_name
from refmla.merge.io import write_merge

_inside = threading.local()


def _cpu(t: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    t = t.detach().cpu()
    return t.to(dtype) if dtype is not None else t


def sglang_tensors(a: dict, result: Any) -> Optional[dict]:
    out, lse = result if isinstance(result, tuple) else (result, None)
    t = {"out_a": _cpu(a["prefix_output"]), "lse_a": _cpu(a["prefix_lse"], torch.float32),
         "out_b": _cpu(a["suffix_output"]), "lse_b": _cpu(a["suffix_lse"], torch.float32), "out": _cpu(out)}  # fmt: skip
    if lse is not None:
        t["lse"] = _cpu(lse, torch.float32)
    return t


def vllm_tensors(a: dict, result: Any) -> Optional[dict]:
    if a.get("output_scale") is not None:
        return None  # an fp8 output: not this kind's
    t = {"out_a": _cpu(a["prefix_output"]), "lse_a": _cpu(a["prefix_lse"].t(), torch.float32),
         "out_b": _cpu(a["suffix_output"]), "lse_b": _cpu(a["suffix_lse"].t(), torch.float32), "out": _cpu(a["output"])}  # fmt: skip
    if a.get("output_lse") is not None:
        t["lse"] = _cpu(a["output_lse"].t(), torch.float32)
    n, T = a.get("prefill_tokens_with_context"), t["out"].shape[0]
    if n is not None and n < T:
        t["len_a"] = (torch.arange(T) < n).to(torch.int32)  # 0: no prefix keys for this row
    return t


def capture_merge(state: HookState, merger: str, tensors: Optional[dict]) -> None:
    if tensors is None:
        state.skip("merge not captured", "an fp8 output (output_scale)")
        return
    wanted = after_call_filters(state, "merge", -1)
    if wanted is None:
        return
    rank, step = wanted
    if not state.admit(sum(int(v.numel() * v.element_size()) for v in tensors.values())):
        return
    engine = merger.split(".")[0]
    meta = {"mode": "merge", "merger": merger, "lse_base": "e", "engine": engine, "tp_rank": rank, "step": step}
    path = Path(state.cfg.out_dir) / capture_name(mode="merge", rank=rank, layer=0, step=step,
                                                  backend=merger.split(".")[-1], pid=os.getpid())  # fmt: skip
    write_merge(path, tensors, meta)
    state.note_written(path)


def wrap_merge(original: Callable, merger: str, read: Callable[[dict, Any], Optional[dict]],
               state_of: Callable[[], Optional[HookState]]) -> Callable:  # fmt: skip
    """The merge's wrapper: the original's result, then a capture that never raises."""

    def merged(*args, **kwargs):
        state = state_of()
        if state is None or not state.active or getattr(_inside, "on", False):
            return original(*args, **kwargs)
        _inside.on = True
        try:
            result = original(*args, **kwargs)
        finally:
            _inside.on = False
        try:
            tensors = read(bound_arguments(original, args, kwargs), result)
            rec = active_recorder()
            if rec is not None:
                rec.merged(tensors)
            else:
                capture_merge(state, merger, tensors)
        except Exception as e:  # never into the server
            state.fail(e)
        return result

    return dressed_as(merged, original)


MERGE_READERS = {"sglang": sglang_tensors, "vllm": vllm_tensors}
ALL_WRITER_READERS = {**WRITER_READERS, **V4_WRITER_READERS}  # sglang_paths.KV_WRITERS' reader names


def wrapper_for(kind: str, reader: str, original: Callable, name: str,
                state_of: Callable[[], Optional[HookState]]) -> Callable:  # fmt: skip
    """The wrapper the patcher installs for a writer (kind "kvwrite"), a merge (kind "merge") or the
    chunked-prefix prefill core (kind "chunked")."""
    if kind == "kvwrite":
        return wrap_writer(original, ALL_WRITER_READERS[reader], state_of)
    if kind == "chunked":
        return wrap_chunked(original, state_of)
    return wrap_merge(original, f"{reader}.{name}", MERGE_READERS[reader], state_of)


__all__ = ["ALL_WRITER_READERS", "MERGE_READERS", "capture_merge", "sglang_tensors", "vllm_tensors", "wrap_merge", "wrapper_for"]

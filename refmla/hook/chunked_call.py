"""(torch) SGLang's chunked-prefix MHA prefill captured whole, one layer call (meta ``mode``
``chunked_prefill``, ``REFMLA_CAPTURE_BACKENDS=merge``).

SGLang 0.5.23's ``DeepseekMHAForwardMixin.forward_normal_chunked_kv_core(q, k, v, forward_batch)``
(models/deepseek_common/attention_forward_methods/forward_mha.py; the ROCm path prepares q, k, v
its own way and runs the same core) prepares the chunk plan on the batch
(``prefix_chunk_starts_cpu`` / ``prefix_chunk_seq_lens_cpu``, [C, B]), runs ``self.attn_mha`` on
the new tokens (causal, ``mha_return_lse``), then ``_chunked_prefix_attn_mha``: per chunk i the
latent rows of ``prefix_chunk_kv_indices[i]`` up-projected by ``kv_b_proj`` into k, v, then
``attn_mha(q, k, v)`` (not causal, ``attn_attend_prefix_cache``, ``prefix_chunk_idx`` i) and
``merge_state(chunk out, chunk lse, accumulated out, accumulated lse)``. ``merge_state`` alone never
sees q or the keys, so this wrapper records around the core, for a call that passes the filters:

* ``attn_mha``'s own ``forward`` is shadowed on that one module for the call's duration (an
  instance attribute, removed after it): each call's q, k, v and (out, lse) copied to the host;
* the state merges (refmla.hook.merge_call's wrappers) hand each merge's (out, lse) here instead
  of writing a merge capture of their own (a call the filters skip takes its merges with it).

Nothing is copied before the budget admits the whole capture (estimated from the chunk plan at the
first attention call). A call without a cached prefix, or SGLang's fused prefix + extend launch (no
lse, no merge), is not captured. The original always runs with its arguments untouched; an
exception in the recording disables the hook once, logged, never raised.
"""

from __future__ import annotations

import inspect
import os
import sys
import threading
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from refmla.hook.call import dressed_as
from refmla.hook.filters import after_call_filters
from refmla.hook.runtime import compiling, versions
from refmla.hook.writer import HookState, capture_name
from refmla.merge.io import write_chunked

_tap = threading.local()
ATTENTION = "sglang.forward_normal_chunked_kv_core"
FORWARD_CONTEXT = "sglang.srt.model_executor.forward_context"


def active_recorder() -> Optional["Recorder"]:
    """The recorder of the chunked prefill running on this thread, or None."""
    return getattr(_tap, "rec", None)


def _host(t: torch.Tensor, shape: Optional[tuple] = None) -> torch.Tensor:
    t = t.detach()
    return (t.reshape(shape) if shape is not None else t).to("cpu").contiguous()


class Recorder:
    """One chunked prefill's pieces and merges, copied to the host as they happen."""

    def __init__(self, state: HookState, module: Any, layer_id: int, rank: int, step: int):
        self.state, self.module, self.layer_id, self.rank, self.step = state, module, layer_id, rank, step
        self.pieces: dict[int, dict] = {}  # -1 the new tokens', i chunk i: q, k, v, out, lse
        self.merges: list[tuple[torch.Tensor, Optional[torch.Tensor]]] = []
        self.layout: Optional[dict] = None
        self.off: Optional[str] = None  # why this call is not captured (recording stopped)

    def attention(self, a: dict, result: Any) -> None:
        """One ``attn_mha`` call: (q, k, v, forward_batch, ...) bound by name, its result."""
        if self.off is not None:
            return
        fb = a.get("forward_batch")
        if not isinstance(result, tuple) or len(result) < 2 or result[1] is None:
            self.off = "an attention call returned no lse (no cached prefix, or the fused prefix + extend launch)"
            return
        chunk = int(fb.prefix_chunk_idx) if getattr(fb, "attn_attend_prefix_cache", False) else -1
        if self.layout is None and not self._admit(fb, a, result):
            return
        q, k, v = a["q"], a["k"], a["v"]
        H = int(getattr(self.module, "tp_q_head_num", 0) or q.shape[1])
        T = q.shape[0]
        piece = {"k": _host(k, (k.shape[0], H, -1)), "v": _host(v, (v.shape[0], H, -1)),
                 "out": _host(result[0], (T, H, -1)), "lse": _host(result[1], (T, H)).float()}  # fmt: skip
        if chunk < 0:
            piece["q"] = _host(q, (T, H, -1))
        self.pieces[chunk] = piece

    def _admit(self, fb: Any, a: dict, result: Any) -> bool:
        """The chunk plan read from the batch and the capture's size admitted (once, before any copy)."""
        starts, lens = getattr(fb, "prefix_chunk_starts_cpu", None), getattr(fb, "prefix_chunk_seq_lens_cpu", None)
        if starts is None or lens is None or not getattr(fb, "num_prefix_chunks", 0):
            self.off = "the batch holds no prefix chunk plan"
            return False
        C, T = int(lens.shape[0]), int(a["q"].shape[0])
        q, out = a["q"], result[0]
        per_key = (q.numel() // T) * q.element_size() + (out.numel() // T) * a["v"].element_size()
        estimate = (2 * T + int(lens.sum())) * per_key + (2 * C + 1) * (out.numel() * out.element_size() + 4 * result[1].numel())
        if not self.state.admit(estimate):
            self.off = "budget"
            return False
        self.layout = {"extend_lens": torch.tensor(list(fb.extend_seq_lens_cpu), dtype=torch.int32),
                       "prefix_lens": torch.tensor(list(fb.extend_prefix_lens_cpu), dtype=torch.int32),
                       "chunk_starts": torch.as_tensor(starts).to(torch.int32).contiguous(),
                       "chunk_lens": torch.as_tensor(lens).to(torch.int32).contiguous()}  # fmt: skip
        return True

    def merged(self, tensors: Optional[dict]) -> None:
        """One merge inside the call (refmla.hook.merge_call's reader's tensors)."""
        if self.off is None and tensors is not None:
            self.merges.append((tensors["out"], tensors.get("lse")))

    def finish(self) -> None:
        """Write the capture, or count why not."""
        if self.off is not None:
            if self.off not in ("budget", "filtered"):
                self.state.skip("chunked prefill not captured", self.off)
            return
        C = int(self.layout["chunk_lens"].shape[0]) if self.layout else 0
        if sorted(self.pieces) != list(range(-1, C)) or len(self.merges) != C or any(l is None for _, l in self.merges):
            self.state.skip("chunked prefill not captured", f"{len(self.pieces)} attention calls and {len(self.merges)} "
                            f"merges (with lse) for {C} chunks")  # fmt: skip
            return
        new = self.pieces[-1]
        t = {"q": new["q"], "new_k": new["k"], "new_v": new["v"], "new_out": new["out"], "new_lse": new["lse"],
             "chunk_k": torch.cat([self.pieces[i]["k"] for i in range(C)]),
             "chunk_v": torch.cat([self.pieces[i]["v"] for i in range(C)]),
             "chunk_out": torch.stack([self.pieces[i]["out"] for i in range(C)]),
             "chunk_lse": torch.stack([self.pieces[i]["lse"] for i in range(C)]),
             "out": self.merges[-1][0], "lse": self.merges[-1][1], **self.layout}  # fmt: skip
        if C > 1:
            t["step_out"] = torch.stack([o for o, _ in self.merges[:-1]])
            t["step_lse"] = torch.stack([l for _, l in self.merges[:-1]])  # type: ignore[misc]
        backend = _attn_backend()
        meta = {"mode": "chunked_prefill", "merger": "sglang.merge_state", "lse_base": "e", "engine": "sglang",
                "engine_version": versions().get("sglang_version"),
                "sm_scale": float(self.module.scaling), "attention": ATTENTION, "layer_id": self.layer_id,
                "tp_rank": self.rank, "step": self.step, **({"attn_backend": backend} if backend else {})}  # fmt: skip
        path = Path(self.state.cfg.out_dir) / capture_name(mode="chunked_prefill", rank=self.rank, layer=self.layer_id,
                                                           step=self.step, backend="forward_mha", pid=os.getpid())  # fmt: skip
        write_chunked(path, t, meta)
        self.state.note_written(path)


def _attn_backend() -> Optional[str]:
    """The class of the attention backend SGLang published for this forward (never imports SGLang)."""
    fc = sys.modules.get(FORWARD_CONTEXT)
    try:
        return type(fc.get_attn_backend()).__name__ if fc is not None and fc.has_forward_context() else None
    except Exception:
        return None


def _shadow_forward(module: Any, rec: Recorder) -> Callable[[], None]:
    """Shadow ``module.forward`` with a recording one; returns what restores it."""
    had, prev = "forward" in module.__dict__, module.__dict__.get("forward")
    inner = module.forward
    sig = inspect.signature(inner)

    def forward(*args, **kwargs):
        result = inner(*args, **kwargs)
        try:
            b = sig.bind(*args, **kwargs)
            rec.attention({**b.arguments, **b.arguments.get("kwargs", {})}, result)
        except Exception as e:  # never into the server
            rec.off = "failed"
            rec.state.fail(e)
        return result

    object.__setattr__(module, "forward", forward)

    def restore() -> None:
        if had:
            object.__setattr__(module, "forward", prev)
        else:
            module.__dict__.pop("forward", None)

    return restore


def _start(state: HookState, layer: Any) -> Optional[Recorder]:
    """The call's recorder; one that is ``off`` "filtered" when the filters skip the call (its
    merges belong to it: neither recorded nor captured apart)."""
    module = getattr(layer, "attn_mha", None)
    if module is None or not hasattr(module, "forward") or compiling():
        return None
    layer_id = int(getattr(module, "layer_id", getattr(layer, "layer_id", -1)))
    wanted = after_call_filters(state, "chunked_prefill", layer_id)
    rec = Recorder(state, module, layer_id, *(wanted or (-1, -1)))
    rec.off = None if wanted is not None else "filtered"
    return rec


def wrap_chunked(original: Callable, state_of: Callable[[], Optional[HookState]]) -> Callable:
    """The wrapper of ``forward_normal_chunked_kv_core``: the original's result, recorded around it."""

    def core(self, *args, **kwargs):
        state = state_of()
        if state is None or not state.active or active_recorder() is not None:
            return original(self, *args, **kwargs)
        rec, restore = None, None
        try:
            rec = _start(state, self)
            if rec is not None:
                restore = _shadow_forward(rec.module, rec) if rec.off is None else None
                _tap.rec = rec
        except Exception as e:  # never into the server
            state.fail(e)
            rec = None
        try:
            result = original(self, *args, **kwargs)
        finally:
            _tap.rec = None
            try:
                if restore is not None:
                    restore()
            except Exception as e:
                state.fail(e)
        try:
            if rec is not None and state.active:
                rec.finish()
        except Exception as e:  # never into the server
            state.fail(e)
        return result

    return dressed_as(core, original)


__all__ = ["ATTENTION", "Recorder", "active_recorder", "wrap_chunked"]

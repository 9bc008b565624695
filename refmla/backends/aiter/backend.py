"""The ``aiter`` backend class: a capture in, aiter's decode output and an info dict out."""

from __future__ import annotations

from refmla.backends.aiter.probe import aiter_status
from refmla.backends.aiter.run import run_aiter_decode
from refmla.backends.base import Backend, BackendResult, BackendUnavailable


class AiterBackend(Backend):
    name = "aiter"

    def availability(self) -> tuple[bool, str]:
        return aiter_status()

    def run(self, cap, opts) -> BackendResult:
        m = cap.meta
        if not cap.is_decode:
            raise BackendUnavailable("decode kernel; capture is extend mode")
        ok, why = self.availability()
        if not ok:
            raise BackendUnavailable(why)
        page_mode = getattr(opts, "aiter_page_size", None)
        P = int(page_mode) if page_mode else m.page_size
        out_dtype = cap.out_dtype
        lens = cap.seq_lens.long()
        try:
            out, info = run_aiter_decode(
                cap.q, cap.kv_buffer, cap.kv_indptr, cap.kv_indices, kv_lora_rank=m.kv_lora_rank,
                sm_scale=m.sm_scale, logit_cap=m.logit_cap, k_scale=m.k_scale, v_scale=m.v_scale,
                page_size=P, out_dtype=out_dtype, device=getattr(opts, "device", None),
            )  # fmt: skip
        except AssertionError as e:  # aiter asserts what it does not support (logit_cap > 0, head counts)
            raise BackendUnavailable(f"aiter refused this input: {e}") from None
        if bool((lens == 0).any()):
            info["zero_length_requests"] = "output rows of zero-length requests are not compared"
        return BackendResult(out=out, info=info, defines_empty_rows=not bool((lens == 0).any()))


__all__ = ["AiterBackend"]

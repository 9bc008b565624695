"""The ``aiter`` backend class: a capture in, the output of the aiter path production ran, and info.

The path comes from the capture's meta (refmla.backends.aiter.paths): ``persistent``,
``non_persistent`` or ``gluon`` are replayed; any other (DCP, a name this refmla does not know)
is ``skipped`` naming it. ``info.path`` says which path ran, ``info.production_path`` what the
capture recorded and the knobs used. Rebuilt persistent metadata that differs from the captured
buffers is a :class:`~refmla.backends.base.BackendFinding` (the backend then fails).
"""

from __future__ import annotations

import dataclasses

from refmla.backends.aiter.gluon import run_gluon_decode
from refmla.backends.aiter.indices import AiterCall
from refmla.backends.aiter.metadata import CAPTURED
from refmla.backends.aiter.paths import GLUON, PERSISTENT, REPLAYABLE, production_path
from refmla.backends.aiter.persistent import run_persistent_decode
from refmla.backends.aiter.probe import aiter_status
from refmla.backends.aiter.run import check_kv_scales, run_aiter_decode
from refmla.backends.base import Backend, BackendResult, BackendUnavailable
from refmla.capture import Capture
from refmla.options import ReplayOptions


def captured_buffers(cap: Capture) -> dict:
    """Production's persistent work buffers the capture carries (tensor ``aiter_<name>``), by name."""
    return {name: getattr(cap, f"aiter_{name}", None) for name in CAPTURED}


class AiterBackend(Backend):
    name = "aiter"
    fills_buffers = True  # o is allocated here (torch.empty, or filled with opts.buffer_fill when given)
    unpoisoned = "the split partials (logits, attn_lse): mla_decode_fwd allocates them itself"

    def availability(self) -> tuple[bool, str]:
        return aiter_status()

    def run(self, cap: Capture, opts: ReplayOptions) -> BackendResult:
        m = cap.meta
        if not cap.is_decode:
            raise BackendUnavailable("decode kernel; capture is extend mode")
        path = production_path(m, heads=cap.num_heads, kv_fp8=cap.kv_buffer.dtype.itemsize == 1)
        if path.name not in REPLAYABLE:
            raise BackendUnavailable(path.unreplayable())
        ok, why = self.availability()
        if not ok:
            raise BackendUnavailable(why)
        lens = cap.seq_lens.long()
        findings = []
        try:
            out, info, findings = self._run_path(cap, opts, path)
        except AssertionError as e:  # aiter asserts what it does not support (logit_cap > 0, head counts)
            raise BackendUnavailable(f"aiter refused this input ({path.name} path): {e}") from None
        info["path"] = path.name
        info["production_path"] = path.to_json()
        if bool((lens == 0).any()):
            info["zero_length_requests"] = "output rows of zero-length requests are not compared"
        return BackendResult(out=out, info=info, defines_empty_rows=not bool((lens == 0).any()), findings=findings)

    @staticmethod
    def _run_path(cap: Capture, opts: ReplayOptions, path):
        m, sc = cap.meta, cap.scales()
        call = AiterCall(out_dtype=cap.out_dtype, device=opts.device, fill=opts.buffer_fill)
        if path.name == PERSISTENT:
            check_kv_scales(cap.kv_buffer, m.k_scale, m.v_scale)
            return run_persistent_decode(cap.q, cap.kv_buffer, cap.kv_indptr, cap.kv_indices, sc, path,
                                         dataclasses.replace(call, page_size=m.page_size), captured_buffers(cap))  # fmt: skip
        if path.name == GLUON:
            check_kv_scales(cap.kv_buffer, m.k_scale, m.v_scale)
            if m.logit_cap > 0:
                raise BackendUnavailable(f"aiter's gluon kernel has no logit_cap (capture has {m.logit_cap})")
            out, info = run_gluon_decode(cap.q, cap.kv_buffer, cap.kv_indptr, cap.kv_indices, sc, call)
            return out, info, []
        # non-persistent: page-level when asked or when no path is recorded (refmla's long-standing
        # default); token-level, as SGLang 0.5.23 calls it, when the capture records the path
        page_mode = opts.aiter_page_size
        P = int(page_mode) if page_mode else (1 if path.recorded else m.page_size)
        out, info = run_aiter_decode(cap.q, cap.kv_buffer, cap.kv_indptr, cap.kv_indices, sc,
                                     dataclasses.replace(call, page_size=P))  # fmt: skip
        return out, info, []


__all__ = ["AiterBackend", "captured_buffers"]

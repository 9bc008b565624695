"""The two backends that need no kernel: the fp64 reference and the capture's observed output."""

from __future__ import annotations

from dataclasses import asdict

import torch

from refmla import reference as ref
from refmla.backends.base import Backend, BackendResult, BackendUnavailable


def reference_output(cap, accum_dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """out [R, H, Dv] and lse [R, H] of the capture, decode or extend, in accum_dtype."""
    args = (cap.q, cap.kv_buffer, cap.kv_indptr, cap.kv_indices)
    if cap.is_decode:
        return ref.mla_decode_ref(*args, **asdict(cap.scales()), accum_dtype=accum_dtype)
    if cap.is_verify:
        return ref.mla_verify_ref(*args, cap.qo_indptr, **cap.mask_args(), **asdict(cap.scales()),
                                  accum_dtype=accum_dtype)  # fmt: skip
    return ref.mla_extend_ref(*args, cap.qo_indptr, **asdict(cap.scales()), accum_dtype=accum_dtype)


class ReferenceBackend(Backend):
    name = "reference"

    def availability(self) -> tuple[bool, str]:
        return True, f"pure PyTorch {torch.__version__}, fp64"

    def run(self, cap, opts) -> BackendResult:
        out, lse = reference_output(cap)
        return BackendResult(out=out, lse=lse, info={"accum_dtype": "float64"})


class ObservedBackend(Backend):
    name = "observed"

    def availability(self) -> tuple[bool, str]:
        return True, "the capture's `out` tensor"

    def run(self, cap, opts) -> BackendResult:
        if cap.out is None:
            raise BackendUnavailable("capture has no `out` tensor")
        return BackendResult(
            out=cap.out, lse=cap.lse, attn_logits=cap.attn_logits, attn_lse=cap.attn_lse, num_kv_splits=cap.num_kv_splits,
            info={"produced_by": cap.meta.backend},
            # a production kernel's rows for zero-length requests are whatever it left there
            defines_empty_rows=False,
        )  # fmt: skip

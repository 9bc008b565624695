"""The two backends that need no kernel: the fp64 reference and the capture's observed output."""

from __future__ import annotations

import torch

from refmla import reference as ref
from refmla.backends.base import Backend, BackendResult, BackendUnavailable
from refmla.arithmetic import producer_arithmetic
from refmla.capture import Capture
from refmla.options import ReplayOptions


def reference_output(cap: Capture, accum_dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """out [R, H, Dv] and lse [R, H] of the capture, any mode, in accum_dtype."""
    return ref.mla_ref(cap.q, cap.kv_buffer, cap.attended(), cap.scales(), accum_dtype=accum_dtype)


class ReferenceBackend(Backend):
    name = "reference"

    def availability(self) -> tuple[bool, str]:
        return True, f"pure PyTorch {torch.__version__}, fp64"

    def run(self, cap: Capture, opts: ReplayOptions) -> BackendResult:
        out, lse = reference_output(cap)
        return BackendResult(out=out, lse=lse, info={"accum_dtype": "float64"})


class ObservedBackend(Backend):
    name = "observed"

    def availability(self) -> tuple[bool, str]:
        return True, "the capture's `out` tensor"

    def run(self, cap: Capture, opts: ReplayOptions) -> BackendResult:
        if cap.out is None:
            raise BackendUnavailable("capture has no `out` tensor")
        res = BackendResult(
            out=cap.out, lse=cap.lse, attn_logits=cap.attn_logits, attn_lse=cap.attn_lse, num_kv_splits=cap.num_kv_splits,
            info={"produced_by": cap.meta.backend},
            # a production kernel's rows for zero-length requests are whatever it left there
            defines_empty_rows=False,
        )  # fmt: skip
        res.arithmetic = producer_arithmetic(cap)  # its split schedule, rounding and lse base
        if res.arithmetic.q_round == "whole_e4m3":  # the hook saw q go in as e4m3
            res.info["control"] = "q quantized to e4m3 whole (latent and rope), as the production kernel took it"
        return res

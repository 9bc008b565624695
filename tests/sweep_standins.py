"""A correct kernel not written here, as a backend the sweep can check: aiter's torch reference.

``aiter_torch_ref`` runs :func:`refmla.synth.benign.fp32_einsum`, aiter's own torch reference
written its way (op_tests/test_mla.py's torch_mla_extend: rows gathered as stored, an fp32 einsum
per request, a causal bias, softmax, an fp32 einsum with V, one rounding) -- the stand-in
tools/bench_diagnosis.py counts false alarms with. It reads kv_indptr / qo_indptr itself, not
refmla.attended. A correct kernel: a sweep must find nothing in it.
"""

from __future__ import annotations

import refmla.backends as backends
from refmla.backends.base import Backend, BackendResult, BackendUnavailable
from refmla.synth.benign import fp32_einsum

NAME = "aiter_torch_ref"


class AiterTorchRef(Backend):
    name = NAME

    def availability(self) -> tuple[bool, str]:
        return True, "aiter's torch reference (fp32 einsum per request), refmla.synth.benign.fp32_einsum"

    def run(self, cap, opts) -> BackendResult:
        if cap.custom_mask is not None:
            raise BackendUnavailable("aiter's torch reference is causal only; this capture has a tree mask")
        out = fp32_einsum(cap.q, cap.kv_buffer, cap.kv_indptr, cap.kv_indices, cap.qo_indptr, cap.scales(),
                          cap.out_dtype)  # fmt: skip
        return BackendResult(out=out, info={"what": "aiter torch reference"})


def install() -> None:
    """Make ``aiter_torch_ref`` a backend name in this process (a sweep's ``setup``:
    ``sweep_standins:install``, run again in every worker)."""
    backends._CACHE[NAME] = AiterTorchRef()
    backends._WHERE[NAME] = f"sweep_standins:{AiterTorchRef.__name__}"

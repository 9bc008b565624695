"""A correct kernel not written here, as a backend the sweep can check: aiter's torch reference.

``aiter_torch_ref`` runs :func:`refmla.synthetic.benign.fp32_einsum`, aiter's own torch reference
written its way (op_tests/test_mla.py's torch_mla_extend: rows gathered as stored, an fp32 einsum
per request, a causal bias, softmax, an fp32 einsum with V, one rounding) -- the stand-in
tools/bench_diagnosis.py counts false alarms with. It reads kv_indptr / qo_indptr itself, not
refmla.attended. A correct kernel: a sweep must find nothing in it.
"""

from __future__ import annotations

import refmla.backends as backends
from refmla.backends.base import Backend, BackendResult, BackendUnavailable
from refmla.synthetic.benign import fp32_einsum

NAME = "aiter_torch_ref"


class AiterTorchRef(Backend):
    name = NAME

    def availability(self) -> tuple[bool, str]:
        return True, "aiter's torch reference (fp32 einsum per request), refmla.synthetic.benign.fp32_einsum"

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


def record_gpu(folder: str) -> None:
    """A sweep's ``setup`` (``sweep_standins:record_gpu:FOLDER``): each worker writes the GPU
    variables it started with to FOLDER/<pid> (what ``--jobs`` pinned it to)."""
    import json
    import os
    from pathlib import Path

    seen = {v: os.environ.get(v) for v in ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES")}
    (Path(folder) / str(os.getpid())).write_text(json.dumps(seen))


class DiesAt8Heads(Backend):
    """The fp64 reference, except that its process dies at 8 heads (run it with REFMLA_ISOLATE=0:
    the sweep's worker itself dies, as a kernel that takes its process down outside isolation),
    unless it is the process ``REFMLA_TEST_SPARE_PID`` names (the test's own)."""

    name = "dies_at_8_heads"

    def availability(self) -> tuple[bool, str]:
        return True, "the reference; os._exit(3) at 8 heads"

    def run(self, cap, opts) -> BackendResult:
        import os

        if cap.q.shape[1] == 8 and str(os.getpid()) != os.environ.get("REFMLA_TEST_SPARE_PID"):
            os._exit(3)
        return backends.get_backend("reference").run(cap, opts)


def install_dies() -> None:
    """``dies_at_8_heads`` a backend name in this process (setup ``sweep_standins:install_dies``)."""
    backends._CACHE[DiesAt8Heads.name] = DiesAt8Heads()
    backends._WHERE[DiesAt8Heads.name] = f"sweep_standins:{DiesAt8Heads.__name__}"


class RaisesAt8Heads(Backend):
    """The fp64 reference, except that it raises at 8 heads (a kernel that refuses a shape with an
    exception, or crashes in its isolated child: an ``error`` finding, deterministic)."""

    name = "raises_at_8_heads"

    def availability(self) -> tuple[bool, str]:
        return True, "the reference; RuntimeError at 8 heads"

    def run(self, cap, opts) -> BackendResult:
        if cap.q.shape[1] == 8:
            raise RuntimeError("illegal memory access (planted at 8 heads)")
        return backends.get_backend("reference").run(cap, opts)

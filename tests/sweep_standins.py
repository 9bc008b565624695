"""Stand-in backends for the sweep's tests.

``aiter_peer_ref``: a correct kernel not written here -- aiter's own torch reference
(``op_tests/test_mla.py::torch_mla_extend``), loaded at run time from the aiter checkout
``$REFMLA_AITER_REPO`` names by tools/aiter_peer.py (nothing of aiter is copied into refmla).

``flashmla_peer_ref``: a correct sparse kernel not written here -- FlashMLA's own torch reference
(``tests/ref.py::ref_sparse_attn_decode``), loaded at run time from the FlashMLA checkout
``$REFMLA_FLASHMLA_REPO`` names by tools/flashmla_peer.py; the sparse layout's cases reach it with
their caches dequantized by refmla (as FlashMLA's tests dequantize theirs before calling it).

``aiter_torch_ref``: refmla's own rewrite of aiter's reference (:func:`refmla.synthetic.benign.fp32_einsum`:
rows gathered as stored, an fp32 einsum per request, softmax, an fp32 einsum with V, one rounding),
the stand-in tools/bench_diagnosis.py counts false alarms with. It is written here: a second
formulation, not an independent check.
"""

from __future__ import annotations

import os

import refmla.backends as backends
from refmla.backends.base import Backend, BackendResult, BackendUnavailable
from refmla.synthetic.benign import fp32_einsum

NAME = "aiter_torch_ref"
PEER = "aiter_peer_ref"


class AiterTorchRef(Backend):
    name = NAME

    def availability(self) -> tuple[bool, str]:
        return True, "refmla's rewrite of aiter's torch reference (fp32 einsum per request), refmla.synthetic.benign.fp32_einsum"

    def run(self, cap, opts) -> BackendResult:
        if cap.custom_mask is not None:
            raise BackendUnavailable("aiter's torch reference is causal only; this capture has a tree mask")
        out = fp32_einsum(cap.q, cap.kv_buffer, cap.kv_indptr, cap.kv_indices, cap.qo_indptr, cap.scales(),
                          cap.out_dtype)  # fmt: skip
        return BackendResult(out=out, info={"what": "aiter torch reference"})


class AiterPeerRef(Backend):
    """aiter's own ``torch_mla_extend`` from the checkout ``$REFMLA_AITER_REPO`` names, on decode
    captures (one query row per request, as aiter's tests call it). It takes no k_scale / v_scale
    and no logit cap: points with them are n/a (``refuses``)."""

    name = PEER

    def _peer(self):
        from helpers import load_tool

        repo = os.environ.get("REFMLA_AITER_REPO")
        if not repo:
            raise BackendUnavailable("no aiter checkout: set REFMLA_AITER_REPO to one")
        return load_tool("aiter_peer").load_aiter_peer(repo)

    def availability(self) -> tuple[bool, str]:
        try:
            peer = self._peer()
        except Exception as e:
            return False, str(e)
        return True, f"aiter's {peer.path}::torch_mla_extend {peer.commit}".strip()

    def refuses(self, cap):
        m = cap.meta
        if m.mode != "decode":
            return f"aiter's torch reference is called here as its tests call it for decode; this capture is {m.mode}"
        if m.k_scale != 1.0 or m.v_scale != 1.0 or m.logit_cap > 0 or cap.kv_buffer.dtype.itemsize == 1:
            return "aiter's torch reference takes no k_scale / v_scale, fp8 pool or logit cap"
        return None

    def run(self, cap, opts) -> BackendResult:
        why = self.refuses(cap)
        if why:
            raise BackendUnavailable(why)
        peer = self._peer()
        out, lse = peer.decode(cap.q, cap.kv_buffer, cap.kv_indptr, cap.kv_indices.long(),
                               kv_lora_rank=cap.meta.kv_lora_rank, sm_scale=cap.meta.sm_scale)  # fmt: skip
        return BackendResult(out=out.to(cap.out_dtype), info={"what": f"aiter {peer.path}"},
                             defines_empty_rows=not bool((cap.seq_lens == 0).any()))  # fmt: skip


def install() -> None:
    """Make ``aiter_torch_ref`` and ``aiter_peer_ref`` backend names in this process (a sweep's
    ``setup``: ``sweep_standins:install``, run again in every worker)."""
    for cls in (AiterTorchRef, AiterPeerRef):
        backends._CACHE[cls.name] = cls()
        backends._WHERE[cls.name] = f"sweep_standins:{cls.__name__}"


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


class SleepsAt8Heads(Backend):
    """The fp64 reference, 0.2 s slower a run, except that at 8 heads it runs for 100 s where
    ``REFMLA_TEST_LONG_AT_8=1`` (a case that cannot finish in what is left of a short budget)."""

    name = "sleeps_at_8_heads"

    def availability(self) -> tuple[bool, str]:
        return True, "the reference; 0.2 s a run, 100 s at 8 heads (REFMLA_TEST_LONG_AT_8=1)"

    def run(self, cap, opts) -> BackendResult:
        import os
        import time

        long = cap.q.shape[1] == 8 and os.environ.get("REFMLA_TEST_LONG_AT_8") == "1"
        time.sleep(100.0 if long else 0.2)
        return backends.get_backend("reference").run(cap, opts)


def install_sleeper() -> None:
    """``sleeps_at_8_heads`` a backend name in this process (setup ``sweep_standins:install_sleeper``)."""
    backends._CACHE[SleepsAt8Heads.name] = SleepsAt8Heads()
    backends._WHERE[SleepsAt8Heads.name] = f"sweep_standins:{SleepsAt8Heads.__name__}"


FLASHMLA_PEER = "flashmla_peer_ref"


def flashmla_peer_path(cap):
    """A sparse path (refmla.sparse.backends.BACKENDS): FlashMLA's tests/ref.py from ``$REFMLA_FLASHMLA_REPO``."""
    from helpers import load_tool

    from refmla.sparse.backends import PathOutput, Unavailable

    tool = load_tool("flashmla_peer")
    repo = os.environ.get(tool.ENV)
    if not repo:
        raise Unavailable(f"no FlashMLA checkout: set {tool.ENV} to one")
    try:
        peer = tool.load_flashmla_peer(repo)
    except tool.FlashMLAPeerError as e:
        raise Unavailable(str(e)) from None
    out, lse = peer.decode(cap)
    return PathOutput(out, lse, f"FlashMLA {peer.path}::{tool.ENTRY} {peer.commit}".strip())


def install_flashmla_peer() -> None:
    """``flashmla_peer_ref`` a sparse path in this process (setup ``sweep_standins:install_flashmla_peer``)."""
    from refmla.sparse.backends import BACKENDS

    BACKENDS[FLASHMLA_PEER] = flashmla_peer_path

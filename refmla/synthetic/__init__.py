"""Synthetic captures: real Kimi-K2 / DeepSeek-V3 shapes, hostile pools, planted faults.

    spec.py     SynthSpec (the shapes, dtypes and scales of one capture) and the named presets
    inputs.py   q, a paged pool shuffled and poisoned with NaN, SGLang's metadata, the meta
    faults.py   the observed `out` under a planted fault, one registered function per fault
    rounding.py correct kernels that round differently (registered in faults.py's registry)
    disagg.py   a disaggregated pair: prefill and decode captures of the same requests, on other slots
    disagg_faults.py  its faults (transfer, metadata, compute) and what `refmla disagg` must name
    disagg_sparse.py  the same over sparse pools (DeepSeek-V4: window + compressed caches; V3.2): the
                KV map on both sides, transfer faults in either cache, what `refmla disagg` must name
    reload.py   a prefix reloaded from a host tier (or an L3 store) under another rid, a page of it corrupted
                or not landed: what diff-kv pairs by the tokens the rows hold
    verify_faults.py  the speculative-verify faults (draft KV, causal alignment, masks, qlen padding)
    benign.py   correct kernels that round their own way (expect=None): they must pass
    blocktable_faults.py  the block-table kernels' faults (vLLM, FlashMLA, FlashInfer), planted
                with their own loop
    zoo.py      faults taken from real bugs in real MLA kernels (pages, empty splits, 32-bit
                offsets, fp8 scales, rope), each with the hypothesis that must name it
    launch_faults.py  faults of a kernel's launch plan: heads folded and unfolded wrongly
    kv_bytes_faults.py  the bytes between writer and kernel: fp8 encoding, scale format, page stride
    dcp.py      a decode-context-parallel step: one rank capture per DCP rank, clean or with a CP mistake

The pool is paged: each request's pages are shuffled across the pool, every row no request
attends (unused pages and the tail of each last page) is NaN, so a kernel that reads past its
metadata shows at once. The capture's ``out`` is what a correct kernel produces (the
low-precision control) unless a fault is planted, in which case it is the reference computed
under that fault -- the kind of wrong a real kernel or a real transfer bug produces.
"""

from __future__ import annotations

from typing import Any

from refmla.capture import write_capture
from refmla.schedule import MIN_BLOCK_KV
from refmla.synthetic import benign, blocktable_faults, kv_bytes_faults, launch_faults, verify_faults, zoo  # noqa: F401  (register the benign variants, the verify
#                                                    faults and the zoo's faults)
from refmla.synthetic import rounding as _rounding  # noqa: F401  (registers the numerics faults)
from refmla.synthetic.faults import EXPECT, FAULT_MODES, FAULTS, MAY_AGREE, VERIFY_PRESET, faulty_output, spec_for
from refmla.synthetic.inputs import geometry_meta, make_inputs, make_meta
from refmla.synthetic.spec import DEEPSEEK_V3_SCALE, KIMI_K2_SCALE, PRESETS, SynthSpec, preset, yarn_sm_scale


def synth_capture(path: Any, spec: SynthSpec, fault: str = "none") -> dict:
    """Write a synthetic capture to ``path``; returns what was planted (on the spec the fault needs:
    refmla.synthetic.faults.spec_for)."""
    spec = spec_for(spec, fault) if fault in FAULTS else spec
    t = make_inputs(spec)
    out, planted = faulty_output(spec, t, fault)
    t["out"] = out
    meta = make_meta(spec)
    meta["synth"]["fault"] = planted
    write_capture(path, t, meta, compact=False)  # keep the poisoned rows: that is the point
    return planted


__all__ = [
    "DEEPSEEK_V3_SCALE", "EXPECT", "FAULT_MODES", "FAULTS", "KIMI_K2_SCALE", "MAY_AGREE", "MIN_BLOCK_KV", "PRESETS",
    "SynthSpec", "VERIFY_PRESET", "faulty_output", "geometry_meta", "make_inputs", "make_meta", "preset", "spec_for",
    "synth_capture", "yarn_sm_scale",
]  # fmt: skip

"""Faults in the parts of a kernel's result besides its output, planted in real kernels for the
sweep's tests: the output stays right, so a sweep that judged the output alone would pass them.

As tests/planted_sglang.py and tests/planted_layouts.py do, nothing of either engine is copied:
the installed kernel module's source is read at test time and one line of one stage is edited.

    partials_lse  SGLang's decode kernel (``triton``, layout ``decode``): stage 1 stores every
                  split's lse 0.5 too large. Stage 2's merge weighs the splits by exp(lse - max),
                  which a shift common to all of them cancels: the output is right, the split
                  partials a consumer reads (a cascade merge, a speculative verifier) are wrong.
    lse_base      vLLM's TRITON_MLA decode kernel (``vllm_triton``, layout ``block_table``):
                  stage 2 stores the final lse in base 2 (times 1 / ln 2) where vLLM declares the
                  natural log; the output is unchanged.
"""

from __future__ import annotations

from planted_layouts import VLLM_MODULE, PlantedVllm
from planted_sglang import PlantedTriton

SGLANG_PLANTS = {
    "partials_lse": ("_fwd_grouped_kernel_stage1", "e_max + tl.log(e_sum),", "e_max + tl.log(e_sum) + 0.5,"),
}
VLLM_PLANTS = {
    "lse_base": (VLLM_MODULE, "_fwd_kernel_stage2", "lse_val = e_max + tl.log(e_sum)",
                 "lse_val = (e_max + tl.log(e_sum)) * 1.4426950408889634"),
}  # fmt: skip
BACKEND = {"partials_lse": "triton", "lse_base": "vllm_triton"}
LAYOUT = {"partials_lse": "decode", "lse_base": "block_table"}
PART = {"partials_lse": "attn_logits", "lse_base": "lse"}  # the part the sweep must name (refmla.results.PART_NAMES)


def planted(plant: str):
    """The backend running the planted kernel, under the name of the backend it replaces."""
    if plant in SGLANG_PLANTS:
        b = PlantedTriton(plant, SGLANG_PLANTS)
    else:
        b = PlantedVllm(plant, VLLM_PLANTS)
    b.name = BACKEND[plant]
    return b

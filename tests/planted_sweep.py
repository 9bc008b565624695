"""Shape-conditional regressions planted in SGLang's real Triton decode kernel, for the sweep's tests.

As tests/planted_sglang.py does, nothing of SGLang is copied: at test time the installed kernel
module's source is read and one line of one stage is edited; the planted kernel then runs as the
backend called ``triton`` (:func:`install`), so ``refmla sweep --backend triton`` checks it
exactly as it would check SGLang's own. Each plant is a fault that shows only on some shapes:

    heads32        stage 1 scales the logits by 1.25 more when the rank holds 32 query heads (a
                   head-folding path that is wrong for one head count: vLLM #46952's class)
    empty_split    stage 2 merges a split that is empty because it starts exactly at the length
                   (``>=`` for ``>``): it reads partials stage 1 never wrote (aiter #3641's class)
    unwritten_row  stage 2 never stores the output of the batch's third request (a row the kernel
                   leaves as the buffer held it: SGLang #19902's class)
    nondeterministic  stage 2 drops a non-empty split from the merge at random, about 1 in 64 of
                   them (the split-K reduce race of aiter #4420: wrong, sometimes, on identical
                   inputs); os.urandom, so a forked run does not inherit the parent's random state

The check each must fail is :data:`EXPECTED`. empty_split's merged partial is one stage 1 never
wrote, so ``nan_fill`` names it on every shape it fires on; ``splits`` (and ``reference``) only
where the buffer's 0 moves the answer past the tolerance. The line edits run only in the Triton interpreter
(``__import__`` inside a kernel is plain Python there), which is where these tests run.
"""

from __future__ import annotations

import refmla.backends as backends
from planted_sglang import PlantedTriton

SWEEP_PLANTS = {
    "heads32": ("_fwd_grouped_kernel_stage1", "qk *= sm_scale_withk",
                "qk *= sm_scale_withk * (1.25 if q_head_num == 32 else 1.0)"),
    "empty_split": ("_fwd_kernel_stage2", "if split_kv_end > split_kv_start:", "if split_kv_end >= split_kv_start:"),
    "unwritten_row": ("_fwd_kernel_stage2", "acc / e_sum * v_scale,\n        mask=mask_d,",
                      "acc / e_sum * v_scale,\n        mask=mask_d & ((offs_d * 0 + cur_batch) != 2),"),
    "nondeterministic": ("_fwd_kernel_stage2", "if split_kv_end > split_kv_start:",
                         "if split_kv_end > split_kv_start and __import__('os').urandom(1)[0] >= 4:"),
}  # fmt: skip

# plant -> the sweep check that must name it
EXPECTED = {"heads32": "reference", "empty_split": "nan_fill", "unwritten_row": "nan_fill", "nondeterministic": "repeat"}

# --space restrictions under which each plant is reached within a small budget (make test)
QUICK_SPACE = {
    "heads32": ["heads=32,8", "length=page+1", "batch=1", "page=16", "kv=bfloat16", "cap=0", "splits=2"],
    "empty_split": ["heads=8", "length=32k", "batch=1", "page=1", "kv=bfloat16", "cap=0", "splits=past"],
    "unwritten_row": ["heads=8", "length=1,page+1", "batch=3", "page=16", "kv=bfloat16", "cap=0", "splits=1"],
    "nondeterministic": ["heads=64", "length=32k", "batch=1", "page=16", "kv=bfloat16", "cap=0", "splits=16"],
}


class SweepPlant(PlantedTriton):
    """SGLang's kernel with one sweep plant, under the name ``triton``."""

    def __init__(self, plant: str):
        super().__init__(plant, SWEEP_PLANTS)
        self.name = "triton"


def install(plant: str) -> None:
    """Make the backend ``triton`` run the planted kernel in this process (a sweep's ``setup``:
    ``planted_sweep:install:<plant>``, run again in every worker)."""
    backends._CACHE["triton"] = SweepPlant(plant)

"""Off-by-ones at the exact boundaries of SGLang's split schedule, planted in its real Triton decode
kernel for the sweep's tests (as tests/planted_sglang.py does: the installed module's source is read
at test time and one line of one stage is edited; nothing of SGLang is copied).

Each fires only when request 0's length L is an exact multiple of the split length SGLang's
schedule gives it (per = ceil(ceil(L / n) / 32) * 32) and fills two splits at least: L = n x per,
the "edge" a sweep must walk early; one token more or less and the kernel is right.

    stage1_edge  stage 1 ends each split one token early on such a length (every split's last token
                 never attended)
    stage2_edge  stage 2 takes the last split of such a length for empty and merges without it
"""

from __future__ import annotations

import refmla.backends as backends
from planted_sglang import PlantedTriton

ON_EDGE = "((cur_batch_seq_len % kv_len_per_split == 0) & (cur_batch_seq_len > kv_len_per_split)).to(tl.int32)"
EDGE_PLANTS = {
    "stage1_edge": ("_fwd_grouped_kernel_stage1",
                    "split_kv_end = tl.minimum(split_kv_start + kv_len_per_split, cur_batch_seq_len)",
                    f"split_kv_end = tl.minimum(split_kv_start + kv_len_per_split, cur_batch_seq_len) - {ON_EDGE}"),
    "stage2_edge": ("_fwd_kernel_stage2",
                    "split_kv_end = tl.minimum(split_kv_start + kv_len_per_split, cur_batch_seq_len)",
                    "split_kv_end = tl.minimum(split_kv_start + kv_len_per_split, "
                    f"cur_batch_seq_len - {ON_EDGE} * kv_len_per_split)"),
}  # fmt: skip


class EdgePlant(PlantedTriton):
    """SGLang's kernel with one edge plant, under the name ``triton``."""

    def __init__(self, plant: str):
        super().__init__(plant, EDGE_PLANTS)
        self.name = "triton"


def install(plant: str) -> None:
    """A sweep's ``setup`` (``planted_edges:install:<plant>``): ``triton`` runs the planted kernel."""
    backends._CACHE["triton"] = EdgePlant(plant)

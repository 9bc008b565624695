"""Which stage of a split kernel goes wrong, from its own intermediate results:

    stage1      a split's partial output differs from the split reference
    stage1_lse  the partials are right, a split's lse is not
    stage2      every partial and lse is right, and merging the kernel's *own* partials with the
                reference merge gives the reference output: the kernel's merge is wrong
    lse         the output is right and only the final lse is wrong (it is not the merge of the
                kernel's own split lse)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from refmla import reference as ref
from refmla.compare import judged_dtype
from refmla.context import ReplayContext
from refmla.splits import SplitRows, split_rows


@dataclass
class StageFinding:
    stage: Optional[str]
    pairs: list[tuple[int, int]] = field(default_factory=list)  # failing (request, split), worst first
    rows: Optional[SplitRows] = None
    tried: str = ""


def split_stage(ctx: ReplayContext, res, out_failed: bool, lse_failed: bool) -> StageFinding:
    """The stage a split kernel's fault is in (module docstring), from its BackendResult."""
    if res.attn_logits is None or res.attn_lse is None or not ctx.cap.is_decode:
        return StageFinding(None, tried="stages: the backend returns no split partials")
    splits = res.num_kv_splits if res.num_kv_splits is not None else ctx.cap.num_kv_splits
    if splits is None:
        return StageFinding(None, tried="stages: no num_kv_splits to place the partials")
    rows = split_rows(ctx, res, splits)
    if rows is None:
        return StageFinding(None, tried="stages: no split holds a token")
    pbad, lbad = rows.partial_bad, rows.lse_bad  # [V, H]
    for stage, bad in (("stage1", pbad), ("stage1_lse", lbad)):
        if bool(bad.any()):
            score = (rows.cmp.row_err / rows.cmp.row_tol) if stage == "stage1" else rows.lse_err  # [V, H]
            worst = torch.where(bad, score.nan_to_num(float("inf")), torch.zeros_like(score)).amax(1)  # [V]
            order = [int(v) for v in worst.argsort(descending=True) if bool(bad[v].any())]
            pairs = [(int(rows.b_idx[v]), int(rows.s_idx[v])) for v in order]
            return StageFinding(stage, pairs, rows, tried="stages: stage-1 partials and lse against the split reference")
    tried = "stages: stage-1 partials and lse right"
    S = res.attn_logits.shape[2]
    _, _, valid = ctx.split_reference(splits, S, arith=res.arithmetic)
    merged, merged_lse = ref.merge_splits(res.attn_logits.double().cpu() * ctx.cap.meta.v_scale,
                                          res.attn_lse.double().cpu(), valid)  # fmt: skip
    if out_failed:
        own = ctx.compare("merge_of_own_partials", merged.to(judged_dtype(res.out.dtype)))
        if own.passed:
            return StageFinding("stage2", rows=rows, tried=tried + "; merging them gives the reference output")
        return StageFinding(None, rows=rows, tried=tried + "; merging them does not give the reference either")
    if lse_failed and res.lse is not None:
        return StageFinding("lse", rows=rows, tried=tried + "; the output is right, the final lse is not")
    return StageFinding(None, rows=rows, tried=tried)

"""split_missing {"split": s}: split s's partial left out of the merge (decode only).

Per request: the splits of the kernel's schedule (the capture's num_kv_splits, else SGLang's
default) are ranked by the block-sum score of dropping their positions; the best are recomputed
as the merge itself, every split's partial but one, the way Triton's stage 2 merges them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional

import torch

from refmla import reference as ref
from refmla.control import declared_inputs, mla_decode_split_control
from refmla.hypotheses.drivers import per_request
from refmla.hypotheses.ranges import block_sums, score_pairs, split_count, split_schedule
from refmla.hypotheses.search import SCREEN, Candidate, Search
from refmla.results import Explanation

NAME = "split_missing"


def search(s: Search) -> Optional[Explanation]:
    if not s.cap.is_decode:
        return None
    return per_request(s, NAME, find_split, limit=None)  # every split that screens: cheap merges


def find_split(s: Search, b: int) -> Iterator[Candidate]:
    splits = split_schedule(s, b)
    if not splits or len(splits) < 2:
        return
    bs = block_sums(s, b, s.sc)
    pos = {p: i for i, p in enumerate(bs.bnd.tolist())}
    starts = torch.tensor([pos[a] for a, _ in splits])
    ends = torch.tensor([pos[e] for _, e in splits])
    scores = score_pairs(bs, starts, ends, zeroed=False)
    n = split_count(s, b)
    source = "capture" if s.cap.num_kv_splits is not None else "SGLang Triton default (computed)"
    partials = None
    for k in torch.argsort(scores).tolist():  # k: split index (non-empty splits come first)
        if float(scores[k]) >= SCREEN:
            break
        if partials is None:
            partials = SplitPartials.of(s, b, n)
        exp, ctl = partials.merged_without(k, s.dtype)
        a, e = splits[k]
        yield Candidate({"split": k}, exp, ctl, float(scores[k]),
                        extra={"positions": [a, e], "num_kv_splits": n, "schedule": source})  # fmt: skip


@dataclass
class SplitPartials:
    """Request b's stage-1 partials under n splits: reference (fp64) and control."""

    parts: torch.Tensor  # [1, H, S, Dv] fp64
    lses: torch.Tensor  # [1, H, S]
    valid: torch.Tensor  # [1, S] splits that hold tokens
    cparts: torch.Tensor  # the control's, in its accumulation dtype
    clses: torch.Tensor

    @classmethod
    def of(cls, s: Search, b: int, n: int) -> "SplitPartials":
        cap, r = s.cap, s.req(b)
        splits = torch.tensor([n], dtype=torch.int32)
        args = (cap.q[b : b + 1], cap.kv_buffer, s.att.select([b]), splits, s.sc)
        block = cap.split_block  # the capture's schedule (vLLM's uniform: 1), as split_schedule placed them
        parts, lses, valid = ref.mla_decode_split_ref(*args, split_block=block)
        q, sc, rnd = declared_inputs(cap, s.ctx.producer, s.sc, cap.q[b : b + 1])  # the producer's rounding
        cparts, clses, _ = mla_decode_split_control(q, *args[1:4], sc, split_block=block, rounding=rnd)
        return cls(parts, lses, valid, cparts, clses)

    def merged_without(self, k: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Reference [1, H, Dv] fp64 and control (``dtype``) of the merge of every split but k."""
        valid = self.valid.clone()
        valid[0, k] = False
        exp = ref.merge_splits(self.parts, self.lses, valid)[0]
        ctl = ref.merge_splits(self.cparts.double(), self.clses.double(), valid)[0].to(dtype)
        return exp, ctl

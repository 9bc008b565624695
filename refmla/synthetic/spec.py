"""What a synthetic capture looks like: real Kimi-K2 / DeepSeek-V3 shapes and scales, as small dataclasses."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from refmla.scales import Scales


def yarn_sm_scale(qk_head_dim: int, factor: float, mscale_all_dim: float = 1.0) -> float:
    """DeepSeek-V3 / Kimi-K2 softmax scale: qk_head_dim**-0.5 * mscale**2 (yarn rope scaling)."""
    mscale = 0.1 * mscale_all_dim * math.log(factor) + 1.0 if factor > 1 else 1.0
    return qk_head_dim**-0.5 * mscale * mscale


# qk_head_dim = qk_nope_head_dim (128) + qk_rope_head_dim (64) for both models
KIMI_K2_SCALE = yarn_sm_scale(192, 32.0)  # rope_scaling factor 32
DEEPSEEK_V3_SCALE = yarn_sm_scale(192, 40.0)  # rope_scaling factor 40


@dataclass
class SynthSpec:
    name: str = "kimi-k2-tp8"
    num_heads: int = 8  # query heads on this rank (Kimi-K2: 64 / TP8)
    seq_lens: tuple = (611, 257, 1024, 33)  # tokens attended per request
    page_size: int = 1
    kv_lora_rank: int = 512
    qk_rope_head_dim: int = 64
    dtype: torch.dtype = torch.bfloat16  # q and out
    kv_dtype: Optional[torch.dtype] = None  # None: same as dtype
    sm_scale: float = KIMI_K2_SCALE
    logit_cap: float = 0.0
    k_scale: float = 1.0
    v_scale: float = 1.0
    num_kv_splits: Optional[tuple] = None  # per request; None: min(max_kv_splits, max(1, L // 128))
    max_kv_splits: int = 16
    new_tokens: int = 0  # > 0: an extend capture with this many new tokens per request
    draft_token_num: int = 0  # > 0: a verify capture, this many query tokens per request (the last positions)
    topk: int = 1  # verify: EAGLE topk; > 1 writes a tree custom_mask (a random tree per request)
    free_pages: int = 3  # unused, poisoned pages in the pool
    fault_request: int = 2  # the request a per-request fault hits
    seed: int = 0
    pool_tokens: int = 1 << 20  # the production pool's max_total_num_tokens (geometry meta; a page multiple)
    pool_layers: int = 61  # layers of the production pool (Kimi-K2 / DeepSeek-V3: 61)
    extra_meta: dict = field(default_factory=dict)

    def __post_init__(self):
        self.kv_dtype = self.kv_dtype or self.dtype
        if self.num_kv_splits is None:
            self.num_kv_splits = tuple(min(self.max_kv_splits, max(1, L // 128)) for L in self.seq_lens)

    @property
    def head_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    def scales(self) -> Scales:
        return Scales(self.kv_lora_rank, self.sm_scale, self.logit_cap, self.k_scale, self.v_scale)


PRESETS: dict[str, SynthSpec] = {
    "kimi-k2-tp8": SynthSpec(),
    "kimi-k2-tp8-page256": SynthSpec(name="kimi-k2-tp8-page256", page_size=256, seq_lens=(611, 257, 1300, 33)),
    "deepseek-v3-tp8": SynthSpec(name="deepseek-v3-tp8", num_heads=16, sm_scale=DEEPSEEK_V3_SCALE, page_size=64,
                                 seq_lens=(700, 129, 1024, 1)),
    "hostile": SynthSpec(name="hostile", num_heads=4, seq_lens=(37, 1, 0, 300, 64), page_size=16,
                         fault_request=3, seed=7),
    "kimi-k2-tp8-extend": SynthSpec(name="kimi-k2-tp8-extend", seq_lens=(300, 129, 40), new_tokens=3,
                                    fault_request=0),
    # speculative verify (MTP, EAGLE topk 1: a chain). SGLang's target_verify gives every request
    # draft_token_num = speculative_num_steps + 1 query tokens: 1, 2 and 3 draft steps are qlen 2, 3, 4.
    # The main preset is qlen 3 (not a power of two: aiter issue #2720's class); seq_lens include the drafts.
    "kimi-k2-tp8-mtp": SynthSpec(name="kimi-k2-tp8-mtp", seq_lens=(611, 258, 1027, 35), draft_token_num=3,
                                 fault_request=2, extra_meta={"backend": "aiter"}),
    "kimi-k2-tp8-mtp1": SynthSpec(name="kimi-k2-tp8-mtp1", seq_lens=(300, 34, 129), draft_token_num=2,
                                  fault_request=0, extra_meta={"backend": "aiter"}),
    "kimi-k2-tp8-mtp3": SynthSpec(name="kimi-k2-tp8-mtp3", seq_lens=(300, 36, 129), draft_token_num=4,
                                  fault_request=0, extra_meta={"backend": "aiter"}),
    # EAGLE with topk 2: draft_token_num 4 tokens per request form a tree, a custom_mask per request
    "kimi-k2-tp8-eagle-tree": SynthSpec(name="kimi-k2-tp8-eagle-tree", seq_lens=(300, 133, 516), draft_token_num=4,
                                        topk=2, fault_request=0, page_size=16, seed=3),
}  # fmt: skip



def preset(name: str, **overrides: Any) -> SynthSpec:
    if name not in PRESETS:
        raise KeyError(f"unknown preset {name!r}; choose from {', '.join(PRESETS)}")
    return dataclasses.replace(PRESETS[name], **overrides)

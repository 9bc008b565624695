"""The golden cases: one small dataclass per case, the quick suite (in golden/) and the full one.

A case says its ``mode``; :mod:`refmla.golden.build` picks the builder of that mode: ``decode``
(one query token per request) or ``verify`` (speculative verify: ``draft_token_num`` query tokens
per request, the last positions of ``seq_lens``; a tree mask when ``topk`` > 1).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Optional, Union

from refmla.golden.determinism import hashed_lengths
from refmla.synthetic import DEEPSEEK_V3_SCALE, KIMI_K2_SCALE

MODES = ("decode", "verify")  # what a case can be; refmla.golden.build has one builder per mode
NO_MSCALE_SCALE = 192**-0.5  # qk_head_dim**-0.5, a model without yarn rope scaling
INT32_POOL_ROWS = 2**31 // 576  # pool rows past which a 32-bit element offset (row * 576) overflows

# Fields added after the committed goldens, with their defaults. ``params()`` leaves a field out
# while it holds this default, so that the files of every older case keep their bytes.
ADDED_FIELDS: dict[str, Any] = {"mode": "decode", "draft_token_num": 0, "topk": 1}


@dataclass
class GoldenCase:
    name: str  # file stem and pytest id
    why: str  # the failure class this case is for
    seq_lens: tuple[int, ...]  # tokens attended per request; 0 = a zero-length request
    mode: str = "decode"  # one of MODES: which builder makes its tensors
    num_heads: int = 8  # query heads on this rank: Kimi-K2 64 / TP, DeepSeek-V3 128 / TP
    page_size: int = 1  # pool page size; indices stay token level (SGLang's kv_indices)
    num_kv_splits: Union[int, tuple[int, ...]] = 4  # per request (tuple) or one count for all
    max_kv_splits: Optional[int] = None  # production attn_logits width; None: max(num_kv_splits)
    dtype: str = "bfloat16"  # q and the kernel's output
    kv_dtype: Optional[str] = None  # the pool; None: dtype. fp8: float8_e4m3fn / float8_e4m3fnuz
    sm_scale: float = KIMI_K2_SCALE  # as passed to the kernel, yarn mscale included
    logit_cap: float = 0.0  # tanh soft cap, 0 = off
    k_scale: float = 1.0  # fp8 dequant scales
    v_scale: float = 1.0
    q_scale_exp: int = -1  # q values ~ 1.15 * 2**q_scale_exp: larger makes the softmax peakier
    free_pages: int = 2  # pages no request uses, all NaN, shuffled in among the used ones
    pool_base_row: int = 0  # > 0: check() moves the pool to rows base.. of a NaN pool (int32 overflow)
    seed: int = 0
    draft_token_num: int = 0  # verify: query tokens per request (the last positions of each seq_len)
    topk: int = 1  # verify: > 1 a complete topk-ary draft tree as SGLang's custom_mask

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"{self.name}: mode {self.mode!r}; choose from {', '.join(MODES)}")
        self.seq_lens = tuple(int(x) for x in self.seq_lens)
        if isinstance(self.num_kv_splits, int):
            self.num_kv_splits = (self.num_kv_splits,) * len(self.seq_lens)
        self.num_kv_splits = tuple(int(x) for x in self.num_kv_splits)
        self.kv_dtype = self.kv_dtype or self.dtype
        self.max_kv_splits = self.max_kv_splits or max(self.num_kv_splits)
        if len(self.num_kv_splits) != len(self.seq_lens):
            raise ValueError(f"{self.name}: {len(self.num_kv_splits)} num_kv_splits for {len(self.seq_lens)} requests")
        if max(self.num_kv_splits) > self.max_kv_splits or min(self.num_kv_splits) < 1:
            raise ValueError(f"{self.name}: num_kv_splits must lie in 1..max_kv_splits={self.max_kv_splits}")
        if (self.mode == "verify") != (self.draft_token_num > 0) or min(self.seq_lens) < self.draft_token_num:
            raise ValueError(f"{self.name}: a verify case needs 1 <= draft_token_num <= every seq_len, decode none")

    @property
    def splits(self) -> tuple[int, ...]:
        """num_kv_splits per request (``__post_init__`` made it a tuple)."""
        assert isinstance(self.num_kv_splits, tuple)
        return self.num_kv_splits

    @property
    def pool_rows(self) -> int:
        return (sum(-(-L // self.page_size) for L in self.seq_lens) + self.free_pages) * self.page_size

    def params(self) -> dict[str, Any]:
        """The case's parameters as recorded in the manifest and meta["golden"] (see ADDED_FIELDS)."""
        return {
            k: (list(v) if isinstance(v, tuple) else v)
            for k, v in asdict(self).items()
            if k not in ("name", "why") and not (k in ADDED_FIELDS and v == ADDED_FIELDS[k])
        }


_C = GoldenCase
QUICK: dict[str, GoldenCase] = {c.name: c for c in [
    _C("kimi-h8-len1-31-32-33", "lengths around the 32-token block; 4 splits for 1-2 blocks (counts > L/32)",
       seq_lens=(1, 31, 32, 33), num_heads=8, num_kv_splits=4, seed=1),
    _C("kimi-h8-len255-256-257-page16", "lengths around 256 on 16-token pages, shuffled, NaN tails",
       seq_lens=(255, 256, 257), num_heads=8, page_size=16, num_kv_splits=4, seed=2),
    _C("dsv3-h16-varlen-zero-page64", "varlen batch, a zero-length request, per-request splits up to 16 (> L/32)",
       seq_lens=(130, 0, 64, 1, 97, 33), num_heads=16, page_size=64, num_kv_splits=(16, 16, 4, 1, 8, 2),
       sm_scale=DEEPSEEK_V3_SCALE, seed=3),
    _C("kimi-h8-len1300-splits41of256", "MI355X Kimi-K2 TP8 schedule: 41 splits in a 256-wide buffer",
       seq_lens=(1300,), num_heads=8, num_kv_splits=41, max_kv_splits=256, seed=4),
    _C("dsv3-h128-len97-page256", "128 heads (DeepSeek-V3 TP1, 8 head tiles); 256-token page, 159-row NaN tail",
       seq_lens=(97,), num_heads=128, page_size=256, num_kv_splits=2, free_pages=1,
       sm_scale=DEEPSEEK_V3_SCALE, seed=5),
    _C("h64-logit-cap30", "a binding tanh soft cap (30) on 64 heads",
       seq_lens=(200, 33), num_heads=64, page_size=16, num_kv_splits=2, logit_cap=30.0, q_scale_exp=3, seed=6),
    _C("h32-fp16-no-mscale", "fp16 q/KV/out; sm_scale without yarn mscale (1/sqrt(192))",
       seq_lens=(129, 31), num_heads=32, num_kv_splits=4, dtype="float16", sm_scale=NO_MSCALE_SCALE, seed=7),
    _C("kimi-h16-fp8-e4m3fn", "fp8 e4m3fn KV with k_scale / v_scale, 64-token pages",
       seq_lens=(300, 45), num_heads=16, page_size=64, num_kv_splits=4, kv_dtype="float8_e4m3fn",
       k_scale=0.8125, v_scale=1.375, seed=8),
    _C("kimi-h16-fp8-e4m3fnuz", "fp8 e4m3fnuz KV (MI300-class) with k_scale / v_scale, 16-token pages",
       seq_lens=(100, 257), num_heads=16, page_size=16, num_kv_splits=4, kv_dtype="float8_e4m3fnuz",
       k_scale=0.8125, v_scale=1.375, seed=9),
    _C("kimi-h8-batch64-varlen", "batch 64 of 0..24 tokens, zero-length requests inside the batch",
       seq_lens=hashed_lengths(10, 64, 24, zeros=(0, 17, 63)), num_heads=8, num_kv_splits=1, free_pages=16, seed=10),
    # speculative verify (MTP / EAGLE): qlen 2, 3 (not a power of two) and 4 (a topk-2 tree)
    _C("kimi-h8-verify-q2-page16", "MTP verify, 2 query tokens per request (1 draft step), 16-token pages",
       seq_lens=(34, 257, 2), mode="verify", draft_token_num=2, num_heads=8, page_size=16, seed=11),
    _C("kimi-h8-verify-q3", "MTP verify, 3 query tokens (qlen not a power of two: aiter #2720's class)",
       seq_lens=(300, 33, 5), mode="verify", draft_token_num=3, num_heads=8, seed=12),
    _C("dsv3-h16-verify-q4-tree", "EAGLE topk 2: 4 draft tokens as a tree, SGLang's custom_mask",
       seq_lens=(130, 64, 100), mode="verify", draft_token_num=4, topk=2, num_heads=16, page_size=64,
       sm_scale=DEEPSEEK_V3_SCALE, seed=13),
]}  # fmt: skip

FULL_ONLY: dict[str, GoldenCase] = {c.name: c for c in [
    _C("dsv3-h16-len4097-page64-splits16", "4097 tokens (one past 2**12) in 16 splits on 64-token pages",
       seq_lens=(4097,), num_heads=16, page_size=64, num_kv_splits=16, sm_scale=DEEPSEEK_V3_SCALE, seed=101),
    _C("kimi-h8-len16384-splits41of256", "16384 tokens, Kimi-K2 TP8 on MI355X: 41 of 256 splits",
       seq_lens=(16384,), num_heads=8, num_kv_splits=41, max_kv_splits=256, page_size=256, free_pages=1, seed=102),
    _C("dsv3-h128-len4097-splits8", "128 heads at 4097 tokens (DeepSeek-V3 TP1)",
       seq_lens=(4097, 1), num_heads=128, num_kv_splits=8, sm_scale=DEEPSEEK_V3_SCALE, seed=103),
    _C("kimi-h64-fp8-e4m3fn-len4097", "fp8 e4m3fn at 4097 tokens, 64 heads",
       seq_lens=(4097, 255), num_heads=64, page_size=16, num_kv_splits=16, kv_dtype="float8_e4m3fn",
       k_scale=0.8125, v_scale=1.375, seed=104),
    _C("kimi-h8-batch64-varlen-long", "batch 64 of 0..1300 tokens, 16 splits",
       seq_lens=hashed_lengths(105, 64, 1300, zeros=(5, 40)), num_heads=8, page_size=16, num_kv_splits=16,
       seed=105),
    _C("h32-fp16-len16384-cap30", "fp16 with a binding soft cap at 16384 tokens",
       seq_lens=(16384,), num_heads=32, num_kv_splits=16, dtype="float16", logit_cap=30.0, q_scale_exp=3,
       page_size=64, seed=106),
    _C("dsv3-h16-pool-rows-over-int32", "pool rows past 2**31 / 576: 32-bit element offsets overflow",
       seq_lens=(257, 33), num_heads=16, num_kv_splits=4, sm_scale=DEEPSEEK_V3_SCALE,
       pool_base_row=INT32_POOL_ROWS + 4096, seed=107),
]}  # fmt: skip

SUITES: dict[str, dict[str, GoldenCase]] = {"quick": QUICK, "full": {**QUICK, **FULL_ONLY}}

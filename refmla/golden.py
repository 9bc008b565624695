"""Golden files: inputs and the fp64 reference frozen per case, for regression-testing MLA kernels.

    case (GoldenCase) --build_inputs--> q, hostile paged pool, SGLang metadata
                      --reference----->  out, lse (fp64 -> fp32), per-split partials of its schedule
                      --write_capture->  <case>.safetensors (refmla.capture/1) + manifest.json
    golden file + backend name --check--> GoldenResult (replay's comparator and split check)

Determinism. A suite is the same bytes on every run and machine for one ``GENERATOR`` version:

* no RNG stream and no libm makes an input: every value is a splitmix64 hash of (seed, tensor,
  counter) in integer arithmetic, made approximately normal as a centred sum of four 16-bit
  uniforms, and rounded *in integers* to the precision of its dtype, so that the final cast is exact;
* the values sit on a grid of ``2**(scale - 15)`` with at most 18 bits, so every ``q . k`` dot is
  exact in fp64 whatever the summation order: the reference's logits do not depend on the BLAS;
* the safetensors header is rewritten with its metadata keys sorted (safetensors writes them in
  hash-map order, which changes from run to run).

What is left to floating point is the reference's own fp64 softmax and ``P . V``, rounded once to fp32.

What a golden file holds (a capture whose ``out`` is the *reference*, not a production output):

    q, kv_buffer, kv_indptr, kv_indices, seq_lens, num_kv_splits   the inputs, unused pool rows NaN
    out   [B, H, Dv] fp32   fp64 reference (refmla.reference.mla_decode_ref), v_scale included
    lse   [B, H]     fp32   its natural-log LSE (-inf for a zero-length request)
    attn_logits [B, H, S, Dv], attn_lse [B, H, S] fp32   the reference per split of the Triton
          schedule for num_kv_splits, S = the most non-empty splits of any request, *without*
          v_scale (as SGLang's stage 1 stores them); empty splits 0 / -inf
    meta["golden"]   generator version, case parameters, tolerance inputs, what each tensor is

Tolerance inputs. The tolerance is CONTRACT section 5: k times the low-precision control's error
per (request, head) row plus ulps of the output dtype. The file records k, ulps, cos, the output
dtype a kernel writes and the control that is meant (``refmla.control.mla_control``); the control
itself is recomputed from the stored inputs at check time, as ``refmla replay`` does, because it
rounds to bf16 at several points and so is not bit-reproducible across BLAS builds (storing it
would break the determinism above). It costs milliseconds.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np
import torch

from refmla import reference as ref
from refmla.capture import read_capture, write_capture
from refmla.compare import Tolerance, compare, ulp
from refmla.schedule import split_bounds
from refmla.context import ReplayContext, ReplayOptions
from refmla.replay import run_backend
from refmla.synth import DEEPSEEK_V3_SCALE, KIMI_K2_SCALE

GENERATOR = "refmla.golden/2"  # bump when an unchanged case would come out as different bytes
MANIFEST = "manifest.json"
NO_MSCALE_SCALE = 192**-0.5  # qk_head_dim**-0.5, a model without yarn rope scaling
INT32_POOL_ROWS = 2**31 // 576  # pool rows past which a 32-bit element offset (row * 576) overflows

DTYPES = {
    "bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
    "float8_e4m3fn": torch.float8_e4m3fn, "float8_e4m3fnuz": torch.float8_e4m3fnuz,
}  # fmt: skip
# dtype -> the quiet NaN's bits: poison is written as bits, since how a cast spells NaN varies
NAN_BITS = {
    torch.bfloat16: (0x7FC0, torch.int16), torch.float16: (0x7E00, torch.int16),
    torch.float32: (0x7FC00000, torch.int32), torch.float8_e4m3fn: (0x7F, torch.uint8),
    torch.float8_e4m3fnuz: (0x80, torch.uint8),
}  # fmt: skip
# dtype -> (significant bits, log2 of the smallest subnormal): what the integer rounding targets
PRECISION = {
    torch.bfloat16: (8, -133), torch.float16: (11, -24), torch.float32: (24, -149),
    torch.float8_e4m3fn: (4, -9), torch.float8_e4m3fnuz: (4, -10),
}  # fmt: skip


# --------------------------------------------------------------------------------------------
# Deterministic numbers: integer arithmetic only
# --------------------------------------------------------------------------------------------

_U64 = np.uint64


def splitmix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finalizer on uint64 (wrapping arithmetic, the same on every machine)."""
    z = x + _U64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> _U64(27))) * _U64(0x94D049BB133111EB)
    return z ^ (z >> _U64(31))


def counter_hash(seed: int, stream: str, n: int) -> np.ndarray:
    """n uint64 hashes of (seed, stream name, counter 0..n-1)."""
    key = np.array([seed & (2**64 - 1)], dtype=_U64)
    for byte in stream.encode():
        key = splitmix64(key ^ _U64(byte))
    return splitmix64(splitmix64(np.arange(n, dtype=_U64) + key[0]))


def grid_normal(seed: int, stream: str, shape: Sequence[int], dtype: torch.dtype, scale_exp: int = 0) -> torch.Tensor:
    """Approximately N(0, 1.15**2 * 4**scale_exp) values, exactly representable in ``dtype``.

    z = (sum of the four 16-bit fields of a hash) - 131070, an integer with |z| < 2**17; it is
    rounded to the dtype's significant bits (nearest even, in integers, never finer than its
    smallest subnormal) and scaled by 2**(scale_exp - 15). Every step is exact.
    """
    n = math.prod(shape)
    h = counter_hash(seed, stream, n)
    mask = _U64(0xFFFF)
    u = sum(((h >> _U64(16 * i)) & mask).astype(np.int64) for i in range(4))
    z = u - 2 * 0xFFFF  # [n] int64, symmetric around 0
    bits, min_sub = PRECISION[dtype]
    exp = scale_exp - 15  # value = z * 2**exp
    a = np.abs(z)
    length = sum((a >= (1 << k)).astype(np.int64) for k in range(18))  # bit length of |z|
    shift = np.maximum(np.maximum(length - bits, min_sub - exp), 0)  # bits to drop
    q = a >> shift
    rem = a - (q << shift)
    half = np.where(shift > 0, np.left_shift(1, np.maximum(shift - 1, 0)), 0)
    up = (shift > 0) & ((rem > half) | ((rem == half) & ((q & 1) == 1)))
    r = np.sign(z) * ((q + up) << shift)  # int64, at most `bits` significant bits
    vals = np.ldexp(r.astype(np.float64), exp)  # exact: |r| < 2**18, scaling by a power of two
    return torch.from_numpy(vals.reshape(shape)).to(dtype)


def nan_filled(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """A tensor of ``dtype``'s canonical quiet NaN, written as bits."""
    bits, as_int = NAN_BITS[dtype]
    return torch.full(tuple(shape), bits, dtype=as_int).view(dtype)


def shuffled(seed: int, stream: str, n: int) -> torch.Tensor:
    """A permutation of 0..n-1: the counter order of n hashes, sorted (stable)."""
    return torch.from_numpy(np.argsort(counter_hash(seed, stream, n), kind="stable").astype(np.int64))


# --------------------------------------------------------------------------------------------
# Cases
# --------------------------------------------------------------------------------------------


@dataclass
class GoldenCase:
    name: str  # file stem and pytest id
    why: str  # the failure class this case is for
    seq_lens: tuple  # tokens attended per request; 0 = a zero-length request
    num_heads: int = 8  # query heads on this rank: Kimi-K2 64 / TP, DeepSeek-V3 128 / TP
    page_size: int = 1  # pool page size; indices stay token level (SGLang's kv_indices)
    num_kv_splits: Any = 4  # per request (tuple) or one count for all
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

    def __post_init__(self):
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

    @property
    def pool_rows(self) -> int:
        return (sum(-(-L // self.page_size) for L in self.seq_lens) + self.free_pages) * self.page_size

    def params(self) -> dict:
        return {
            k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(self).items() if k not in ("name", "why")
        }


def _varlen(seed: int, n: int, high: int, zeros: Sequence[int] = ()) -> tuple:
    """n lengths in [1, high] from the counter hash, with 0 at the given requests."""
    h = counter_hash(seed, "seq_lens", n)
    lens = [1 + int(x % _U64(high)) for x in h]
    for b in zeros:
        lens[b] = 0
    return tuple(lens)


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
       seq_lens=_varlen(10, 64, 24, zeros=(0, 17, 63)), num_heads=8, num_kv_splits=1, free_pages=16, seed=10),
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
       seq_lens=_varlen(105, 64, 1300, zeros=(5, 40)), num_heads=8, page_size=16, num_kv_splits=16, seed=105),
    _C("h32-fp16-len16384-cap30", "fp16 with a binding soft cap at 16384 tokens",
       seq_lens=(16384,), num_heads=32, num_kv_splits=16, dtype="float16", logit_cap=30.0, q_scale_exp=3,
       page_size=64, seed=106),
    _C("dsv3-h16-pool-rows-over-int32", "pool rows past 2**31 / 576: 32-bit element offsets overflow",
       seq_lens=(257, 33), num_heads=16, num_kv_splits=4, sm_scale=DEEPSEEK_V3_SCALE,
       pool_base_row=INT32_POOL_ROWS + 4096, seed=107),
]}  # fmt: skip

SUITES: dict[str, dict[str, GoldenCase]] = {"quick": QUICK, "full": {**QUICK, **FULL_ONLY}}


# --------------------------------------------------------------------------------------------
# Building one case
# --------------------------------------------------------------------------------------------


def build_inputs(case: GoldenCase, kv_lora_rank: int = 512, qk_rope_head_dim: int = 64) -> dict[str, torch.Tensor]:
    """q, the shuffled NaN-poisoned paged pool and SGLang's metadata for ``case``."""
    D, P = kv_lora_rank + qk_rope_head_dim, case.page_size
    B, H = len(case.seq_lens), case.num_heads
    dtype, kv_dtype = DTYPES[case.dtype], DTYPES[case.kv_dtype]
    lens = torch.tensor(case.seq_lens, dtype=torch.int64)  # [B]
    pages_per = (lens + P - 1) // P  # [B]
    n_pages = int(pages_per.sum()) + case.free_pages
    perm = shuffled(case.seed, "pages", n_pages)  # page ids in the order they are handed out
    nnz = int(lens.sum())
    values = grid_normal(case.seed, "kv", (nnz, D), kv_dtype)  # [nnz, D] position-order rows
    pool = nan_filled((n_pages * P, 1, D), kv_dtype)  # [N, 1, D] unattended rows NaN
    slots, used = [], 0
    for L, npg in zip(lens.tolist(), pages_per.tolist()):
        pages = perm[used : used + npg]
        used += npg
        slots.append((pages[:, None] * P + torch.arange(P)[None, :]).reshape(-1)[:L])  # [L]
    kv_indices = torch.cat(slots) if slots else torch.zeros(0, dtype=torch.int64)  # [nnz]
    pool[kv_indices, 0] = values
    kv_indptr = torch.zeros(B + 1, dtype=torch.int32)
    kv_indptr[1:] = torch.cumsum(lens, 0)
    return {
        "q": grid_normal(case.seed, "q", (B, H, D), dtype, case.q_scale_exp),  # [B, H, D]
        "kv_buffer": pool,
        "kv_indptr": kv_indptr,  # [B + 1] int32, as SGLang's Triton backend
        "kv_indices": kv_indices,  # [nnz] int64, as SGLang's Triton backend
        "seq_lens": lens.to(torch.int32),  # [B]
        "num_kv_splits": torch.tensor(case.num_kv_splits, dtype=torch.int32),  # [B]
    }


def split_width(case: GoldenCase) -> int:
    """The most non-empty splits of any request under the Triton schedule (at least 1)."""
    return max([1] + [sum(e > s for s, e in split_bounds(L, n)) for L, n in zip(case.seq_lens, case.num_kv_splits)])


def reference_tensors(t: dict[str, torch.Tensor], case: GoldenCase, kv_lora_rank: int = 512) -> dict[str, torch.Tensor]:
    """out, lse and the per-split partials of ``case``'s schedule: fp64 reference, stored fp32."""
    args = (t["q"], t["kv_buffer"], t["kv_indptr"], t["kv_indices"])
    sc = dict(kv_lora_rank=kv_lora_rank, sm_scale=case.sm_scale, logit_cap=case.logit_cap, k_scale=case.k_scale)
    out, lse = ref.mla_decode_ref(*args, **sc, v_scale=case.v_scale)  # [B, H, Dv], [B, H] fp64
    parts, lses, _ = ref.mla_decode_split_ref(
        *args, t["num_kv_splits"], **sc, v_scale=1.0, max_kv_splits=split_width(case)
    )  # [B, H, S, Dv], [B, H, S]: as the kernel stores them, before v_scale
    f32 = torch.float32
    return {"out": out.to(f32), "lse": lse.to(f32), "attn_logits": parts.to(f32), "attn_lse": lses.to(f32)}


def case_meta(case: GoldenCase, tol: Tolerance = Tolerance()) -> dict[str, Any]:
    """The capture meta of a golden file (CONTRACT section 1) plus meta["golden"]."""
    return {
        "mode": "decode", "backend": "unknown", "kv_lora_rank": 512, "qk_rope_head_dim": 64,
        "sm_scale": case.sm_scale, "logit_cap": case.logit_cap, "page_size": case.page_size,
        "k_scale": case.k_scale, "v_scale": case.v_scale, "max_kv_splits": case.max_kv_splits,
        "golden": {
            "generator": GENERATOR,
            "case": case.name,
            "why": case.why,
            "params": case.params(),
            "out": "fp64 reference (refmla.reference.mla_decode_ref) rounded to fp32; not a production output",
            "attn_logits": "fp64 reference per split of the Triton schedule for num_kv_splits, fp32, without "
                           "v_scale (as SGLang's stage 1 stores them); empty splits 0 and lse -inf",
            "out_dtype": case.dtype,
            "tolerance": {**tol.to_json(), "control": "refmla.control.mla_control, recomputed from the inputs",
                          "rule": "per (request, head): max abs err <= k * control's + ulps * ulp(out_dtype, "
                                  "row max); cosine difference < max(cos, k * control's), whole and per row"},
            **({"pool_base_row": case.pool_base_row} if case.pool_base_row else {}),
        },
    }  # fmt: skip


def write_case(case: GoldenCase, out_dir: Any) -> dict:
    """Write ``<out_dir>/<case.name>.safetensors``; returns its manifest entry."""
    t = build_inputs(case)
    t.update(reference_tensors(t, case))
    path = Path(out_dir) / f"{case.name}.safetensors"
    write_capture(path, t, case_meta(case), compact=False)  # compact=False keeps the NaN poison
    data = path.read_bytes()
    return {"name": case.name, "file": path.name, "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data),
            "why": case.why, "params": case.params()}  # fmt: skip


def generate(out_dir: Any, suite: str = "quick") -> dict:
    """Write every case of ``suite`` ("quick" or "full") to ``out_dir`` plus ``manifest.json``.

    The same bytes on every run (see the module docstring). Returns the manifest.
    """
    if suite not in SUITES:
        raise KeyError(f"unknown suite {suite!r}; choose from {', '.join(SUITES)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cases = [write_case(case, out) for case in SUITES[suite].values()]
    manifest = {"format": "refmla.golden.manifest/1", "generator": GENERATOR, "suite": suite,
                "capture_format": "refmla.capture/1", "cases": cases}  # fmt: skip
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def load_manifest(golden_dir: Any) -> dict:
    """The manifest of a golden directory; FileNotFoundError names what is missing."""
    path = Path(golden_dir) / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no golden manifest (refmla golden generate --out {golden_dir})")
    return json.loads(path.read_text())


# --------------------------------------------------------------------------------------------
# Checking a backend against a golden file
# --------------------------------------------------------------------------------------------

CHECK_BACKENDS = ("reference", "triton", "aiter", "extend")  # "observed" is the stored reference itself


class GoldenContext(ReplayContext):
    """A replay context whose reference is the golden file's, not a fresh computation.

    ``recomputed`` keeps this machine's fp64 reference for the reference self-check. The stored
    per-split reference serves the split check whenever a backend follows the stored schedule.
    """

    def __init__(self, cap, opts: ReplayOptions, stored: dict[str, torch.Tensor]):
        super().__init__(cap, opts)
        self.recomputed = (self.ref_out, self.ref_lse)
        self.stored = stored
        self.ref_out, self.ref_lse = stored["out"].double(), stored["lse"].double()

    def split_reference(self, num_kv_splits: torch.Tensor, S: int, control: bool = False):
        logits, lses = self.stored["attn_logits"], self.stored["attn_lse"]
        S0 = logits.shape[2]
        if control or S < S0 or not torch.equal(num_kv_splits.cpu().long(), self.cap.num_kv_splits.long()):
            return super().split_reference(num_kv_splits, S, control)
        B, H, _, Dv = logits.shape
        parts = torch.zeros(B, H, S, Dv, dtype=torch.float64)
        lse = torch.full((B, H, S), -math.inf, dtype=torch.float64)
        parts[:, :, :S0] = logits.double() * self.cap.meta.v_scale  # replay compares partials with v_scale
        lse[:, :, :S0] = lses.double()
        valid = torch.zeros(B, S, dtype=torch.bool)
        valid[:, :S0] = torch.isfinite(lses[:, 0, :]) if H else False
        return parts, lse, valid


@dataclass
class GoldenResult:
    case: str
    backend: str
    status: str  # pass | fail | skipped | error
    reason: Optional[str]
    why: str = ""  # the failure class the case is for
    entry: dict = field(default_factory=dict)  # replay's backend entry (CONTRACT section 3)
    replay: str = ""  # the command that replays this case through this backend
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return self.status == "pass"

    def message(self) -> str:
        """What a kernel engineer reads on failure: reasons, the worst element, the replay command."""
        e = self.entry
        lines = [
            f"golden {self.case} / {self.backend}: {self.status.upper()}" + (f"  [{self.why}]" if self.why else "")
        ]
        if self.reason:
            lines += [f"  {r}" for r in self.reason.split("; ")]
        w = e.get("worst") or {}
        got, want = ("stored", "recomputed") if self.backend == "reference" else (self.backend, "reference")
        if w.get("dim") is not None and w.get("request") is not None:
            lines.append(
                f"  worst element: request {w['request']} head {w['head']} dim {w['dim']}: "
                f"{got} {_g(w.get('actual'))} vs {want} {_g(w.get('expected'))} "
                f"(row err {_g(w.get('err'))}, allowed {_g(w.get('allowed'))}, {_g(w.get('ratio'))}x)"
            )
        sp = e.get("splits")
        if sp:
            lines.append(f"  splits: {sp.get('status')}" + (f" ({sp['reason']})" if sp.get("reason") else ""))
        ex = e.get("explanation")
        if ex:
            detail = ", ".join(f"{k}={v}" for k, v in (ex.get("detail") or {}).items())
            lines.append(f"  explained by {ex.get('hypothesis')}({detail}) request {ex.get('request')}")
        lines.append(f"  replay: {self.replay}")
        return "\n".join(lines)


def _g(x: Any) -> str:
    return "-" if x is None else f"{x:.6g}" if isinstance(x, float) else str(x)


def replay_command(path: Any, backend: str, pool_base_row: int = 0) -> str:
    """The command that reproduces a check; a pool_base_row case needs the harness, not replay."""
    p = Path(path)
    try:
        shown = shlex.quote(str(p.resolve().relative_to(Path.cwd())))
    except ValueError:
        shown = shlex.quote(str(p))
    if pool_base_row:
        return (f"python -m refmla.golden check {shown} --backend {backend}  (refmla replay runs the "
                f"compact pool; this puts it at row {pool_base_row})")  # fmt: skip
    return f"refmla replay {shown} --backend {backend}"


def golden_meta(path: Any) -> dict:
    """meta["golden"] of a golden file, from its header alone."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return json.loads((f.metadata() or {}).get("meta", "{}")).get("golden") or {}


def inputs_only(cap):
    """The capture a production kernel would have been given: the stored reference removed."""
    return dataclasses.replace(cap, out=None, lse=None, attn_logits=None, attn_lse=None, warnings=[])


def materialize_pool(cap, base_row: int):
    """The capture with its pool moved to rows [base_row, base_row + N) of a NaN pool (int64 indices)."""
    N, _, D = cap.kv_buffer.shape
    pool = nan_filled((base_row + N, 1, D), cap.kv_buffer.dtype)
    pool[base_row:] = cap.kv_buffer
    return dataclasses.replace(cap, kv_buffer=pool, kv_indices=cap.kv_indices.long() + base_row)


def check(path: Any, backend: str, *, tol: Tolerance = Tolerance(), device: Optional[str] = None) -> GoldenResult:
    """Run ``backend`` on a golden file's inputs and compare with its stored reference.

    ``reference`` is the self-check: this machine's fp64 reference, out / lse / split partials,
    must round to the stored fp32 values (one fp32 ulp at the row's magnitude). Other backends run
    through :func:`refmla.replay.run_backend` against the stored reference, with the control
    recomputed for the tolerance, so the verdict is the one ``refmla replay`` gives; a backend that
    returns split partials (triton) must match the stored per-split reference too. Never raises
    for a backend's failure: a crash is status ``error``, an unusable backend ``skipped``.
    """
    t0 = time.perf_counter()
    cap = read_capture(path)
    golden = cap.meta.extra.get("golden") or {}
    name, why, base = golden.get("case", Path(path).stem), golden.get("why", ""), int(golden.get("pool_base_row", 0))
    stored = {k: getattr(cap, k) for k in ("out", "lse", "attn_logits", "attn_lse")}
    if any(v is None for v in stored.values()):
        missing = ", ".join(k for k, v in stored.items() if v is None)
        return GoldenResult(name, backend, "error", f"{path}: not a golden file (no {missing})")
    # trim=False: the production buffer width (max_kv_splits); its strides are part of the test
    opts = ReplayOptions(backends=[backend], tol=tol, device=device, trim=False)
    inputs = inputs_only(cap)
    if base and backend != "reference":
        inputs = materialize_pool(inputs, base)
    ctx = GoldenContext(inputs, opts, stored)
    if backend == "reference":
        entry = self_check(ctx, tol)
    else:
        entry = run_backend(backend, ctx).to_json()
        if entry["status"] == "pass" and (entry.get("splits") or {}).get("status") == "fail":
            entry.update(status="fail", reason="the output passes but its stage-1 split partials do not (splits below)")
    return GoldenResult(name, backend, entry["status"], entry.get("reason"), why, entry,
                        replay_command(path, backend, base), time.perf_counter() - t0)  # fmt: skip


def self_check(ctx: GoldenContext, tol: Tolerance) -> dict:
    """This machine's fp64 reference against the stored one: out, lse and every split partial."""
    cap, s = ctx.cap, ctx.stored
    f32, one_ulp = torch.float32, dataclasses.replace(tol, k=0.0, ulps=1.0)
    cmp = compare("reference", s["out"], ctx.recomputed[0], out_dtype=f32, tol=one_ulp)
    S0 = s["attn_logits"].shape[2]
    parts, lses, valid = ref.mla_decode_split_ref(
        cap.q, cap.kv_buffer, cap.kv_indptr, cap.kv_indices, cap.num_kv_splits,
        **{**cap.scales(), "v_scale": 1.0}, max_kv_splits=S0,
    )  # fmt: skip
    B, H, _, Dv = parts.shape
    per_split = lambda x: x.transpose(1, 2).reshape(B * S0, H, Dv)  # noqa: E731 [B, H, S, Dv] -> [B * S, H, Dv]
    split_cmp = compare("splits", per_split(s["attn_logits"]), per_split(parts), out_dtype=f32, tol=one_ulp)
    reasons = list(cmp.reasons) + [f"split partials: {r}" for r in split_cmp.reasons]
    for what, got, want in (("lse", s["lse"], ctx.recomputed[1]), ("attn_lse", s["attn_lse"], lses)):
        finite = torch.isfinite(want)
        if not torch.equal(finite, torch.isfinite(got)) or not torch.equal(got[~finite].double(), want[~finite]):
            reasons.append(f"{what}: -inf / NaN placement differs from this machine's reference")
        err = (got.double() - want)[finite].abs()
        allowed = ulp(torch.float32, want[finite])
        if err.numel() and bool((err > allowed).any()):
            i = int((err / allowed).argmax())
            reasons.append(f"{what}: off by {err[i].item():.3g} > one fp32 ulp {allowed[i].item():.3g}")
    entry = {"status": "fail" if reasons else "pass", "reason": "; ".join(reasons) or None, **cmp.to_json()}
    entry["info"] = {"what": "fp64 reference recomputed here vs the stored one",
                     "split_max_abs_err": split_cmp.max_abs_err, "valid_splits": int(valid.sum())}  # fmt: skip
    return entry


def check_isolated(path: Any, backend: str, *, timeout: float = 1800) -> GoldenResult:
    """:func:`check` in a child process, so that a kernel that crashes the process is a result."""
    cmd = [sys.executable, "-m", "refmla.golden", "check", str(path), "--backend", backend]
    g = golden_meta(path)
    name, why, base = g.get("case", Path(path).stem), g.get("why", ""), int(g.get("pool_base_row", 0))
    died = functools.partial(GoldenResult, name, backend, "error", why=why, replay=replay_command(path, backend, base))
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return died(f"timed out after {timeout:.0f} s", seconds=time.perf_counter() - t0)
    if proc.returncode == 0 and proc.stdout.strip():
        return GoldenResult(**{**json.loads(proc.stdout), "seconds": time.perf_counter() - t0})
    if proc.returncode < 0:
        try:
            how = f"killed by {signal.Signals(-proc.returncode).name}"
        except ValueError:
            how = f"killed by signal {-proc.returncode}"
    else:
        how = f"exit status {proc.returncode}"
    tail = (proc.stderr.strip().splitlines() or [""])[-1]
    return died(f"the process running the kernel died ({how}) {tail}".strip(), seconds=time.perf_counter() - t0)


def needs_isolation(path: Any) -> tuple[bool, Optional[str]]:
    """(run in a child process, reason to skip instead): pool_base_row cases allocate a >4 GiB pool."""
    from safetensors import safe_open

    base = int(golden_meta(path).get("pool_base_row", 0))
    if not base:
        return False, None
    with safe_open(str(path), framework="pt") as f:
        pool = f.get_slice("kv_buffer")
        rows, _, D = pool.get_shape()
        itemsize = 1 if pool.get_dtype().startswith("F8") else 2
    need = (base + rows) * D * itemsize
    avail = _available_memory()
    if avail is not None and avail < 1.5 * need:
        return (
            True,
            f"needs about {need / 2**30:.1f} GiB for a {base + rows}-row pool; {avail / 2**30:.1f} GiB available",
        )
    return True, None


def _available_memory() -> Optional[int]:
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m refmla.golden check FILE --backend NAME``: one check, its result as JSON (check_isolated)."""
    import argparse

    from refmla.backends.triton_interp import ensure_interpreter

    ensure_interpreter()
    p = argparse.ArgumentParser(prog="python -m refmla.golden")
    p.add_argument("command", choices=["check"])
    p.add_argument("path")
    p.add_argument("--backend", required=True)
    a = p.parse_args(argv)
    r = check(a.path, a.backend)
    from refmla.util import json_safe

    print(json.dumps(json_safe(asdict(r)), default=str))
    return 0


if __name__ == "__main__":
    sys.exit(_main())

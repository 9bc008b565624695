"""Planted numerics: a correct kernel that rounds differently (docs/contract.md section 4, ``numerics``).

Each fault is SGLang Triton's arithmetic (the low-precision control, split schedule included) at
other rounding points, planted independently of the search that must name it: the stores round
the control's fp32 result themselves, the others run the control under a
:class:`refmla.control.Rounding` built here. A variant that moves the output outside the tolerance
must be diagnosed ``numerics`` with its variant named, never as a data or metadata fault
(``expect="numerics"``); one that stays within it on every preset (a store through fp16,
probabilities kept finer, P.V summed in fp16, the lse in fp16) is a correct kernel that must
pass (``expect=None``): refmla must not cry wolf over a rounding change that is not one.
``may_agree`` marks the variants that stay within tolerance on some presets (peaked attention
leaves few roundings that matter) and not on others.
"""

from __future__ import annotations

import torch

from refmla.control import Rounding, control_output, store_as
from refmla.synthetic.faults import MAY_AGREE, Planting, fault  # noqa: F401  (MAY_AGREE: re-exported)

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def _control(p: Planting, out_dtype: torch.dtype, rnd: Rounding = Rounding()) -> torch.Tensor:
    t = p.t
    return control_output(t["q"], t["kv_buffer"], p.att, p.scales, out_dtype, t.get("num_kv_splits"), rnd)[0]


def _stored(p: Planting, how: str):
    return store_as(_control(p, FP32), p.spec.dtype, how), {"variant": f"out_{STORE_NAMES[how]}"}


STORE_NAMES = {"toward_zero": "round_toward_zero", "half_away": "round_half_away", "via_fp16": "through_fp16"}


OUTLIER_DIM, OUTLIER = 7, 8.0  # a latent channel far above the others, as real KV caches have


def outlier_channel(p: Planting) -> None:
    """Give every attended pool row a latent channel in [8, 8.5) (the inputs are changed in place:
    they are what the capture stores). Just above a power of two, one bf16 ulp is 2^-7 of the
    value, and the channel dominates its output rows: truncating it is what the comparator's
    cosine sees (the issue's Triton kernel failed on one such row); on N(0, 1) rows alone a
    truncating store stays within tolerance."""
    kv = p.t["kv_buffer"]
    live = torch.isfinite(kv[:, 0].float()).all(-1)  # synth pools are NaN where nothing attends
    g = torch.Generator().manual_seed(p.spec.seed + 11)
    vals = OUTLIER + 0.5 * torch.rand(int(live.sum()), generator=g)
    if kv.dtype.itemsize == 1:
        vals = vals / p.spec.k_scale
    kv[live, 0, OUTLIER_DIM] = vals.to(kv.dtype)


@fault("out_round_toward_zero", "a correct kernel whose output store rounds toward zero (truncates), on a pool "
       "with an outlier latent channel", expect="numerics")  # fmt: skip
def _out_rtz(p: Planting):
    outlier_channel(p)
    return _stored(p, "toward_zero")


@fault("out_through_fp16", "a correct kernel that stores its output through fp16 (within tolerance)", expect=None)
def _out_fp16(p: Planting):
    return _stored(p, "via_fp16")


def _planted(name: str, description: str, rnd: Rounding, expect: str | None = "numerics", may_agree=False) -> None:
    def plant(p: Planting):
        if not rnd.standard_merge and "num_kv_splits" not in p.t:
            raise ValueError(f"{name} needs split-KV decode (num_kv_splits); this capture has none")
        return _control(p, p.spec.dtype, rnd), {"variant": name}

    fault(name, description, expect=expect, may_agree=may_agree)(plant)


_planted("p_fp32", "a correct kernel that keeps the probabilities in fp32 for P.V", Rounding(p_dtype=FP32), None)
_planted("p_fp16", "a correct kernel that rounds the probabilities to fp16 before P.V", Rounding(p_dtype=FP16), None)
_planted("pv_accum_bf16", "a kernel that accumulates P.V in bf16", Rounding(pv_accum=BF16), may_agree=True)
_planted("pv_accum_fp16", "a correct kernel that accumulates P.V in fp16 (within tolerance)", Rounding(pv_accum=FP16),
         None)  # fmt: skip
_planted("qk_accum_bf16", "a kernel that accumulates q.k in bf16", Rounding(qk_accum=BF16))
_planted("qk_accum_fp16", "a kernel that accumulates q.k in fp16", Rounding(qk_accum=FP16), may_agree=True)
_planted("split_lse_bf16", "split partials' lse stored in bf16 before the merge", Rounding(split_lse=BF16))
_planted("split_lse_fp16", "split partials' lse stored in fp16 before the merge (within tolerance)",
         Rounding(split_lse=FP16), None)  # fmt: skip
_planted("merge_log2_as_ln", "split lse stored in log2 units but merged with exp", Rounding(merge="log2_as_ln"))
_planted("merge_ln_as_log2", "natural split lse merged with exp2", Rounding(merge="ln_as_log2"))
_planted("merge_unnormalized", "split partials stored without their 1/sum(p)", Rounding(merge="unnormalized"))

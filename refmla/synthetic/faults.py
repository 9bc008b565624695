"""Planted faults: the observed ``out`` a synthetic capture gets, computed as a broken kernel would.

``none`` is a correct kernel (the low-precision control, at a split kernel's rounding points).
Every other fault is the fp64 reference under that fault, rounded to the output dtype: the kind
of wrong a real kernel or a real transfer bug produces. Each fault is a small function registered
by name with :func:`fault`; the registry's order is the order ``refmla synth --fault`` lists them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from refmla import reference as ref
from refmla.attended import Attended
from refmla.control import STANDARD, Rounding, control_output
from refmla.scales import Scales
from refmla.schedule import MIN_BLOCK_KV
from refmla.synthetic.spec import SynthSpec


@dataclass
class Planting:
    """What a fault function gets: the spec, the inputs, and the reference on (changed) inputs."""

    spec: SynthSpec
    t: dict[str, torch.Tensor]  # the capture's tensors (q, kv_buffer, kv_indptr, kv_indices, ...)

    @property
    def scales(self) -> Scales:
        return self.spec.scales()

    @property
    def att(self) -> Attended:
        """What each query row of the capture reads (refmla.attended)."""
        return Attended.from_tensors(self.t)

    @property
    def request(self) -> int:
        return self.spec.fault_request

    def bounds(self, b: int) -> tuple[int, int]:
        """[start, end) of request b's entries in kv_indices."""
        p = self.t["kv_indptr"]
        return int(p[b]), int(p[b + 1])

    def run(self, q=None, kvb=None, indptr=None, idx=None, **scales: Any) -> torch.Tensor:
        """The fp64 reference output (decode or extend) on these inputs (default: the capture's)."""
        t = self.t
        q = t["q"] if q is None else q
        kvb = t["kv_buffer"] if kvb is None else kvb
        att = self.att if indptr is None and idx is None else Attended.from_tensors(
            {**t, "kv_indptr": t["kv_indptr"] if indptr is None else indptr, "kv_indices": t["kv_indices"] if idx is None else idx}
        )  # fmt: skip
        return ref.mla_ref(q, kvb, att, self.scales.but(**scales))[0]

    def without(self, b: int, start: int, end: int) -> torch.Tensor:
        """The reference with positions [start, end) of request b dropped from its sequence."""
        lo, _ = self.bounds(b)
        keep = torch.ones(len(self.t["kv_indices"]), dtype=torch.bool)
        keep[lo + start : lo + end] = False
        indptr = self.t["kv_indptr"].clone()
        indptr[b + 1 :] -= end - start
        return self.run(indptr=indptr, idx=self.t["kv_indices"][keep])


FaultFn = Callable[[Planting], tuple[torch.Tensor, dict]]
FAULTS: dict[str, FaultFn] = {}  # name -> fn(planting) -> (out, what was planted)
DESCRIPTIONS: dict[str, str] = {}
EXPECT: dict[str, Optional[str]] = {}  # name -> the hypothesis that must name it (None: must pass)
FAULT_MODES: dict[str, Optional[str]] = {}  # name -> the capture mode it needs (None: any)
VERIFY_PRESET: dict[str, str] = {}  # verify faults: the preset they are planted on by default
SPEC_FOR: dict[str, Callable[[SynthSpec], SynthSpec]] = {}  # name -> the spec the fault needs (fp8 pool, ...)
MAY_AGREE: set[str] = set()  # faults that may stay within the tolerance on some presets (agree is no miss)


def fault(
    name: str,
    description: str,
    expect: Optional[str] = "",
    spec: Optional[Callable[[SynthSpec], SynthSpec]] = None,
    may_agree: bool = False,
    mode: Optional[str] = None,
    preset: str = "",
) -> Callable[[FaultFn], FaultFn]:
    """Register a fault. ``expect``: the hypothesis replay must name for it ("" means the fault's
    own name; None means a correct kernel that must pass). tools/bench_diagnosis.py reads EXPECT
    and MAY_AGREE. ``spec``: how a preset becomes one the fault can exist on (e.g. an fp8 pool),
    applied by :func:`spec_for` (refmla.synthetic.synth_capture does). ``may_agree``: on some presets
    the planted output stays within the tolerance, and ``agree`` is then right, not a miss.
    ``mode``: the capture mode the fault needs (None: any), with the ``preset`` it is meant for
    (verify faults)."""

    def register(fn: FaultFn) -> FaultFn:
        FAULTS[name], DESCRIPTIONS[name] = fn, description
        EXPECT[name] = name if expect == "" else expect
        FAULT_MODES[name] = mode
        if preset:
            VERIFY_PRESET[name] = preset
        if spec is not None:
            SPEC_FOR[name] = spec
        if may_agree:
            MAY_AGREE.add(name)
        return fn

    return register


def spec_for(spec: SynthSpec, name: str) -> SynthSpec:
    """The spec fault ``name`` is planted on: ``spec``, or what the fault needs made of it."""
    return SPEC_FOR[name](spec) if name in SPEC_FOR else spec


def faulty_output(spec: SynthSpec, t: dict[str, torch.Tensor], name: str) -> tuple[torch.Tensor, dict]:
    """The observed ``out`` under fault ``name`` (rounded to spec.dtype) and what was planted."""
    if name not in FAULTS:
        raise KeyError(f"unknown fault {name!r}; choose from {', '.join(FAULTS)}")
    out, planted = FAULTS[name](Planting(spec, t))
    return out.to(spec.dtype), {"fault": name, **planted}


# --------------------------------------------------------------------------------------------
# The contract's hypotheses (docs/contract.md section 4), each planted once
# --------------------------------------------------------------------------------------------


@fault("none", "a correct kernel: the low-precision control at the split kernel's rounding points", expect=None)
def _none(p: Planting):
    t = p.t
    out, _ = control_output(t["q"], t["kv_buffer"], p.att, p.scales, p.spec.dtype, t.get("num_kv_splits"),
                            producer_rounding(p.spec))  # fmt: skip
    return out, {}


# SGLang's Triton backend runs extend_attention_fwd for extend and verify: over an fp8 prefix it rounds
# all of q to the pool dtype and meets the new tokens' K / V in q's dtype (refmla.arithmetic.SGLANG_EXTEND)
SGLANG_EXTEND_ROUNDING = Rounding(q_round="whole_to_pool", dequant="new_to_q_dtype")


def producer_rounding(spec: SynthSpec) -> Rounding:
    """The rounding points of the kernel the spec's capture says wrote its ``out``: SGLang's extend
    kernel for an extend or verify capture of its Triton backend, else its split decode kernel's."""
    extend = bool(spec.new_tokens or spec.draft_token_num)
    return SGLANG_EXTEND_ROUNDING if extend and spec.extra_meta.get("backend", "triton") == "triton" else STANDARD


@fault("seq_len_off_by", "the kernel attended seq_len - 1 tokens of the fault request")
def _seq_len_off_by(p: Planting):
    b = p.request
    lo, hi = p.bounds(b)
    _salient_last_token(p, b)
    return p.without(b, hi - lo - 1, hi - lo), {"request": b, "delta": -1}


def _salient_last_token(p: Planting, b: int) -> None:
    """Make request b's newest token one its queries attend to, as a decode step's own token is in
    a real model: its row points along the mean of the request's query rows, scaled so that the
    heads' mean logit for it is 10 (the random rows' logits have a spread of a few units). Among
    thousands of random rows a random last token holds ~1e-3 of the softmax mass, below rounding
    noise, and dropping it would be a fault nobody can see."""
    t = p.t
    qo = t.get("qo_indptr")
    q_rows = t["q"][b : b + 1] if qo is None else t["q"][int(qo[b]) : int(qo[b + 1])]  # [n, H, D]
    if q_rows.numel() == 0 or p.bounds(b)[1] == p.bounds(b)[0]:
        return
    last = int(t["kv_indices"][p.bounds(b)[1] - 1])
    m = q_rows.double().mean(dim=(0, 1))  # [D]
    scale = p.spec.sm_scale * p.spec.k_scale * float((q_rows.double() @ m).mean())  # mean logit of row m
    if scale > 0:
        t["kv_buffer"][last, 0] = (m * (10.0 / scale)).to(t["kv_buffer"].dtype)  # [D]


def _missing_block(p: Planting) -> tuple[int, int]:
    b = p.request
    L = p.bounds(b)[1] - p.bounds(b)[0]
    unit = p.spec.page_size if p.spec.page_size > 1 else MIN_BLOCK_KV
    start, end = unit, min(2 * unit, L - 1)
    if end <= start:
        raise ValueError(f"request {b} (length {L}) is too short for a missing block of {unit}")
    return start, end


@fault("kv_range_missing", "a block of positions of the fault request contributed nothing (dropped)")
def _kv_range_missing(p: Planting):
    start, end = _missing_block(p)
    return p.without(p.request, start, end), {"request": p.request, "start": start, "end": end}


@fault("kv_range_zero", "the same block read as all-zero rows (a KV transfer that had not landed)",
       expect="kv_range_missing")
def _kv_range_zero(p: Planting):
    start, end = _missing_block(p)
    lo, _ = p.bounds(p.request)
    kvz = p.t["kv_buffer"].clone()
    kvz[p.t["kv_indices"][lo + start : lo + end].long()] = 0
    return p.run(kvb=kvz), {"request": p.request, "start": start, "end": end}


@fault("split_missing", "one split's partial left out of the merge")
def _split_missing(p: Planting):
    t, b = p.t, p.request
    if "num_kv_splits" not in t:
        raise ValueError("split_missing needs split-KV decode (num_kv_splits); this capture has none")
    parts, lses, valid = ref.mla_decode_split_ref(t["q"], t["kv_buffer"], p.att, t["num_kv_splits"], p.scales)
    if int(valid[b].sum()) < 2:
        raise ValueError(f"request {b} has fewer than 2 non-empty splits")
    valid = valid.clone()
    valid[b, 1] = False
    return ref.merge_splits(parts, lses, valid)[0], {"request": b, "split": 1}


@fault("wrong_sm_scale", "sm_scale without yarn mscale squared")
def _wrong_sm_scale(p: Planting):
    ratio = (192**-0.5) / p.spec.sm_scale  # the scale without yarn mscale squared
    return p.run(sm_scale=p.spec.sm_scale * ratio), {"ratio": ratio}


@fault("head_misaligned", "the head-padding slice bug (repeat_interleave to 16, first H taken)")
def _head_misaligned(p: Planting):
    H = p.spec.num_heads
    if H < 16:
        mapping = torch.arange(H).repeat_interleave(16 // H)[:H]  # padded, then sliced [:H]
    else:
        mapping = torch.arange(H).roll(1)
    return p.run()[:, mapping], {"mapping": mapping.tolist()}


@fault("logit_cap_mismatch", "a soft cap applied that the model does not use (or omitted)")
def _logit_cap_mismatch(p: Planting):
    cap = 0.0 if p.spec.logit_cap > 0 else 30.0
    return p.run(logit_cap=cap), {"logit_cap": cap}


def describe(name: Optional[str] = None) -> str:
    """One line per fault (or the one named): `name  description`."""
    names = [name] if name else list(FAULTS)
    return "\n".join(f"{n:<22} {DESCRIPTIONS[n]}" for n in names)

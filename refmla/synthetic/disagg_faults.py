"""The faults of a synthetic disaggregated pair, and what ``refmla disagg`` must name for each.

Each fault is a :class:`DisaggFault`: what it does to the transferred decode pool (``transfer``),
to the decode metadata (``decode_lens``) or to the production output (``decode_out``) at the fault
(request, layer, rank, step), and ``expect``: the class (transfer / metadata / compute / none) and
the request, layer, rank, position, page, run offset or step that must be named.

    none           a clean pair
    page_missing   one page of the fault request's prompt never transferred (decode rows all zero)
    run_shifted    one transfer (MORI) run written one position off: decode row j holds prefill row j+1
    other_request  the fault request's prompt rows hold another request's KV
    region_over    the pool's KV region is past the size measured to fail MORI registration, no prompt KV
                   arrives anywhere (every row), the geometry meta says why
    seq_len_stuck  metadata: at the fault step the request's seq_len did not grow by one
    kernel_dropped compute: the production kernel left a block of the request's positions out
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from refmla import reference as ref
from refmla.attended import Attended
from refmla.region_check import SMALLEST_FAILED
from refmla.scales import Scales
from refmla.schedule import MIN_BLOCK_KV
from refmla.synthetic.spec import SynthSpec


@dataclass
class World:
    """One (layer, rank) of the pair: prompt lengths, both pools' slots per request, both pools."""

    base: SynthSpec
    layer: int
    rank: int
    prompt: list[int]
    p_slots: list[torch.Tensor]  # [L] prefill physical slot of each prompt position
    d_slots: list[torch.Tensor]  # [L + steps] decode physical slot of each position
    p_pool: torch.Tensor  # [Np, 1, D]
    d_pool: torch.Tensor  # [Nd, 1, D] as the transfer left it
    g: torch.Generator

    def rid(self, i: int) -> str:
        return f"{self.base.name}-r{i}"


@dataclass
class Planted:
    fault: str
    pool_tokens: Optional[int] = None  # the geometry's max_total_num_tokens, when the fault sets it
    detail: dict = field(default_factory=dict)


def _same(w, lens, s):
    return lens


def _out_as_is(w, t, s):
    return t["out"]


@dataclass
class DisaggFault:
    name: str
    description: str
    fault_class: str  # what disagg must name: transfer | metadata | compute | none
    transfer: Callable[[World, Planted, Any], None] = lambda w, p, spec: None
    decode_lens: Callable[[World, list, int], list] = _same
    decode_out: Callable[[World, dict, int], torch.Tensor] = _out_as_is
    pool_tokens_for: Optional[Callable[[SynthSpec], int]] = None
    everywhere: bool = False  # every (layer, rank), not the fault one only
    where: dict = field(default_factory=dict)  # position / page / offset / step / check, filled from the spec

    def expect(self, spec, planted: Planted) -> dict:
        b = spec.base
        return {"class": self.fault_class, "all_rows": self.everywhere, "layer": spec.fault_layer,
                "rank": spec.fault_rank, "rid": f"{b.name}-r{b.fault_request}", **self.where_for(spec),
                **planted.detail}  # fmt: skip

    def where_for(self, spec) -> dict:
        return {k: (v(spec) if callable(v) else v) for k, v in self.where.items()}


DISAGG_FAULTS: dict[str, DisaggFault] = {}


def lookup(registry: dict, name: str, what: str = "disagg fault") -> Any:
    """``registry[name]``, else KeyError naming the choices (the dense and the sparse pairs' faults)."""
    if name not in registry:
        raise KeyError(f"unknown {what} {name!r}; choose from {', '.join(registry)}")
    return registry[name]


def register(f: DisaggFault) -> DisaggFault:
    DISAGG_FAULTS[f.name] = f
    return f


def _page(p: int):
    return lambda spec: p * spec.base.page_size


def _zero_page(w: World, planted: Planted, spec) -> None:
    P, fr = w.base.page_size, w.base.fault_request
    w.d_pool[w.d_slots[fr][P : 2 * P]] = 0  # allocated, never written: a fresh pool's zeros


def _shift_run(w: World, planted: Planted, spec) -> None:
    P, fr = w.base.page_size, w.base.fault_request
    js = torch.arange(2 * P, 3 * P)
    w.d_pool[w.d_slots[fr][js]] = w.p_pool[w.p_slots[fr][js + 1]]  # the run written one position off


def _other_request(w: World, planted: Planted, spec) -> None:
    fr = w.base.fault_request
    other = max((i for i in range(len(w.prompt)) if i != fr), key=lambda i: w.prompt[i])
    n = min(w.prompt[fr], w.prompt[other])
    w.d_pool[w.d_slots[fr][:n]] = w.p_pool[w.p_slots[other][:n]]
    planted.detail["source_rid"] = w.rid(other)


def _nothing_arrives(w: World, planted: Planted, spec) -> None:
    for i, L in enumerate(w.prompt):
        w.d_pool[w.d_slots[i][:L]] = 0


def _over_limit_tokens(b: SynthSpec) -> int:
    row = b.head_dim * b.kv_dtype.itemsize
    return (SMALLEST_FAILED // row // b.page_size + 1) * b.page_size  # (T + page) rows: past the size measured to fail


def _stuck(w: World, lens: list, s: int) -> list:
    fr = w.base.fault_request
    return [L - 1 if i == fr else L for i, L in enumerate(lens)]  # the same seq_len as the step before


def _dropped_block(w: World, t: dict, s: int) -> torch.Tensor:
    b, fr = w.base, w.base.fault_request
    unit = b.page_size if b.page_size > 1 else MIN_BLOCK_KV
    lo, hi = int(t["kv_indptr"][fr]), int(t["kv_indptr"][fr + 1])
    keep = torch.ones(hi - lo, dtype=torch.bool)
    keep[unit : 2 * unit] = False
    idx = t["kv_indices"][lo:hi][keep]
    indptr = torch.tensor([0, idx.numel()], dtype=torch.int32)
    row = ref.mla_decode_ref(t["q"][fr : fr + 1], t["kv_buffer"], Attended.token_index(indptr, idx),
                             Scales(b.kv_lora_rank, b.sm_scale))[0]  # fmt: skip
    out = t["out"].clone()
    out[fr] = row[0].to(out.dtype)
    return out


for _f in (
    DisaggFault("none", "a clean pair", "none"),
    DisaggFault("page_missing", "one page of the fault request's prompt never transferred (zero rows)", "transfer",
                transfer=_zero_page, where={"position": _page(1), "page": 1, "zero_rows": True}),
    DisaggFault("run_shifted", "one transfer run written one position off (decode row j = prefill row j+1)",
                "transfer", transfer=_shift_run, where={"position": _page(2), "page": 2, "offset": 1}),
    DisaggFault("other_request", "the fault request's prompt rows hold another request's KV", "transfer",
                transfer=_other_request, where={"position": 0, "page": 0}),
    DisaggFault("region_over", "the KV region is over the MR limit: no prompt KV arrives on any layer or rank",
                "transfer", transfer=_nothing_arrives, pool_tokens_for=_over_limit_tokens, everywhere=True,
                where={"position": 0, "page": 0, "region": "finding"}),
    DisaggFault("seq_len_stuck", "metadata: the fault request's seq_len did not grow at the fault step",
                "metadata", decode_lens=_stuck, where={"step": lambda spec: spec.fault_step, "check": "seq_len_step"}),
    DisaggFault("kernel_dropped", "compute: the production kernel left a block of the request's positions out",
                "compute", decode_out=_dropped_block,
                where={"step": lambda spec: spec.fault_step, "diagnosis": "observed"}),
):  # fmt: skip
    register(_f)


def describe() -> str:
    return "\n".join(f"{n:<16} {f.description}" for n, f in DISAGG_FAULTS.items())

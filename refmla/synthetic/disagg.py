"""A synthetic disaggregated pair: a prefill node's and a decode node's captures of the same requests.

For every (layer, rank) the prefill node writes each prompt's latent KV into its paged pool (pages
shuffled) over ``chunks`` extend captures (chunked prefill: capture k covers positions [0, e_k) with
new tokens [e_{k-1}, e_k), page aligned); the transfer copies the prompt rows into the decode
node's pool at other physical slots (another page shuffle); the decode node then runs
``decode_steps`` decode captures, request b attending its prompt plus 1, 2, ... decode tokens,
with the production ``out`` a correct kernel computes over what the decode pool holds.

A fault (refmla.synthetic.disagg_faults) changes what the transfer wrote, the decode metadata or the
production output at one (request, layer, rank, step), and says what ``refmla disagg`` must name.
Files: ``OUT/prefill/L{layer}-R{rank}-c{k}.safetensors``, ``OUT/decode/L{layer}-R{rank}-s{step}.safetensors``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from refmla.attended import Attended
from refmla.capture import write_capture
from refmla.control import mla_control_split
from refmla.scales import Scales
from refmla.synthetic.disagg_faults import DISAGG_FAULTS, Planted, World, lookup
from refmla.synthetic.inputs import geometry_meta
from refmla.synthetic.spec import SynthSpec
from refmla.util import cdiv


@dataclass
class DisaggSpec:
    name: str = "disagg"
    base: SynthSpec = field(default_factory=lambda: SynthSpec(name="disagg", num_heads=4, page_size=16,
                                                              seq_lens=(200, 97, 300, 45), fault_request=2))  # fmt: skip
    layers: tuple = (0, 1)
    ranks: tuple = (0,)
    chunks: int = 2  # prefill captures per (layer, rank)
    decode_steps: int = 2
    fault_layer: int = 1
    fault_rank: int = 0
    fault_step: int = 1  # the decode step a metadata / compute fault hits
    transfer_backend: str = "mori"
    with_out: bool = True  # compute the decode captures' production out (the bench may skip nothing)


DISAGG_PRESETS: dict[str, DisaggSpec] = {
    "disagg": DisaggSpec(),
    "disagg-tp2": DisaggSpec(name="disagg-tp2", ranks=(0, 1), fault_rank=1),
    "disagg-small": DisaggSpec(name="disagg-small", base=SynthSpec(name="disagg-small", num_heads=2, page_size=16,
                                                                   seq_lens=(70, 33, 100, 20), fault_request=2)),
    "disagg-page1": DisaggSpec(name="disagg-page1", base=SynthSpec(name="disagg-page1", num_heads=4, page_size=1,
                                                                   seq_lens=(130, 77, 64), fault_request=0)),
}  # fmt: skip


def disagg_preset(name: str, **overrides: Any) -> DisaggSpec:
    if name not in DISAGG_PRESETS:
        raise KeyError(f"unknown disagg preset {name!r}; choose from {', '.join(DISAGG_PRESETS)}")
    return dataclasses.replace(DISAGG_PRESETS[name], **overrides)


def _layout(lens: list[int], P: int, free_pages: int, g: torch.Generator) -> tuple[list[torch.Tensor], int]:
    """Physical slots of each request's positions (pages handed out shuffled), and the pool's rows."""
    pages_per = [cdiv(L, P) for L in lens]
    n_pages = sum(pages_per) + free_pages + 1  # page 0 stays free: slot 0 is SGLang's padding slot
    perm = torch.randperm(n_pages - 1, generator=g) + 1
    slots, used = [], 0
    for L, n in zip(lens, pages_per):
        pages = perm[used : used + n]
        used += n
        slots.append((pages[:, None] * P + torch.arange(P)[None, :]).reshape(-1)[:L])
    return slots, n_pages * P


def make_world(spec: DisaggSpec, layer: int, rank: int) -> World:
    """One (layer, rank): the KV of every position, both pools' layouts, the transferred decode pool."""
    b, S = spec.base, spec.decode_steps
    g = torch.Generator().manual_seed(b.seed * 7919 + layer * 131 + rank)
    gl = torch.Generator().manual_seed(b.seed * 7919 + layer * 131)  # MLA latent KV: the same on every rank
    prompt = list(b.seq_lens)
    kv = [torch.randn(L + S, b.head_dim, generator=gl).to(b.kv_dtype) for L in prompt]  # [L + S, D] each
    p_slots, p_rows = _layout(prompt, b.page_size, b.free_pages, g)
    d_slots, d_rows = _layout([L + S for L in prompt], b.page_size, b.free_pages, g)
    p_pool = torch.full((p_rows, 1, b.head_dim), math.nan).to(b.kv_dtype)
    d_pool = torch.full((d_rows, 1, b.head_dim), math.nan).to(b.kv_dtype)
    for i, L in enumerate(prompt):
        p_pool[p_slots[i], 0] = kv[i][:L]
        d_pool[d_slots[i], 0] = kv[i]  # the prompt rows as transferred, then the decode tokens
    return World(spec.base, layer, rank, prompt, p_slots, d_slots, p_pool, d_pool, g)


def _meta(spec: DisaggSpec, w: World, side: str, step: int, rids: list[str], planted: Planted, mode: str) -> dict:
    b = spec.base
    return {**geometry_meta(dataclasses.replace(b, pool_tokens=planted.pool_tokens or b.pool_tokens)),
            "mode": mode, "backend": "triton", "kv_lora_rank": b.kv_lora_rank, "qk_rope_head_dim": b.qk_rope_head_dim,
            "sm_scale": b.sm_scale, "logit_cap": b.logit_cap, "page_size": b.page_size, "max_kv_splits": b.max_kv_splits,
            "layer_id": w.layer, "tp_rank": w.rank, "step": step, "rids": rids, "disagg_mode": side,
            "disagg_transfer_backend": spec.transfer_backend,
            "synth": {"preset": spec.name, "seed": b.seed, "fault": planted.fault, "side": side}}  # fmt: skip


def write_prefill(spec: DisaggSpec, w: World, out: Path, planted: Planted) -> list[Path]:
    """``spec.chunks`` extend captures of the prompts (requests with new tokens in that chunk only)."""
    P, K, b = spec.base.page_size, spec.chunks, spec.base
    paths = []
    for k in range(K):
        ends = [min(L, cdiv(cdiv(L * (k + 1), K), P) * P) for L in w.prompt]
        starts = [0 if k == 0 else min(L, cdiv(cdiv(L * k, K), P) * P) for L in w.prompt]
        live = [i for i in range(len(w.prompt)) if ends[i] > starts[i]]
        if not live:
            continue
        new = torch.tensor([ends[i] - starts[i] for i in live])
        lens = torch.tensor([ends[i] for i in live])
        t = {"q": torch.randn(int(new.sum()), b.num_heads, b.head_dim, generator=w.g).to(b.dtype),
             "kv_buffer": w.p_pool, "kv_indptr": _indptr(lens), "seq_lens": lens.to(torch.int32),
             "kv_indices": torch.cat([w.p_slots[i][: ends[i]] for i in live]).to(torch.int32),
             "qo_indptr": _indptr(new)}  # fmt: skip
        path = out / "prefill" / f"L{w.layer}-R{w.rank}-c{k}.safetensors"
        write_capture(path, t, _meta(spec, w, "prefill", k, [w.rid(i) for i in live], planted, "extend"))
        paths.append(path)
    return paths


def _indptr(lens: torch.Tensor) -> torch.Tensor:
    p = torch.zeros(len(lens) + 1, dtype=torch.int32)
    p[1:] = torch.cumsum(lens, 0)
    return p


def write_decode(spec: DisaggSpec, w: World, out: Path, planted: Planted, fault_here: bool) -> list[Path]:
    b, paths = spec.base, []
    B, M = len(w.prompt), max(w.prompt) + spec.decode_steps
    r2t = torch.zeros(B, M, dtype=torch.int64)
    for i in range(B):
        r2t[i, : len(w.d_slots[i])] = w.d_slots[i]
    for s in range(spec.decode_steps):
        lens = [L + 1 + s for L in w.prompt]
        if fault_here and s == spec.fault_step:
            lens = DISAGG_FAULTS[planted.fault].decode_lens(w, lens, s)
        lt = torch.tensor(lens)
        idx = torch.cat([w.d_slots[i][:L] for i, L in enumerate(lens)])
        t = {"q": torch.randn(B, b.num_heads, b.head_dim, generator=w.g).to(b.dtype), "kv_buffer": w.d_pool,
             "kv_indptr": _indptr(lt), "kv_indices": idx.to(torch.int32), "seq_lens": lt.to(torch.int32),
             "num_kv_splits": torch.tensor([min(b.max_kv_splits, max(1, L // 128)) for L in lens], dtype=torch.int32),
             "req_to_token": r2t.to(torch.int32)}  # fmt: skip
        if spec.with_out:
            t["out"] = mla_control_split(t["q"], t["kv_buffer"], Attended.from_tensors(t), t["num_kv_splits"],
                                         Scales(b.kv_lora_rank, b.sm_scale), b.dtype)[0]  # fmt: skip
            if fault_here and s == spec.fault_step:
                t["out"] = DISAGG_FAULTS[planted.fault].decode_out(w, t, s)
        path = out / "decode" / f"L{w.layer}-R{w.rank}-s{s}.safetensors"
        write_capture(path, t, _meta(spec, w, "decode", s, [w.rid(i) for i in range(B)], planted, "decode"))
        paths.append(path)
    return paths


def synth_disagg(out: Any, spec: DisaggSpec, fault: str = "none") -> dict:
    """Write the pair under ``out`` (prefill/ and decode/); returns what was planted and what
    ``refmla disagg`` must name for it (``expect``)."""
    f = lookup(DISAGG_FAULTS, fault)
    if spec.fault_layer not in spec.layers or spec.fault_rank not in spec.ranks:
        raise ValueError(f"fault layer {spec.fault_layer} / rank {spec.fault_rank} not among the layers / ranks written")
    out = Path(out)
    (out / "prefill").mkdir(parents=True, exist_ok=True)
    (out / "decode").mkdir(parents=True, exist_ok=True)
    planted = Planted(fault, pool_tokens=f.pool_tokens_for(spec.base) if f.pool_tokens_for else None)
    for layer in spec.layers:
        for rank in spec.ranks:
            w = make_world(spec, layer, rank)
            here = (layer, rank) == (spec.fault_layer, spec.fault_rank)
            if here or f.everywhere:
                f.transfer(w, planted, spec)
            write_prefill(spec, w, out, planted)
            write_decode(spec, w, out, planted, here)
    return {"fault": fault, "preset": spec.name, "expect": f.expect(spec, planted)}

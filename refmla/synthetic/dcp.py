"""A synthetic decode-context-parallel step: one Kimi-K2 TP8 rank capture per DCP rank in a folder,
laid out as vLLM's DCP path lays it, clean or with one context-parallel mistake planted.

Each rank keeps its shard of every request (position p on rank (p // I) % W, refmla.capture.dcp) in
its own shuffled paged cache (null block 0 and every unwritten row NaN); its kernel attends the
gathered queries (8 x W heads) over its shard: out in bf16, lse in fp32; the combine weighs each
rank's partial by its lse, stores each term in bf16 and sums them there (vLLM's
``cp_lse_ag_out_rs``), rank r keeping heads [8 r, 8 r + 8) as ``dcp_out``. A fault changes what one
rank reads, the length it is handed, the combine, or a rank's metadata; :func:`synth_dcp` returns
what a replay must name (hypothesis, rank, request).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from refmla.capture import dcp, write_capture
from refmla.reference import attend
from refmla.scales import Scales
from refmla.synthetic.spec import KIMI_K2_SCALE


@dataclass(frozen=True)
class DcpPreset:
    world: int
    interleave: int
    block: int
    seq_lens: tuple = (600, 302, 77, 5)  # the last shorter than a round of the ranks at DCP 4 x 16
    tp_heads: int = 8  # Kimi-K2: 64 heads over TP8


PRESETS = {"kimi-k2-tp8-dcp2": DcpPreset(2, 1, 16), "kimi-k2-tp8-dcp4": DcpPreset(4, 16, 64)}
FAULTS = ("none", "geometry_offset", "geometry_interleave", "local_length", "combine_lse_base", "combine_missing",
          "rank_metadata", "shard_missing")  # fmt: skip
D, DV = 576, 512


def synth_dcp(out: Any, preset: str, fault: str = "none", seed: int = 0) -> dict:
    """Write the step's rank captures into folder ``out``; returns {"fault", "dcp_world_size",
    "expect": [[hypothesis, rank, request]]} (request None for a combine-wide mistake)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown DCP preset {preset!r}; choose from {', '.join(PRESETS)}")
    ranks, info = step_captures(PRESETS[preset], fault, seed)
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    for r, (tensors, meta) in enumerate(ranks):
        if tensors is not None:
            write_capture(folder / f"rank{r}.safetensors", tensors, meta)
    return info


def step_captures(p: DcpPreset, fault: str = "none", seed: int = 0) -> tuple[list, dict]:
    """The step's rank captures as [(tensors, meta)] by rank ((None, None) for a rank the fault
    leaves out) and synth_dcp's answer; seeded, the same tensors on every run."""
    if fault not in FAULTS:
        raise ValueError(f"unknown fault {fault!r} for a DCP preset; choose from {', '.join(FAULTS)}")
    W, I = p.world, p.interleave
    g = torch.Generator().manual_seed(seed)
    whole = [torch.randn(L, D, generator=g, dtype=torch.float64).to(torch.bfloat16) for L in p.seq_lens]
    q = (torch.randn(len(p.seq_lens), p.tp_heads * W, D, generator=g) * 0.5).to(torch.bfloat16)
    tot = torch.tensor(p.seq_lens)
    own = [[dcp.positions(r, int(n), W, I) for n in dcp.local_lens(tot, W, r, I)] for r in range(W)]
    reads = {(r, b): own[r][b] for r in range(W) for b in range(len(p.seq_lens))}  # what each kernel attends
    seq = [[int(x.numel()) for x in own[r]] for r in range(W)]
    tots = [list(p.seq_lens) for _ in range(W)]
    expect: list = []
    if fault == "geometry_offset":  # rank 1 reads rank 2's (or 0's) positions of request 0
        reads[(1, 0)] = own[(1 + 1) % W][0]
        expect = [["cp_shard_geometry", 1, 0]]
    elif fault == "geometry_interleave":  # rank 0 reads request 0 at another interleave
        J = 1 if I != 1 else 16
        reads[(0, 0)] = dcp.positions(0, int(dcp.local_lens(tot[:1], W, 0, J)[0]), W, J)
        expect = [["cp_shard_geometry", 0, 0]]
    elif fault == "local_length":  # rank 0's kernel handed request 1 at L // W rows (or one short)
        n, L = seq[0][1], p.seq_lens[1]
        k = L // W if L // W < n else n - 1
        reads[(0, 1)], seq[0][1] = own[0][1][:k], k
        expect = [["cp_local_length", 0, 1]]
    elif fault == "rank_metadata":  # one rank's whole length of request 1 one short
        L = p.seq_lens[1]
        r = (((L - 1) // I) % W + 1) % W
        tots[r][1] = L - 1
        expect = [["cp_rank_metadata", r, 1]]
    elif fault == "combine_lse_base":
        expect = [["cp_combine_lse_base", r, None] for r in range(W)]
    elif fault in ("combine_missing", "shard_missing"):
        expect = [["cp_shard_missing", 1, None]]
    sc = Scales(sm_scale=KIMI_K2_SCALE, kv_lora_rank=DV)
    outs, lses = [], []
    for r in range(W):
        o = torch.zeros(len(p.seq_lens), q.shape[1], DV, dtype=torch.float64)
        lse = torch.full((len(p.seq_lens), q.shape[1]), -math.inf, dtype=torch.float64)
        for b in range(len(p.seq_lens)):
            rows = whole[b][reads[(r, b)]]
            if rows.shape[0]:
                o[b], lse[b] = attend(q[b].double(), rows.double(), sc)
        outs.append(o.to(torch.bfloat16))
        lses.append(lse.float())
    merged = combine(outs, lses, wrong_base=fault == "combine_lse_base", leave_out=1 if fault == "combine_missing" else None)
    ranks: list = []
    for r in range(W):
        if fault == "shard_missing" and r == 1:
            ranks.append((None, None))
            continue
        kv, table = _paged_shard(whole, own[r], p.block, g)
        tensors = {"q": q, "kv_buffer": kv, "block_table": table, "seq_lens": torch.tensor(seq[r], dtype=torch.int32),
                   "out": outs[r], "lse": lses[r], "dcp_out": merged[:, r * p.tp_heads : (r + 1) * p.tp_heads]}  # fmt: skip
        meta = {"mode": "decode", "backend": "unknown", "engine": "synth", "engine_backend": "FLASHMLA",
                "kv_lora_rank": DV, "qk_rope_head_dim": D - DV, "sm_scale": KIMI_K2_SCALE, "logit_cap": 0.0,
                "page_size": p.block, "null_block": 0, "layer_id": 3, "step": 7, "tp_rank": r, "dcp_world_size": W,
                "dcp_rank": r, "dcp_interleave_size": I, "dcp_tot_seq_lens": tots[r], "lse_base": "ln",
                "dcp_combine": "cp_lse_ag_out_rs"}  # fmt: skip
        ranks.append((tensors, meta))
    return ranks, {"fault": fault, "dcp_world_size": W, "dcp_interleave_size": I, "expect": expect}


def combine(outs: list, lses: list, wrong_base: bool = False, leave_out: Optional[int] = None) -> torch.Tensor:
    """cp_lse_ag_out_rs: each rank's partial weighted by its lse in fp32, held in the output dtype,
    summed in it. outs [W] x [B, H, Dv], lses [W] x [B, H] natural; a rank's term with weight 0 (no
    position of the request on it, lse -inf) is 0, whatever its out row holds."""
    keep = [r for r in range(len(outs)) if r != leave_out]
    lse = torch.stack([lses[r] for r in keep])  # [W, B, H]
    top = lse.amax(0)
    top = torch.where(torch.isinf(top), 0.0, top)
    exp = torch.exp2 if wrong_base else torch.exp  # the mistake: a natural lse exponentiated as log2
    w = exp(lse - top)
    w = w / w.sum(0)
    acc = None
    for i, r in enumerate(keep):
        dt = outs[r].dtype
        term = torch.where(w[i][..., None] == 0, 0.0, w[i][..., None] * outs[r].float()).to(dt)
        acc = term if acc is None else (acc.float() + term.float()).to(dt)
    return acc


def _paged_shard(whole: list, own: list, P: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """The rank's paged cache: its positions in local order on shuffled pages; block 0 and every
    unwritten row NaN; the block table padded with the null block."""
    pages = [-(-int(x.numel()) // P) for x in own]
    blocks = sum(pages) + 3
    kv = torch.full((blocks * P, 1, D), float("nan"), dtype=torch.bfloat16)
    perm = torch.randperm(blocks - 1, generator=g) + 1
    table = torch.zeros(len(own), max(pages) + 1, dtype=torch.int32)
    used = 0
    for b, pos in enumerate(own):
        table[b, : pages[b]] = perm[used : used + pages[b]].to(torch.int32)
        used += pages[b]
        j = torch.arange(pos.numel())
        kv[table[b].long()[j // P] * P + j % P, 0] = whole[b][pos]
    return kv, table


__all__ = ["FAULTS", "PRESETS", "DcpPreset", "combine", "step_captures", "synth_dcp"]

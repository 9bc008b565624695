"""Decode-context-parallel (DCP) steps written the way vLLM's DCP path lays them, by a plain loop
of our own: one capture per rank of one Kimi-K2 TP8 decode step.

Nothing here calls refmla's reference, geometry, control or search: ``refmla`` only writes the
files. vLLM's layout: with W ranks and interleave I (``cp_kv_cache_interleave_size``), token
position p of a request is stored on rank (p // I) % W, the rank's positions kept in order in its
own paged cache (block table, null block 0 full of NaN, NaN past each shard's end in its last
page); the rank's metadata holds its local lengths (``get_dcp_local_seq_lens``) and the whole
ones (``dcp_tot_seq_lens``). Every rank attends the same gathered queries (DCP all-gathers the
heads of its group: 8 x W heads for Kimi-K2's 64 over TP8) over its shard and returns out (bf16)
and an lse (fp32, natural; log2 with ``lse_base`` "log2", as FlashInfer-style kernels return it);
``cp_lse_ag_out_rs`` weighs each rank's partial by its lse in fp32, stores it in bf16, and the
reduce-scatter sums the ranks' terms in bf16 and scatters the heads: rank r keeps heads [8 r, 8 r + 8),
recorded as ``dcp_out`` (meta ``dcp_combine`` names the combine; ``combine="fp32"``: one fp32 merge).

PLANTS: name -> function(step) planting the fault into the step (a dict of per-rank dicts)
before it is written, returning what the answer must say (hypothesis, rank, request, positions).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

NULL = 0
KIMI_SM_SCALE = 192**-0.5 * (0.1 * math.log(32.0) + 1.0) ** 2  # yarn factor 32, mscale_all_dim 1


@dataclass(frozen=True)
class DcpSpec:
    world: int = 2  # dcp_world_size
    interleave: int = 1  # cp_kv_cache_interleave_size
    block: int = 16  # the KV cache's block size
    seq_lens: tuple = (1030, 302, 77, 5)  # whole lengths (the last shorter than W x I on DCP 4 x 16)
    tp_heads: int = 8  # Kimi-K2: 64 heads over TP8
    kv_lora_rank: int = 512
    rope: int = 64
    seed: int = 0
    lse_base: str = "ln"  # "log2": the ranks return log2 lse (vLLM's lse_base_on_e False), the combine reads it so
    combine: str = "cp_lse_ag_out_rs"  # vLLM's: each rank's weighted partial in bf16, summed in bf16; "fp32": one merge

    @property
    def heads(self) -> int:  # the gathered heads every rank attends
        return self.tp_heads * self.world


def shard_positions(spec: DcpSpec, r: int, L: int, interleave: int | None = None, rank_of=None) -> list[int]:
    """The positions p < L rank r stores, in order: p with (p // I) % W == r."""
    I = spec.interleave if interleave is None else interleave
    return [p for p in range(L) if (p // I) % spec.world == r]


def make_step(spec: DcpSpec) -> dict:
    """The step before any output: the whole KV of each request, q, and per rank its cache."""
    g = torch.Generator().manual_seed(spec.seed)
    D = spec.kv_lora_rank + spec.rope
    whole = [torch.randn(L, D, generator=g, dtype=torch.float64).to(torch.bfloat16) for L in spec.seq_lens]
    q = (torch.randn(len(spec.seq_lens), spec.heads, D, generator=g) * 0.5).to(torch.bfloat16)
    ranks = {}
    for r in range(spec.world):
        pos = [shard_positions(spec, r, L) for L in spec.seq_lens]
        P = spec.block
        pages = [-(-len(p) // P) for p in pos]
        blocks = sum(pages) + 3
        kv = torch.full((blocks * P, 1, D), float("nan"), dtype=torch.bfloat16)  # NaN: never written
        perm = torch.randperm(blocks - 1, generator=g) + 1
        table = torch.full((len(pos), max(pages) + 1), NULL, dtype=torch.int32)
        used = 0
        for b, p in enumerate(pos):
            table[b, : pages[b]] = perm[used : used + pages[b]]
            used += pages[b]
            for j, x in enumerate(p):  # local row j of the shard holds position x
                kv[int(table[b, j // P]) * P + j % P, 0] = whole[b][x]
        ranks[r] = {"kv": kv, "table": table, "seq": [len(p) for p in pos], "tot": list(spec.seq_lens),
                    "positions": pos}  # fmt: skip
    return {"spec": spec, "whole": whole, "q": q, "ranks": ranks}


def attention(q: torch.Tensor, k: torch.Tensor, sm_scale: float, Dv: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One request, every head, plain fp64: out [H, Dv], natural lse [H] (0 rows: zeros, -inf)."""
    H = q.shape[0]
    out, lse = torch.zeros(H, Dv, dtype=torch.float64), torch.full((H,), -math.inf, dtype=torch.float64)
    if k.shape[0] == 0:
        return out, lse
    k = k.double()
    for h in range(H):
        s = (k @ q[h].double()) * sm_scale
        m = float(s.max())
        p = torch.exp(s - m)
        out[h] = (p[:, None] * k[:, :Dv]).sum(0) / p.sum()
        lse[h] = m + math.log(float(p.sum()))
    return out, lse


def run_ranks(step: dict, reads: dict | None = None) -> None:
    """Each rank's partial out (bf16) and lse (fp32) over the positions it reads: its own shard,
    or ``reads[(r, b)]`` (positions of the whole context) where a fault says otherwise."""
    spec, reads = step["spec"], reads or {}
    for r, rk in step["ranks"].items():
        outs, lses = [], []
        for b in range(len(spec.seq_lens)):
            pos = reads.get((r, b), rk["positions"][b])
            o, l = attention(step["q"][b], step["whole"][b][pos], KIMI_SM_SCALE, spec.kv_lora_rank)
            outs.append(o)
            lses.append(l)
        rk["out"] = torch.stack(outs).to(torch.bfloat16)
        lse = torch.stack(lses)
        rk["lse"] = (lse / math.log(2.0) if spec.lse_base == "log2" else lse).float()


def combine(step: dict, wrong_base: bool = False, leave_out: int | None = None) -> None:
    """cp_lse_ag_out_rs: the ranks' partials merged by lse in fp32 (exp of a natural lse, exp2 of
    a log2 one), heads reduce-scattered. ``wrong_base``: the lse exponentiated in the other base
    (a fault); ``leave_out``: a rank's partial dropped (a fault)."""
    spec = step["spec"]
    base = "2" if (spec.lse_base == "log2") != wrong_base else "e"
    ranks = [r for r in range(spec.world) if r != leave_out]
    outs = torch.stack([step["ranks"][r]["out"].float() for r in ranks])  # [W, B, H, Dv]
    lses = torch.stack([step["ranks"][r]["lse"] for r in ranks])  # [W, B, H]
    m = lses.amax(0)
    w = torch.exp2(lses - m) if base == "2" else torch.exp(lses - m)
    if spec.combine == "cp_lse_ag_out_rs":  # each rank's term w_r / sum(w) * out_r stored in bf16, summed in bf16
        terms = ((w / w.sum(0))[..., None] * outs).to(torch.bfloat16)
        merged = terms[0]
        for t in terms[1:]:
            merged = (merged.float() + t.float()).to(torch.bfloat16)
    else:  # one fp32 merge, rounded once
        merged = (w[..., None] * outs).sum(0) / w.sum(0)[..., None]  # [B, H, Dv]
    for r in range(spec.world):
        step["ranks"][r]["dcp_out"] = merged[:, r * spec.tp_heads : (r + 1) * spec.tp_heads].to(torch.bfloat16)


def write(step: dict, folder, skip_rank: int | None = None) -> Path:
    """One capture per rank in ``folder`` (refmla writes the file, nothing more)."""
    from refmla.capture import write_capture

    spec, folder = step["spec"], Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for r, rk in step["ranks"].items():
        if r == skip_rank:
            continue
        tensors = {"q": step["q"], "kv_buffer": rk["kv"], "block_table": rk["table"],
                   "seq_lens": torch.tensor(rk["seq"], dtype=torch.int32), "out": rk["out"], "lse": rk["lse"],
                   "dcp_out": rk["dcp_out"]}  # fmt: skip
        meta = {"mode": "decode", "backend": "unknown", "engine": "vllm", "engine_backend": "FLASHMLA",
                "kv_lora_rank": spec.kv_lora_rank, "qk_rope_head_dim": spec.rope, "sm_scale": KIMI_SM_SCALE,
                "logit_cap": 0.0, "page_size": spec.block, "null_block": NULL, "layer_id": 3, "step": 7,
                "tp_rank": r, "dcp_world_size": spec.world, "dcp_rank": r, "dcp_interleave_size": spec.interleave,
                "dcp_tot_seq_lens": rk["tot"], "lse_base": spec.lse_base, "dcp_combine": spec.combine}  # fmt: skip
        write_capture(folder / f"rank{r}.safetensors", tensors, meta)
    return folder


def runs(p: list[int]) -> list[list[int]]:
    out: list[list[int]] = []
    for x in sorted(p):
        if out and out[-1][1] == x:
            out[-1][1] = x + 1
        else:
            out.append([x, x + 1])
    return out


# ------------------------------------------------------------------------------------------------
# Faults: each plants into a fresh step and returns what must be named
# ------------------------------------------------------------------------------------------------


def clean(step):
    run_ranks(step)
    combine(step)
    return []


def geometry_offset(step, r=1, b=0):
    """Rank r reads the positions the next rank holds (a rank offset one off)."""
    spec = step["spec"]
    r2 = (r + 1) % spec.world
    run_ranks(step, {(r, b): step["ranks"][r2]["positions"][b]})
    combine(step)
    read = set(step["ranks"][r2]["positions"][b]) - set(step["ranks"][r]["positions"][b])
    return [("cp_shard_geometry", r, b, runs(sorted(read)))]


def geometry_interleave(step, r=0, b=0, interleave=None):
    """Rank r reads the positions an interleave of 1 (or ``interleave``) would give it."""
    spec = step["spec"]
    I = interleave or (1 if spec.interleave != 1 else 16)
    pos = shard_positions(spec, r, spec.seq_lens[b], I)
    run_ranks(step, {(r, b): pos})
    combine(step)
    return [("cp_shard_geometry", r, b, runs(sorted(set(pos) - set(step["ranks"][r]["positions"][b]))))]


def local_length(step, r=0, b=1, recorded=True):
    """Rank r masks request b at L // W rows (the rank-local length without the interleave) or one
    row short when that is no shorter; ``recorded``: the kernel got that length (its seq_lens)."""
    spec, rk = step["spec"], step["ranks"][r]
    n, L = rk["seq"][b], spec.seq_lens[b]
    k = L // spec.world if L // spec.world < n else n - 1
    run_ranks(step, {(r, b): rk["positions"][b][:k]})
    combine(step)
    if recorded:
        rk["seq"][b] = k
    return [("cp_local_length", r, b, runs(rk["positions"][b][k:n]))]


def local_length_masked(step, r=0, b=1):
    """The same mask inside the kernel: its seq_lens right, its output over fewer rows."""
    return local_length(step, r, b, recorded=False)


def combine_lse_base(step):
    """Every rank merges the lse in the other base (a natural lse with exp2, a log2 one with exp)."""
    run_ranks(step)
    combine(step, wrong_base=True)
    return [("cp_combine_lse_base", r, None, None) for r in range(step["spec"].world)]


def combine_missing(step, gone=1):
    """The combine leaves rank ``gone``'s partial out."""
    run_ranks(step)
    combine(step, leave_out=gone)
    spec = step["spec"]
    return [("cp_shard_missing", gone, None, None)]


def rank_metadata(step, r=None, b=1):
    """One rank's dcp_tot_seq_lens one short for request b, at a position another rank holds (its
    own shard unchanged): the ranks disagree on the request's length."""
    spec = step["spec"]
    L = spec.seq_lens[b]
    owner = ((L - 1) // spec.interleave) % spec.world
    r = (owner + 1) % spec.world if r is None else r
    run_ranks(step)
    combine(step)
    step["ranks"][r]["tot"][b] = L - 1
    return [("cp_rank_metadata", r, b, [[L - 1, L]])]


PLANTS = {"geometry_offset": geometry_offset, "geometry_interleave": geometry_interleave,
          "local_length": local_length, "local_length_masked": local_length_masked,
          "combine_lse_base": combine_lse_base, "combine_missing": combine_missing,
          "rank_metadata": rank_metadata}  # fmt: skip


def main() -> None:
    """``python tools/planting_dcp.py OUT [--world W] [--interleave I] [--block P] [--fault NAME]``:
    one step's rank captures in OUT; prints what the replay must name."""
    import argparse
    import json

    a = argparse.ArgumentParser(description="one decode-context-parallel step's rank captures, laid out as vLLM does")
    a.add_argument("out")
    a.add_argument("--world", type=int, default=4)
    a.add_argument("--interleave", type=int, default=1)
    a.add_argument("--block", type=int, default=64)
    a.add_argument("--fault", default="clean", choices=["clean", *PLANTS])
    a.add_argument("--lse-base", default="ln", choices=["ln", "log2"])
    args = a.parse_args()
    step = make_step(DcpSpec(world=args.world, interleave=args.interleave, block=args.block, lse_base=args.lse_base))
    print(json.dumps((PLANTS.get(args.fault) or clean)(step)))
    write(step, args.out)


if __name__ == "__main__":
    main()


__all__ = ["DcpSpec", "PLANTS", "clean", "combine", "make_step", "run_ranks", "runs", "shard_positions", "write"]

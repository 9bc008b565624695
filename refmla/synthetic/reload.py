"""A synthetic KV reload: a prefix written by one request and served to another from a host tier.

The writer request (rid ``writer-0``) computes its prompt into the device pool (pages shuffled) and is
captured at its extend; the radix cache backs its pages up to the host tier and evicts them; a reader
request with another rid (``reader-1``) whose prompt starts with the same tokens gets that prefix as a
host hit (``l3`` presets: its tail from an L3 store), loaded back into new device pages, computes the
rest of its prompt and decodes, captured at a decode step beside an unrelated request (``other-2``).
Every capture carries ``kv_token_ids`` and ``kv_origin`` as the hook writes them, so ``refmla diff-kv
OUT/prefill OUT/decode`` pairs the reader's prefix with the writer's capture by the tokens they hold.

A fault changes what the load-back put into one page of the reader's prefix:

    none                 a clean reload: every row as the writer wrote it
    reload_corrupt_page  the page holds another host page's rows (a wrong host index for one page)
    reload_not_landed    the page is all zero (read before its copy landed: a missing sync)

Files: ``OUT/prefill/writer.safetensors``, ``OUT/prefill/other.safetensors``, ``OUT/decode/step.safetensors``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from refmla.capture import write_capture
from refmla.capture.rows import ORIGIN_CODES
from refmla.synthetic.disagg_faults import lookup

RELOAD_FAULTS = {
    "none": "a clean reload: every reloaded row as the writer wrote it",
    "reload_corrupt_page": "one reloaded page holds another host page's rows",
    "reload_not_landed": "one reloaded page is all zero (read before its copy landed)",
}


@dataclass
class ReloadSpec:
    name: str = "hicache-reload"
    kv_lora_rank: int = 512  # Kimi-K2 / DeepSeek-V3 rows: 512 latent + 64 rope, bf16
    qk_rope_head_dim: int = 64
    num_heads: int = 16  # DeepSeek-V3 / Kimi-K2 query heads per rank at TP8
    page_size: int = 64  # SGLang's page with HiCache on MLA
    prompt: int = 640  # the writer's prompt
    hit: int = 448  # tokens of it the reader gets back (whole pages)
    reader_new: int = 100  # tokens the reader computes after its hit
    decoded: int = 4  # tokens it decoded since
    l3_from: Optional[int] = None  # positions [l3_from, hit) came from the L3 store (HiCache storage)
    fault_page: int = 3  # the reader's page a fault hits
    seed: int = 0


RELOAD_PRESETS: dict[str, ReloadSpec] = {
    "hicache-reload": ReloadSpec(),
    "hicache-l3-reload": ReloadSpec(name="hicache-l3-reload", l3_from=256, fault_page=5),
}


def reload_preset(name: str, **overrides: Any) -> ReloadSpec:
    return dataclasses.replace(lookup(RELOAD_PRESETS, name, "reload preset"), **overrides)


class _Pool:
    """A device pool of whole pages handed out shuffled; page 0 unused, unwritten rows NaN."""

    def __init__(self, spec: ReloadSpec, g: torch.Generator):
        P, D = spec.page_size, spec.kv_lora_rank + spec.qk_rope_head_dim
        pages = 3 * (spec.prompt + spec.reader_new + spec.decoded) // P + 8
        self.P, self.rows = P, torch.full((pages * P, 1, D), math.nan, dtype=torch.bfloat16)
        self.free = (torch.randperm(pages - 1, generator=g) + 1).tolist()

    def alloc(self, n: int) -> torch.Tensor:
        k = -(-n // self.P)
        pages, self.free = self.free[:k], self.free[k:]
        return (torch.tensor(pages)[:, None] * self.P + torch.arange(self.P)).flatten()[:n]


def _capture(path: Path, spec: ReloadSpec, pool: _Pool, reqs: list[dict], new: Optional[list], g) -> str:
    lens = torch.tensor([len(r["tokens"]) for r in reqs])
    D = spec.kv_lora_rank + spec.qk_rope_head_dim
    t = {"kv_buffer": pool.rows.clone(), "kv_indptr": torch.cat([torch.zeros(1), lens.cumsum(0)]).int(),
         "kv_indices": torch.cat([r["slots"] for r in reqs]).int(), "seq_lens": lens.int(),
         "kv_token_ids": torch.tensor([x for r in reqs for x in r["tokens"]], dtype=torch.int64),
         "kv_origin": torch.tensor([x for r in reqs for x in r["origin"]], dtype=torch.int8),
         "q": torch.randn(sum(new) if new else len(reqs), spec.num_heads, D, generator=g).to(torch.bfloat16)}  # fmt: skip
    if new:
        t["qo_indptr"] = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32)
    meta = {"mode": "extend" if new else "decode", "backend": "unknown", "kv_lora_rank": spec.kv_lora_rank,
            "qk_rope_head_dim": spec.qk_rope_head_dim, "sm_scale": (spec.kv_lora_rank + spec.qk_rope_head_dim) ** -0.5,
            "logit_cap": 0.0, "page_size": spec.page_size, "layer_id": 0, "tp_rank": 0, "step": 0, "rids": [r["rid"] for r in reqs]}  # fmt: skip
    write_capture(path, t, meta)
    return str(path)


def _computed(pool: _Pool, rid: str, tokens: list, g) -> dict:
    slots = pool.alloc(len(tokens))
    pool.rows[slots] = torch.randn(len(tokens), 1, pool.rows.shape[-1], generator=g).to(torch.bfloat16)
    return {"rid": rid, "tokens": list(tokens), "slots": slots, "origin": [ORIGIN_CODES["computed"]] * len(tokens)}


def synth_reload(out: Any, spec: ReloadSpec, fault: str = "none") -> dict:
    """Write the captures under ``out`` (module docstring); what was planted and what diff-kv must name."""
    lookup(RELOAD_FAULTS, fault, "reload fault")
    P, k = spec.page_size, spec.hit
    if k % P or not 0 < k <= spec.prompt or not 0 <= spec.fault_page < k // P:
        raise ValueError(f"preset {spec.name}: hit {k} must be whole pages of {P} within the prompt, the fault page below it")
    g = torch.Generator().manual_seed(spec.seed)
    out = Path(out)
    for side in ("prefill", "decode"):
        (out / side).mkdir(parents=True, exist_ok=True)
    pool = _Pool(spec, g)
    vocab = lambda n: torch.randint(5, 150000, (n,), generator=g).tolist()  # noqa: E731
    writer = _computed(pool, "writer-0", vocab(spec.prompt), g)
    _capture(out / "prefill" / "writer.safetensors", spec, pool, [writer], [spec.prompt], g)
    host = pool.rows[writer["slots"]].clone()  # write_backup to the host tier; the device pages then evicted
    pool.rows[writer["slots"]] = torch.randn(spec.prompt, 1, pool.rows.shape[-1], generator=g).to(torch.bfloat16)
    back = host[:k].clone()  # load_back of the hit
    lo, hi = spec.fault_page * P, (spec.fault_page + 1) * P
    if fault == "reload_corrupt_page":
        other = (spec.fault_page + 1) % (spec.prompt // P)
        back[lo:hi] = host[other * P : (other + 1) * P]
    elif fault == "reload_not_landed":
        back[lo:hi] = 0
    slots = pool.alloc(k)
    pool.rows[slots] = back
    tier = [ORIGIN_CODES["host"]] * k
    if spec.l3_from is not None:
        tier[spec.l3_from :] = [ORIGIN_CODES["storage"]] * (k - spec.l3_from)
    suffix = _computed(pool, "reader-1", vocab(spec.reader_new + spec.decoded), g)  # computed after the hit
    reader = {"rid": "reader-1", "tokens": writer["tokens"][:k] + suffix["tokens"], "slots": torch.cat([slots, suffix["slots"]]),
              "origin": tier + suffix["origin"]}  # fmt: skip
    other = _computed(pool, "other-2", vocab(200), g)
    _capture(out / "prefill" / "other.safetensors", spec, pool, [other], [200], g)
    _capture(out / "decode" / "step.safetensors", spec, pool, [other, reader], None, g)
    tier_name = "storage" if spec.l3_from is not None and lo >= spec.l3_from else "host"
    expect = None if fault == "none" else {"request": "reader-1", "written_by": "writer-0", "pages": [spec.fault_page],
                                           "positions": [lo, hi], "tier": tier_name}  # fmt: skip
    return {"fault": fault, "preset": spec.name, "expect": expect}


__all__ = ["RELOAD_FAULTS", "RELOAD_PRESETS", "ReloadSpec", "reload_preset", "synth_reload"]

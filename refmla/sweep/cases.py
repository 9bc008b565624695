"""One dense sweep case (layouts decode, verify, block_table): a point of the space made concrete
(a :class:`~refmla.golden.cases.GoldenCase`; block_table: a :class:`~refmla.sweep.tables.TableCase`),
and its capture tensors, built by the golden suite's generators (refmla.golden.build: hostile
shuffled pages, NaN in every unattended row, inputs on an exact grid) or refmla.sweep.tables.

    point {"heads": 32, "length": "page+1", ...} --case_of--> GoldenCase --capture_of--> Capture

The point pins request 0's length; the batch's other requests draw short edge lengths (0, 1, a
page +- 1, 31 / 32 / 33; block tables: at least 1), all from the case's own seed, so a case is
the same on every run. (The sparse layout's cases: refmla.sweep.sparse.)
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import replace
from typing import Any, Mapping, Optional

import torch

from refmla.capture.format import Capture, parse_meta
from refmla.compare import Tolerance
from refmla.golden.build import BUILDERS
from refmla.golden.check import materialize_pool
from refmla.golden.cases import NO_MSCALE_SCALE, GoldenCase
from refmla.schedule import MIN_BLOCK_KV, vllm_num_kv_splits
from refmla.sweep.bounds import CPU, INT32_BASE_ROW, Bounds
from refmla.sweep.space import edge_unit, length_of
from refmla.sweep.tables import TableCase, table_inputs, table_meta
from refmla.synthetic import DEEPSEEK_V3_SCALE, KIMI_K2_SCALE

FP8_SCALES = (0.8125, 1.375)  # k_scale, v_scale of an fp8 pool (!= 1: a forgotten scale shows)
MAX_KV_SPLITS = 16  # SGLang's default max_kv_splits: the most splits a case asks for (buffers: its own most)
SM_SCALES = (KIMI_K2_SCALE, DEEPSEEK_V3_SCALE, NO_MSCALE_SCALE)
OTHER_LENGTHS = ("0", "1", "page-1", "page", "page+1", "31", "32", "33")
TABLE_FP8_SCALE = 1.375  # k_scale = v_scale of an fp8 block-table pool (vLLM passes one scale; != 1 shows)


def case_seed(seed: int, layout: str, index: int) -> int:
    """A case's own seed from the sweep's seed, its layout and its place in the walk."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{layout}:{index}".encode()).digest()[:4], "little")


def _splits(value: str, lens: list[int], rng: random.Random) -> tuple[int, ...]:
    """Per-request split counts; ``past``: one more than the 32-token blocks of the length (an empty split)."""
    if value == "past":
        return tuple(min(MAX_KV_SPLITS, -(-L // MIN_BLOCK_KV) + 1) for L in lens)
    if value == "mixed":
        return tuple(rng.randint(1, MAX_KV_SPLITS) for _ in lens)
    return (int(value),) * len(lens)


def first_length(layout: str, point: Mapping[str, Any], rng: random.Random, bounds: Bounds = CPU) -> int:
    """Request 0's length: the point's, its multiple ``k`` (of 32, or of the schedule's edge)
    drawn from 1 2 4 8 among those that keep the case within ``bounds`` (its tiles, its longest length)."""
    P, tiles, unit = int(point["page"]), -(-int(point["heads"]) // 16), edge_unit(point, layout)
    value = str(point["length"])
    fits = [k for k in (1, 2, 4, 8)
            if length_of(value, P, k, unit) * tiles <= bounds.tile_tokens and length_of(value, P, k, unit) <= bounds.length]
    fits = fits or [1]
    k = rng.choice((1, 2, 4, 8))  # drawn first whatever fits: the same cases as before where all do
    return length_of(value, P, k if k in fits else fits[-1], unit)


def case_of(layout: str, point: Mapping[str, Any], seed: int, index: int, bounds: Bounds = CPU) -> GoldenCase:
    """The concrete case of ``point`` (the ``index``-th of ``layout``'s walk under ``seed``), within ``bounds``."""
    cs = case_seed(seed, layout, index)
    rng = random.Random(cs)
    if layout == "block_table":
        return _table_case(point, cs, rng, index, bounds)
    P, H, B = int(point["page"]), int(point["heads"]), int(point["batch"])
    qlen = int(point.get("qlen", 0))
    lens = [first_length(layout, point, rng, bounds)]
    tiles = -(-H // 16)
    for _ in range(B - 1):
        L = length_of(rng.choice(OTHER_LENGTHS), P, 1)
        lens.append(L if (sum(lens) + L) * tiles <= bounds.tile_tokens else 0)
    if layout == "verify":
        lens = [max(L, qlen) for L in lens]
    kv = str(point["kv"])
    fp8 = kv.startswith("float8")
    cap = float(point["cap"])
    splits = _splits(str(point.get("splits", "1")), lens, rng) if layout == "decode" else (1,) * B
    return GoldenCase(
        name=f"sweep-{layout}-{index}", why=f"refmla sweep {layout} point {index}", seq_lens=tuple(lens),
        mode="decode" if layout == "decode" else "verify", num_heads=H, page_size=P, num_kv_splits=splits,
        max_kv_splits=max(splits), dtype="bfloat16", kv_dtype=kv,
        sm_scale=rng.choice(SM_SCALES), logit_cap=cap, k_scale=FP8_SCALES[0] if fp8 else 1.0,
        v_scale=FP8_SCALES[1] if fp8 else 1.0, q_scale_exp=3 if cap else -1, free_pages=2, seed=cs,
        draft_token_num=qlen if layout == "verify" else 0, topk=2 if layout == "verify" and qlen >= 3 else 1,
        pool_base_row=base_row(point),
    )  # fmt: skip


def base_row(point: Mapping[str, Any]) -> int:
    """The first row of the case's pool in the kernel's pool: INT32_BASE_ROW where the point's
    ``pool`` is ``past-int32`` (every element offset past 2**31), else 0 (as built)."""
    return INT32_BASE_ROW if point.get("pool") == "past-int32" else 0


def _table_case(point: Mapping[str, Any], cs: int, rng: random.Random, index: int, bounds: Bounds = CPU) -> TableCase:
    """A block-table point made concrete: every request attends >= 1 token (a decode step's own),
    one split count for the batch (``rule``: vLLM's for the longest request), fp8 with one scale."""
    P, H, B = int(point["page"]), int(point["heads"]), int(point["batch"])
    tiles = -(-H // 16)
    value = str(point["length"])
    lens = [max(1, first_length("block_table", point, rng, bounds) if value.startswith("edge") else length_of(value, P, 1))]
    for _ in range(B - 1):
        L = max(1, length_of(rng.choice(OTHER_LENGTHS), P, 1))
        lens.append(L if (sum(lens) + L) * tiles <= bounds.tile_tokens else 1)
    S = vllm_num_kv_splits(max(lens)) if point["splits"] == "rule" else int(point["splits"])
    kv = str(point["kv"])
    scale = TABLE_FP8_SCALE if kv.startswith("float8") else 1.0
    return TableCase(
        name=f"sweep-block_table-{index}", why=f"refmla sweep block_table point {index}", seq_lens=tuple(lens),
        num_heads=H, page_size=P, num_kv_splits=(S,) * B, max_kv_splits=S, dtype="bfloat16", kv_dtype=kv,
        sm_scale=rng.choice(SM_SCALES), k_scale=scale, v_scale=scale, free_pages=2, seed=cs,
        table=str(point["table"]), null=str(point["null"]), pool_base_row=base_row(point),
    )  # fmt: skip


def split_alternatives(case: GoldenCase) -> list[tuple[int, ...]]:
    """The split counts the ``splits`` check runs besides the case's own: 1, and past every length
    (SGLang: one more than the length's 32-token blocks, per request; a block table's one count
    for the batch: one past the longest length), at most MAX_KV_SPLITS."""
    B = len(case.seq_lens)
    if isinstance(case, TableCase):
        return [(1,) * B, (min(MAX_KV_SPLITS, max(case.seq_lens) + 1),) * B]
    return [(1,) * B, tuple(min(MAX_KV_SPLITS, max(1, -(-L // MIN_BLOCK_KV) + 1)) for L in case.seq_lens)]


def capture_of(case: GoldenCase, out: Optional[torch.Tensor] = None,
               num_kv_splits: Optional[torch.Tensor] = None, extra: Optional[dict] = None) -> Capture:
    """The case's capture in memory: its inputs (refmla.golden.build, refmla.sweep.tables), ``out``
    a kernel's output (None: no output yet), ``num_kv_splits`` the split counts that run used (None: the case's)."""
    t = table_inputs(case) if isinstance(case, TableCase) else BUILDERS[case.mode].inputs(case)
    meta = capture_meta(case, extra)
    if num_kv_splits is not None and case.mode == "decode":
        t["num_kv_splits"] = num_kv_splits.to(torch.int32).cpu()
    if out is not None:
        t["out"] = out
    return Capture(path=f"<{case.name}>", meta=parse_meta(meta), **t)


def capture_meta(case: GoldenCase, extra: Optional[dict] = None) -> dict[str, Any]:
    """The capture meta of a sweep case: the golden builder's, without meta["golden"] (whose ``out``
    is the reference; a sweep capture's ``out`` is a kernel's), plus ``extra`` (meta["sweep"])."""
    meta = table_meta(case, Tolerance()) if isinstance(case, TableCase) else BUILDERS[case.mode].meta(case, Tolerance())
    meta.pop("golden", None)
    return {**meta, **(extra or {})}


def moved_pool(cap: Capture, base: int) -> Capture:
    """The capture as the kernel gets a ``past-int32`` case: its pool at rows ``base``.. of a NaN
    pool (refmla.golden.check.materialize_pool; int64 indices), its block table's pages moved with
    it (``base`` is a multiple of every page). The reference keeps the compact pool."""
    moved = materialize_pool(cap, base)
    if cap.block_table is not None:
        moved = replace(moved, block_table=cap.block_table + base // cap.meta.page_size)
    return moved


def with_splits(case: GoldenCase, splits: tuple[int, ...]) -> GoldenCase:
    """The same case with other per-request split counts (within its max_kv_splits)."""
    return replace(case, num_kv_splits=splits, max_kv_splits=max(case.max_kv_splits or 1, *splits))


__all__ = ["MAX_KV_SPLITS", "base_row", "capture_meta", "capture_of", "moved_pool", "case_of", "case_seed", "split_alternatives", "with_splits"]

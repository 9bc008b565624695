"""The KV buffers a model's SGLang pool registers, per page, for the region check before a server
starts (``refmla regions --model | --config``; the check itself is :mod:`refmla.region_check`).

    MLA (DeepSeek-V3, Kimi-K2)   one "MLA KV" buffer per layer: (kv_lora_rank + rope) x dtype bytes per token
    DeepSeek-V3.2 (NSA)          one "KV" buffer per layer (fp8: SGLang's 656-byte row) and one
                                 "indexer" buffer (index_head_dim fp8 + an fp32 scale) per layer
    DeepSeek-V4 (compress_ratios) per layer with ratio r > 0: "C{r} KV" (one row per r tokens: bf16
                                 (nope + rope) x 2, fp8 the V4 layout nope + 2 x rope + nope / 64 + 1),
                                 and for r = 4 a "C4 indexer" (index_head_dim + 4 bytes per 4 tokens);
                                 window-only layers (r = 0) register no compressed buffer

MLA's latent KV is one head, replicated on every tensor-parallel rank: ``tp`` does not shrink a
buffer (each rank registers the same sizes). Numbers follow SGLang 0.5.23's pools; the seed's
DeepSeek-V4-Flash C4 buffer is 256 bytes per token in bf16.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from typing import Any, Optional

from refmla.region_check import PlannedBuffer
from refmla.sparse.presets import V4_FLASH_COMPRESS_RATIOS

KV_DTYPES = {"bf16": 2, "fp8": 1}


@dataclass(frozen=True)
class ModelGeometry:
    """What sizes a model's registered KV buffers (a preset, or read from a HF config.json)."""

    name: str
    layers: int
    kv_lora_rank: int = 512
    qk_rope_head_dim: int = 64
    page_size: int = 64  # SGLang's page size the preset assumes (--page-size overrides)
    compress_ratios: tuple = ()  # DeepSeek-V4: per layer; () for MLA
    index_head_dim: int = 0  # an indexer buffer (V3.2, V4's C4 layers); 0: none


MODELS: dict[str, ModelGeometry] = {
    "deepseek-v4-flash": ModelGeometry("deepseek-v4-flash", 43, 448, 64, 256, V4_FLASH_COMPRESS_RATIOS[:43], 128),
    "deepseek-v3.2": ModelGeometry("deepseek-v3.2", 61, index_head_dim=128),
    "deepseek-v3": ModelGeometry("deepseek-v3", 61),
    "kimi-k2": ModelGeometry("kimi-k2", 61),
}


def model_geometry(name: str) -> ModelGeometry:
    if name not in MODELS:
        raise KeyError(f"unknown model {name!r}; choose from {', '.join(MODELS)} (or --config config.json)")
    return MODELS[name]


def geometry_from_config(path: str) -> ModelGeometry:
    """A HF config.json's geometry; a missing or bad key raises ValueError naming the file and the key."""
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not a readable JSON config: {e}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: not a JSON object")

    def get(key: str, default: Any = None) -> int:
        value = cfg.get(key, default)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{path}: key {key!r} must be an int >= 0 (got {value!r})")
        return value

    ratios = cfg.get("compress_ratios") or ()
    if not isinstance(ratios, (list, tuple)) or not all(isinstance(r, int) and r >= 0 for r in ratios):
        raise ValueError(f"{path}: key 'compress_ratios' must be a list of ints >= 0")
    layers = get("num_hidden_layers")
    if ratios:  # DeepSeek-V4: head_dim = nope + rope; the compressed row's nope part
        rope = get("qk_rope_head_dim", 64)
        return ModelGeometry(path, layers, get("head_dim") - rope, rope, 256, tuple(ratios[:layers]), get("index_head_dim", 128))
    index = get("index_head_dim", 0) if "index_topk" in cfg else 0
    return ModelGeometry(path, layers, get("kv_lora_rank"), get("qk_rope_head_dim"), 64, (), index)


def buffers(g: ModelGeometry, kv_dtype: str = "bf16", page_size: Optional[int] = None) -> list[PlannedBuffer]:
    """The registered buffers of one rank, alike ones counted (the module docstring)."""
    page = page_size or g.page_size
    nope, rope, el = g.kv_lora_rank, g.qk_rope_head_dim, KV_DTYPES[kv_dtype]
    index_row = g.index_head_dim + 4 if g.index_head_dim else 0  # fp8 values + one fp32 scale
    if not g.compress_ratios:
        row = 656 if (g.index_head_dim and kv_dtype == "fp8") else (nope + rope) * el  # V3.2's fp8 NSA row
        out = [PlannedBuffer("MLA KV" if not index_row else "KV", page * row, page, g.layers)]
        return out + ([PlannedBuffer("indexer", page * index_row, page, g.layers)] if index_row else [])
    row = (nope + rope) * 2 if kv_dtype == "bf16" else nope + 2 * rope + nope // 64 + 1
    out = []
    for ratio, n in sorted(Counter(r for r in g.compress_ratios if r > 0).items()):
        if page % ratio:
            raise ValueError(f"--page-size {page} is not a multiple of compress ratio {ratio}")
        out.append(PlannedBuffer(f"C{ratio} KV", page // ratio * row, page, n))
        if ratio == 4 and index_row:
            out.append(PlannedBuffer("C4 indexer", page // 4 * index_row, page, n))
    return out


__all__ = ["KV_DTYPES", "MODELS", "ModelGeometry", "buffers", "geometry_from_config", "model_geometry"]

#!/usr/bin/env python3
"""End to end on a CPU: SGLang's real KV cache writer and state merge with the capture hook on, then
``refmla replay`` on what was captured.

    python tools/capture_writer_e2e.py [--out DIR] [--dtypes bfloat16,float8_e4m3fn] [--tokens 8]

1. builds SGLang's real ``MLATokenToKVPool`` on the CPU for each dtype (fp8 stored as uint8, as
   SGLang does), installs the hook with ``REFMLA_CAPTURE_BACKENDS=kvwrite,merge`` semantics, and
   writes DeepSeek-V3 rows (512 + 64) through ``set_mla_kv_buffer`` and ``set_kv_buffer`` at
   shuffled slots (for fp8 divided by a k_scale first, as SGLang's backend does);
2. merges two attention pieces through SGLang's real ``merge_state`` (on a CPU its Triton
   fallback, interpreted), one row with an empty prefix (lse -inf);
3. replays every capture (``refmla replay``: kv_write rows bit for bit, the merge against fp64).

Exit code: refmla replay's (0: every capture agrees), or 2 when SGLang cannot be built here.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # sglang_kit


class Layer:
    """What the pool reads of SGLang's RadixAttention: the layer id (and the caller's k_scale)."""

    def __init__(self, layer_id: int = 0, k_scale: float | None = None):
        self.layer_id, self.k_scale, self.k_scale_float = layer_id, k_scale, k_scale


def write_rows(pool, tokens: int, seed: int = 0, k_scale: float | None = None) -> None:
    """Two writer calls as SGLang makes them: set_mla_kv_buffer (nope, rope) and set_kv_buffer (k)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    slots = torch.randperm(pool.size, generator=g)[: 2 * tokens] + 1  # slot 0 is SGLang's padding row
    nope = torch.randn(2 * tokens, 1, pool.kv_lora_rank, generator=g).bfloat16()
    rope = torch.randn(2 * tokens, 1, pool.qk_rope_head_dim, generator=g).bfloat16()
    if k_scale is not None:  # SGLang's Triton backend divides k by layer.k_scale before the pool's cast
        nope, rope = nope / k_scale, rope / k_scale
    layer = Layer(0, k_scale)
    pool.set_mla_kv_buffer(layer, slots[:tokens], nope[:tokens], rope[:tokens])
    pool.set_kv_buffer(layer, slots[tokens:], torch.cat([nope[tokens:], rope[tokens:]], -1), None)


def merge_pieces(rows: int = 6, heads: int = 4, dim: int = 64, seed: int = 0):
    """SGLang's merge_state on two pieces of attention; the first row's prefix is empty."""
    import math

    import torch
    from sglang.srt.layers.attention.merge_state import merge_state

    g = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, heads, dim, generator=g)
    pieces = []
    for _ in range(2):
        k, v = torch.randn(24, dim, generator=g), torch.randn(24, dim, generator=g)
        s = torch.einsum("thd,nd->thn", q, k) / math.sqrt(dim)
        pieces.append((torch.einsum("thn,nd->thd", s.softmax(-1), v).bfloat16(), torch.logsumexp(s, -1).float()))
    (oa, la), (ob, lb) = pieces
    oa[0], la[0] = 0, -math.inf
    return merge_state(oa, la, ob, lb)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="capture folder (default: a new temp folder)")
    p.add_argument("--dtypes", default="bfloat16,float8_e4m3fn")
    p.add_argument("--tokens", type=int, default=8)
    args = p.parse_args(argv)

    import sglang_kit

    import refmla.hook
    from refmla.hook.config import HookConfig

    try:
        pools = {d: sglang_kit.mla_pool(d) for d in args.dtypes.split(",")}
    except sglang_kit.Unavailable as e:
        print(f"capture_writer_e2e: cannot build SGLang's pool here: {e}", file=sys.stderr)
        return 2
    out = Path(args.out or tempfile.mkdtemp(prefix="refmla-writer-e2e-"))
    refmla.hook.install(HookConfig(out_dir=str(out), backends=frozenset({"kvwrite", "merge"}), min_seq_len=0))
    try:
        for dtype, pool in pools.items():
            write_rows(pool, args.tokens, k_scale=0.5 if dtype.startswith("float8") else None)
        merge_pieces()
        print(f"hook: {refmla.hook.status()}", file=sys.stderr)
    finally:
        refmla.hook.uninstall()
    from refmla.cli import main as refmla_main

    return refmla_main(["replay", str(out)])


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""End to end on a CPU: SGLang's real DeepSeek-V4 packed KV writers with the capture hook on, then
``refmla replay`` on what was captured (the sibling of tools/capture_writer_e2e.py).

    python tools/capture_v4_writer_e2e.py [--out DIR] [--tokens 6] [--seed 0]

1. builds SGLang 0.5.23's real ``DeepSeekV4TokenToKVPool`` on the CPU (layers: SWA only, C4, C128;
   its DSV4 test kit's mock runner, as tests/dsv4_kit.py does), installs the hook with
   ``REFMLA_CAPTURE_BACKENDS=kvwrite`` semantics;
2. writes through the four pool methods SGLang's DeepSeek-V4 backend and compressors call: a pack
   quantized by SGLang's own Triton quantizer stored by ``set_swa_key_buffer_radix`` and
   ``set_extra_key_buffer`` (SetKAndS, ``_set_k_and_s_triton``), and bf16 rows quantized and stored
   by ``set_swa_key_buffer_radix_fused`` / ``set_extra_key_buffer_fused`` (``fused_store_cache``: its
   ROCm Triton kernel, the one a CPU runs, chosen through SGLang's is_hip_runtime switch);
3. replays every capture (``refmla replay``: the 584 bytes of each kept slot, bit for bit).

Exit code: refmla replay's (0: every capture agrees), or 2 when SGLang's pool cannot be built here.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # dsv4_kit, sglang_kit


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="capture folder (default: a new temp folder)")
    p.add_argument("--tokens", type=int, default=6)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    import dsv4_kit

    import refmla.hook
    from refmla.hook.config import HookConfig

    try:
        pool = dsv4_kit.token_to_kv_pool([0, 4, 128])
        dsv4_kit.pack_quantizer()
    except dsv4_kit.Unavailable as e:
        print(f"capture_v4_writer_e2e: cannot build SGLang's DeepSeek-V4 pool here: {e}", file=sys.stderr)
        return 2
    out = Path(args.out or tempfile.mkdtemp(prefix="refmla-v4writer-e2e-"))
    refmla.hook.install(HookConfig(out_dir=str(out), backends=frozenset({"kvwrite"}), min_seq_len=0))
    dsv4_kit.rocm_store()
    try:
        dsv4_kit.write_v4(pool, args.tokens, args.seed)
        print(f"hook: {refmla.hook.status()}", file=sys.stderr)
    finally:
        dsv4_kit.rocm_store(False)
        refmla.hook.uninstall()
    from refmla.cli import main as refmla_main

    return refmla_main(["replay", str(out)])


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""End to end on a CPU: SGLang's Triton MLA decode with the capture hook on, then ``refmla replay``.

    python tools/capture_e2e.py [--out DIR] [--dtype bfloat16|float32] [--mode decode|extend]

1. builds SGLang's real ``TritonAttnBackend`` with a real ``MLATokenToKVPool`` (through SGLang's
   attention test kit's mock model runner; see tests/sglang_kit.py), kernels in the Triton
   interpreter, DeepSeek-V3 TP8 shapes (16 heads, 512 + 64), shuffled KV pages;
2. installs the hook (as ``REFMLA_CAPTURE_DIR`` + ``import refmla.hook`` would) and runs one
   forward through ``RadixAttention -> forward_decode`` (or ``forward_extend``);
3. replays the capture with ``refmla replay`` (in this process, after removing the hook) and
   prints its table, then checks that the replayed ``triton`` output equals the production
   ``out`` bit for bit.

Needs sglang 0.5.23 and tools/requirements-hook*.txt. Exit code: refmla replay's (0 agree), or 1
when observed != triton, or 2 when the stack cannot be built here.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # sglang_kit: the test kit


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="capture folder (default: a new temp folder)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--mode", default="decode", choices=("decode", "extend"))
    p.add_argument("--prefix-lens", default="300,129,65", help="cached tokens per request")
    args = p.parse_args(argv)

    import sglang_kit as testing

    try:
        testing.prepare()  # TRITON_INTERPRET=1 + torchvision shim before sglang is imported
        testing.kit()
    except testing.Unavailable as e:
        print(f"capture_e2e: cannot build SGLang's backend here: {e}", file=sys.stderr)
        return 2

    import torch

    import refmla.hook
    from refmla.capture import read_capture
    from refmla.hook.config import HookConfig

    out = Path(args.out or tempfile.mkdtemp(prefix="refmla-e2e-"))
    prefix = tuple(int(x) for x in args.prefix_lens.split(","))
    case = testing.Case(mode=args.mode, prefix_lens=prefix, dtype=args.dtype,
                        extend_lens=tuple(3 + i for i in range(len(prefix))) if args.mode == "extend" else (),
                        max_context_len=max(prefix) + 16)  # fmt: skip
    fx = testing.build(case)
    refmla.hook.install(HookConfig(out_dir=str(out), modes=frozenset({args.mode}), min_seq_len=1))
    t0 = time.perf_counter()
    served = testing.attention_call(fx)
    print(f"production {args.mode} ({args.dtype}, B={len(prefix)}, H=16): {time.perf_counter() - t0:.1f} s "
          f"in the Triton interpreter; hook: {refmla.hook.status()}", file=sys.stderr)  # fmt: skip
    refmla.hook.uninstall()
    files = sorted(out.glob("*.safetensors"))
    if len(files) != 1:
        print(f"capture_e2e: expected one capture in {out}, found {len(files)}", file=sys.stderr)
        return 2
    path = files[0]
    cap = read_capture(path)
    assert torch.equal(cap.out.reshape(served.shape), served), "capture out != what the server returned"
    print(f"capture: {path} ({path.stat().st_size} bytes)")

    from refmla.cli import main as refmla_main

    backend = "triton" if args.mode == "decode" else "extend"
    rc = refmla_main(["replay", str(path), "--backend", backend])

    if args.mode == "decode":
        from refmla.backends.triton import TritonBackend
        from refmla.context import ReplayOptions

        res = TritonBackend().run(cap, ReplayOptions())
        same = torch.equal(res.out, cap.out)
        print(f"observed == triton bit for bit: {same}")
        if not same:
            return 1
    return rc


if __name__ == "__main__":
    sys.exit(main())

"""Benchmark: `refmla disagg` on a realistic disaggregated pair against running diff-kv and replay separately.

The pair (refmla.synthetic.disagg, written once, timed apart): 64 requests of ~4k prompt tokens
(3584..4607), 3 layers x 8 ranks, page size 16, chunked prefill (2 extend captures per layer and
rank), 1 decode step, bf16 Kimi-K2 latent rows (576), heads shrunk to 1 per rank so that the files
stay on one disk (about 0.9 GB per layer and rank: the prefill pool, the prefill q, the decode pool).

Two arms on the same captures and the same backends (default ``--backend observed``: the fp64
reference, the low-precision control and the production output; the interpreted Triton kernel and
the extend baseline cost the same in both arms, since both run refmla.batch.replay_many):

    cli   `refmla disagg PREFILL --decode DECODE --json` vs one `refmla diff-kv` per decode capture
          (its prefill chunk captures) + one `refmla replay DECODE --json`, each a process as a user runs them
    api   refmla.disagg.run_disagg vs refmla.diffkv.diff_kv_files per decode capture + refmla.batch.replay_many,
          in this process (no start-up costs)

disagg must be no slower than the sum. Run:  python tools/bench_disagg.py [--arms cli,api] [--keep DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from refmla.synthetic.disagg import DisaggSpec, synth_disagg  # noqa: E402
from refmla.synthetic.spec import SynthSpec  # noqa: E402


def spec_for(a) -> DisaggSpec:
    lens = tuple(a.tokens - 512 + (i * 97) % 1024 for i in range(a.requests))  # ~4k on average
    base = SynthSpec(name="bench", num_heads=a.heads, page_size=a.page_size, seq_lens=lens, free_pages=8)
    return DisaggSpec(name="bench", base=base, layers=tuple(range(a.layers)), ranks=tuple(range(a.ranks)),
                      chunks=2, decode_steps=1, fault_layer=0, fault_rank=0)  # fmt: skip


def refmla(*args: str) -> float:
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, "-m", "refmla", *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                         text=True, env=env)  # fmt: skip
    if res.returncode not in (0, 1):
        raise SystemExit(f"refmla {' '.join(args[:3])} ... exit {res.returncode}: {res.stderr.strip()[-400:]}")
    return time.perf_counter() - t0


def prefill_of(root: Path, decode: Path) -> list[str]:
    layer_rank = decode.name.rsplit("-s", 1)[0]  # L{layer}-R{rank}
    return sorted(str(p) for p in (root / "prefill").glob(f"{layer_rank}-c*.safetensors"))


def arm_cli(root: Path, backends: list[str], jobs: int) -> tuple[float, float, float]:
    flags = [x for b in backends for x in ("--backend", b)] + ["--jobs", str(jobs)]
    decode = sorted((root / "decode").glob("*.safetensors"))
    t_diff = sum(refmla("diff-kv", *prefill_of(root, d), str(d), "--json") for d in decode)
    t_replay = refmla("replay", str(root / "decode"), "--json", *flags)
    t_disagg = refmla("disagg", str(root / "prefill"), "--decode", str(root / "decode"), "--json", *flags)
    return t_disagg, t_diff, t_replay


def arm_api(root: Path, backends: list[str], jobs: int) -> tuple[float, float, float]:
    from refmla.batch import replay_many
    from refmla.context import ReplayOptions
    from refmla.diffkv import diff_kv_files
    from refmla.disagg import run_disagg

    opts = ReplayOptions(backends=backends)
    decode = sorted(str(p) for p in (root / "decode").glob("*.safetensors"))
    prefill = sorted(str(p) for p in (root / "prefill").glob("*.safetensors"))
    t0 = time.perf_counter()
    for d in decode:
        diff_kv_files(prefill_of(root, Path(d)), d)
    t1 = time.perf_counter()
    replay_many(decode, opts, jobs=jobs)
    t2 = time.perf_counter()
    report = run_disagg(prefill, decode, opts, jobs=jobs)
    t3 = time.perf_counter()
    assert report.exit_code == 0, report.sentence
    print(f"  api disagg stages: {report.seconds}")
    return t3 - t2, t1 - t0, t2 - t1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--heads", type=int, default=1)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--backend", action="append", default=None, help="default: observed (with the reference)")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--arms", default="cli,api")
    ap.add_argument("--keep", default=None, help="write the pair here and keep it (reused when present)")
    a = ap.parse_args()
    backends = a.backend or ["observed"]
    root = Path(a.keep or tempfile.mkdtemp(prefix="refmla-bench-disagg-"))
    try:
        if not (root / "decode").is_dir():
            t0 = time.perf_counter()
            synth_disagg(root, spec_for(a), "none")
            size = sum(p.stat().st_size for p in root.rglob("*.safetensors")) / 2**30
            print(f"generated {a.requests} requests x ~{a.tokens} tokens, {a.layers} layers x {a.ranks} ranks: "
                  f"{size:.1f} GiB in {time.perf_counter() - t0:.1f} s (not part of the timings)")  # fmt: skip
        for arm in a.arms.split(","):
            t_disagg, t_diff, t_replay = (arm_cli if arm == "cli" else arm_api)(root, backends, a.jobs)
            total = t_diff + t_replay
            print(f"{arm}: disagg {t_disagg:.1f} s vs diff-kv {t_diff:.1f} s + replay {t_replay:.1f} s = {total:.1f} s: "
                  f"ratio {t_disagg / total:.2f} ({'ok' if t_disagg <= total else 'SLOWER'}) "
                  f"[backends reference + {' + '.join(backends)}, jobs {a.jobs}]")  # fmt: skip
    finally:
        if not a.keep:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Benchmark: the fp64 reference against aiter's own torch reference and this machine's limits.

Per --threads count, one fresh process reads the capture (64 requests x 16 heads x 2k-4k tokens,
bf16, page size 1, shuffled slots, D = 576: Kimi-K2 / DeepSeek-V3), and measures there:

    reference     refmla.reference.mla_decode_ref (fp64, blocked: refmla.blocked); its peak memory
                  on its first call, before anything else ran in the process
    aiter         aiter's own op_tests/test_mla.py::torch_mla_extend (+ ref_masked_attention), fp32
                  einsum, loaded at run time from the checkout --aiter-repo names (or $REFMLA_AITER_REPO:
                  tools/aiter_peer.py executes only those functions, never imports aiter, copies
                  nothing of it), called as aiter's tests call it for decode (qo_indptr = 0..B)
    peer_loop     the per-request fp64 loop peers write
    dgemm         the limit on compute: a square fp64 GEMM (N = --gemm-n), torch's threads
    gather        the limit on memory: every attended row gathered as stored and upcast to
                  fp64, in blocks of 64k rows into one reused buffer, torch's threads
    floor         the limit of the reference's shape: its own work and nothing else, on the
                  same worker threads (refmla.blocked.run_units) - every block of BLOCK_ROWS
                  rows gathered and upcast into a reused buffer, then its two fp64 GEMMs
                  [H, D] x [D, n] and [H, n] x [n, Dv] (no softmax, no merge); and those GEMMs
                  alone on one in-cache block, for their rate (M = H = 16 rows: a skinny GEMM
                  runs well below a square one)

reference, aiter and peer_loop are timed in that one process, interleaved, best of --repeat, after
one untimed call each (aiter's output is checked against the reference on it: bf16 rounding).

    flops  = sum_b 2 * H * L_b * D  (q.k)  +  2 * H * L_b * Dv  (p.v)
    bytes  = sum_b L_b * D * itemsize      (the attended rows as stored, read once)

Targets (exit 1 when one is missed, 0 when all that were measured hold): reference / aiter <= 1.2
at 1 thread and <= 0.8 at 2; the reference 1.7x faster at 2 threads than at 1; the reference at
>= 60 % of the limit that bounds it (the largest of flops / dgemm rate, the gather time and the
floor); reference / peer_loop <= 1.0; its peak memory (RSS above the opened, pre-read capture)
within its stated budget: threads x refmla.blocked.unit_budget + the outputs + 16 MiB. Without an
aiter checkout the aiter targets are not judged, and the run says so. Exit 2: a bad --aiter-repo.

    python tools/bench_reference.py --aiter-repo /path/to/aiter [--repeat 5] [--threads 1,2]

Only op_tests/test_mla.py of the checkout is read (a sparse checkout of op_tests/ is enough).
Other jobs sharing the cores slow the 2-thread runs most: every run prints the 1-minute load
average taken around it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from aiter_peer import ENV, AiterPeerError, load_aiter_peer  # noqa: E402
from refmla.attended import Attended  # noqa: E402
from refmla.blocked import BLOCK_ROWS, run_units, unit_budget  # noqa: E402
from refmla.capture import read_capture, write_capture  # noqa: E402
from refmla.reference import mla_decode_ref  # noqa: E402
from refmla.scales import Scales  # noqa: E402
from refmla.synth import SynthSpec, make_inputs, make_meta  # noqa: E402

ALLOWANCE_MIB = 16  # interpreter, thread stacks and BLAS scratch besides the reference's own buffers
TARGET_FRACTION, TARGET_PEER, TARGET_SCALING = 0.6, {1: 1.2, 2: 0.8}, 1.7
PEER_TOLERANCE = 2**-6  # aiter's bf16 output against the fp64 reference, relative to max |out|


def peer_loop(q, kv_buffer, kv_indptr, kv_indices, *, kv_lora_rank, sm_scale):
    """The straightforward formulation: per request gather K and V, matmul, softmax, matmul."""
    outs, lses = [], []
    for b in range(q.shape[0]):
        idx = kv_indices[int(kv_indptr[b]) : int(kv_indptr[b + 1])].long()
        k = kv_buffer[idx, 0].double()  # [L, D]
        v = kv_buffer[idx, 0, :kv_lora_rank].double()  # [L, Dv]
        s = q[b].double() @ k.T * sm_scale  # [H, L]
        outs.append(torch.softmax(s, dim=-1) @ v)  # [H, Dv]
        lses.append(torch.logsumexp(s, dim=-1))  # [H]
    return torch.stack(outs), torch.stack(lses)


def probe_dgemm(n: int) -> float:
    """Seconds of one square fp64 GEMM [n, n] x [n, n], best of 3 (flops: 2 n^3)."""
    a, b = torch.randn(n, n, dtype=torch.float64), torch.randn(n, n, dtype=torch.float64)
    a @ b  # warm (BLAS threads, pages)
    return min(_seconds(lambda: a @ b) for _ in range(3))


def probe_gather(kv_buffer, kv_indices, block: int = 1 << 16) -> float:
    """Seconds to gather every attended row as stored and upcast it to fp64, block by block."""
    pool, rows = kv_buffer[:, 0], kv_indices.long()
    stored = pool.new_empty(block, pool.shape[-1])
    up = torch.empty(block, pool.shape[-1], dtype=torch.float64)

    def run():
        for s in range(0, rows.shape[0], block):
            n = min(block, rows.shape[0] - s)
            torch.index_select(pool, 0, rows[s : s + n], out=stored[:n])
            up[:n].copy_(stored[:n])

    run()
    return min(_seconds(run) for _ in range(3))


def probe_floor(q, kv_buffer, kv_indptr, kv_indices, kv_lora_rank: int) -> dict:
    """Seconds of the reference's irreducible work (module docstring: floor) on torch's threads,
    and seconds of its GEMMs alone at the same shapes on one in-cache block (the skinny-GEMM rate)."""
    pool, H, D = kv_buffer[:, 0], q.shape[1], kv_buffer.shape[-1]
    p = torch.rand(H, BLOCK_ROWS, dtype=torch.float64)  # stands for the probabilities: [H, n]
    local = threading.local()

    def request(b: int) -> None:
        if not hasattr(local, "bufs"):
            local.bufs = (pool.new_empty(BLOCK_ROWS, D), torch.empty(BLOCK_ROWS, D, dtype=torch.float64))
        stored, up = local.bufs
        qb, rows = q[b].double(), kv_indices[int(kv_indptr[b]) : int(kv_indptr[b + 1])].long()
        for s in range(0, rows.shape[0], BLOCK_ROWS):
            n = min(BLOCK_ROWS, rows.shape[0] - s)
            torch.index_select(pool, 0, rows[s : s + n], out=stored[:n])
            kv = up[:n].copy_(stored[:n])  # [n, D]
            qb @ kv.T  # [H, n]
            p[:, :n] @ kv[:, :kv_lora_rank]  # [H, Dv]

    total = min(_seconds(lambda: run_units(request, list(range(q.shape[0])))) for _ in range(2))
    blocks = sum(-(-int(kv_indptr[b + 1] - kv_indptr[b]) // BLOCK_ROWS) for b in range(q.shape[0]))
    kv, qb = torch.randn(BLOCK_ROWS, D, dtype=torch.float64), q[0].double()

    def gemms() -> None:
        for _ in range(256):
            qb @ kv.T
            p @ kv[:, :kv_lora_rank]

    torch.set_num_threads(1)  # as a worker runs them
    with_one = min(_seconds(gemms) for _ in range(3)) / 256  # one block's two GEMMs, one thread's BLAS
    return {"floor": total, "gemm_block": with_one, "blocks": blocks}


def reference(q, kv_buffer, kv_indptr, kv_indices, *, kv_lora_rank, sm_scale):
    """refmla's: the token-index metadata described once (Attended), the fp64 reference over it."""
    att = Attended.token_index(kv_indptr, kv_indices)
    return mla_decode_ref(q, kv_buffer, att, Scales(kv_lora_rank=kv_lora_rank, sm_scale=sm_scale))


def _seconds(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def run_child(path: str, threads: int, repeat: int, gemm_n: int, aiter_repo: str | None) -> dict:
    """In this (fresh) process: open the capture, read its pool once, then the reference's peak on
    its first call, aiter's error and peak, the probes, and the formulations' times (module docstring)."""
    torch.set_num_threads(threads)
    cap = read_capture(path)
    kv, m = cap.kv_buffer, cap.meta
    float(kv[:, 0, :1].float().sum())  # page the pool in: its file pages are the capture, not the work
    args = (cap.q, kv, cap.kv_indptr, cap.kv_indices)
    kw = dict(kv_lora_rank=m.kv_lora_rank, sm_scale=m.sm_scale)
    formulations = {"reference": reference, "peer_loop": peer_loop}
    r: dict = {"load": [os.getloadavg()[0]], "peak_above_open_mib": {}}
    _reset_peak()
    base = _status_kib("VmRSS")
    want, _ = reference(*args, **kw)  # the first call: this process image's peak (ru_maxrss would include the parent's)
    r["peak_above_open_mib"]["reference"] = (_status_kib("VmHWM") - base) / 1024
    if aiter_repo:
        peer = load_aiter_peer(aiter_repo)
        formulations["aiter"] = peer.decode
        _reset_peak()
        base = _status_kib("VmRSS")
        got, _ = peer.decode(*args, **kw)
        r["peak_above_open_mib"]["aiter"] = (_status_kib("VmHWM") - base) / 1024
        r["aiter_error"] = float((got.double() - want).abs().max() / want.abs().max())
    peer_loop(*args, **kw)  # warm, as the others were
    r["dgemm"] = probe_dgemm(gemm_n)
    r["gather"] = probe_gather(kv, cap.kv_indices)
    r.update(probe_floor(cap.q, kv, cap.kv_indptr, cap.kv_indices, m.kv_lora_rank))
    torch.set_num_threads(threads)  # probe_floor's GEMM rate ran on one
    times: dict[str, list[float]] = {}
    for _ in range(repeat):  # interleaved
        for name, fn in formulations.items():
            times.setdefault(name, []).append(_seconds(lambda: fn(*args, **kw)))
    r["load"].append(os.getloadavg()[0])
    r["times"] = {name: min(v) for name, v in times.items()}
    return r


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def _reset_peak() -> None:
    """Start VmHWM afresh at the current RSS (Linux: write 5 to clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--aiter-repo", default=os.environ.get(ENV), help=f"an aiter checkout (default: ${ENV})")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--min-len", type=int, default=2048)
    ap.add_argument("--max-len", type=int, default=4096)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts, each measured (default 1,2)")
    ap.add_argument("--gemm-n", type=int, default=2048, help="square dgemm size of the compute probe")
    ap.add_argument("--child", metavar="PATH", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(run_child(args.child, int(args.threads), args.repeat, args.gemm_n, args.aiter_repo)))
        return 0
    if args.aiter_repo:
        try:
            peer = load_aiter_peer(args.aiter_repo)
        except AiterPeerError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(f"aiter: {peer.path} (commit {peer.commit or 'unknown: not a git checkout'}), "
              f"executing only {', '.join(peer.functions)}")  # fmt: skip
    else:
        print(f"aiter: no checkout given (--aiter-repo / ${ENV}): its targets are NOT judged")
    threads = [int(t) for t in args.threads.split(",")]
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(args.min_len, args.max_len + 1, (args.requests,), generator=g).tolist()
    spec = SynthSpec(name="bench", num_heads=args.heads, seq_lens=tuple(lens), free_pages=0)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "bench.safetensors")
        write_capture(path, make_inputs(spec), make_meta(spec), compact=False)
        size_mib = os.path.getsize(path) / 2**20
        print(f"capture: {args.requests} requests x {args.heads} heads x {args.min_len}-{args.max_len} tokens, "
              f"bf16, {size_mib:.0f} MiB; torch {torch.__version__}, best of {args.repeat}, interleaved")  # fmt: skip
        for t in threads:
            cmd = [sys.executable, __file__, "--child", path, "--threads", str(t), "--repeat", str(args.repeat),
                   "--gemm-n", str(args.gemm_n), *(["--aiter-repo", args.aiter_repo] if args.aiter_repo else [])]
            results[t] = json.loads(subprocess.check_output(cmd))
    H, D, Dv = args.heads, spec.head_dim, spec.kv_lora_rank
    shape = Shape(H, D, Dv, spec.kv_dtype.itemsize, sum(2 * H * L * D + 2 * H * L * Dv for L in lens),
                  sum(lens) * D * spec.kv_dtype.itemsize, args.requests * H * (Dv + 1) * 8 / 2**20)  # fmt: skip
    ok = all([report(t, results[t], shape, args.gemm_n) for t in threads])
    if 1 in results and 2 in results:
        gain = results[1]["times"]["reference"] / results[2]["times"]["reference"]
        good = gain >= TARGET_SCALING
        print(f"-- reference 2 threads vs 1: {gain:.2f}x (target >= {TARGET_SCALING}): {'ok' if good else 'MISSED'}")
        ok &= good
    print("all measured targets met" if ok else "TARGET MISSED")
    return 0 if ok else 1


@dataclass(frozen=True)
class Shape:
    """The batch's dimensions and counts (module docstring: flops, bytes)."""

    H: int
    D: int
    Dv: int
    itemsize: int  # of the rows as stored
    flops: int
    row_bytes: int
    out_mib: float  # the reference's outputs, fp64


def report(t: int, r: dict, x: Shape, gemm_n: int) -> bool:
    """Print one thread count's figures and verdicts; True when its measured targets hold."""
    times, mem = r["times"], r["peak_above_open_mib"]
    peak_rate, gather_t, ref_t = 2 * gemm_n**3 / r["dgemm"], r["gather"], times["reference"]  # flop/s, s, s
    print(f"-- {t} thread(s), load average {min(r['load']):.2f}-{max(r['load']):.2f}: dgemm {peak_rate / 1e9:.1f} "
          f"GFLOP/s fp64 (n = {gemm_n}), gather {x.row_bytes / gather_t / 1e9:.2f} GB/s ({gather_t:.3f} s for "
          f"{x.row_bytes / 2**20:.0f} MiB as stored)")  # fmt: skip
    for name, s in times.items():
        prec, peak = "fp32" if name == "aiter" else "fp64", f"peak +{mem[name]:.0f} MiB" if name in mem else ""
        print(f"   {name:<10} {s:7.3f} s  {x.flops / s / 1e9:6.2f} GFLOP/s {prec}  {peak}")
    compute_t, floor_t = x.flops / peak_rate, r["floor"]
    skinny_rate = (2 * x.H * BLOCK_ROWS * x.D + 2 * x.H * BLOCK_ROWS * x.Dv) / r["gemm_block"]  # one thread's BLAS
    print(f"   floor      {floor_t:7.3f} s  (the reference's gathers and GEMMs alone; its GEMMs at "
          f"[{x.H}, {x.D}] x [{x.D}, {BLOCK_ROWS}]: {skinny_rate / 1e9:.1f} GFLOP/s per thread = "
          f"{skinny_rate * t / peak_rate:.0%} of the square dgemm)")  # fmt: skip
    bound, which = max((compute_t, "fp64 peak"), (gather_t, "gather"), (floor_t, "floor"))
    frac = bound / ref_t
    verdicts = [(f"reference at {frac:.0%} of the {which} bound ({compute_t / ref_t:.0%} of the fp64 peak, "
                 f"{gather_t / ref_t:.0%} of the gather time, {floor_t / ref_t:.0%} of the floor)",
                 frac >= TARGET_FRACTION, f">= {TARGET_FRACTION:.0%}")]  # fmt: skip
    if "aiter" in times:
        err = r["aiter_error"]
        verdicts.append((f"aiter's output against the reference: max error {err:.1e} of max |out|",
                         err <= PEER_TOLERANCE, f"<= {PEER_TOLERANCE:.1e}, bf16 rounding"))  # fmt: skip
        target = TARGET_PEER.get(t, TARGET_PEER[2])
        ratio = ref_t / times["aiter"]
        verdicts.append((f"ratio reference / aiter = {ratio:.3f}", ratio <= target, f"<= {target}"))
    loop = ref_t / times["peer_loop"]
    verdicts.append((f"ratio reference / peer_loop = {loop:.3f}", loop <= 1.0, "<= 1.0"))
    budget = t * unit_budget(x.H, x.D, x.Dv, x.itemsize) / 2**20 + x.out_mib + ALLOWANCE_MIB
    peak = mem["reference"]
    verdicts.append((f"reference peak +{peak:.0f} MiB vs budget {budget:.0f} MiB "
                     f"({t} x unit_budget + outputs + {ALLOWANCE_MIB} MiB)", peak <= budget, "within"))  # fmt: skip
    for text, good, target_text in verdicts:
        print(f"   {text} (target {target_text}): {'ok' if good else 'MISSED'}")
    return all(good for _, good, _ in verdicts)

if __name__ == "__main__":
    sys.exit(main())

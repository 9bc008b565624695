"""Benchmark: the fp64 reference against aiter's own torch reference and this machine's limits.

The capture: 64 requests x 16 heads x 2k-4k tokens, bf16, page size 1, shuffled slots, D = 576
(Kimi-K2 / DeepSeek-V3). Per --threads count one fresh process measures the first call's peak
memory (the reference's, then aiter's) and aiter's error; then one more process times everything
at every thread count, interleaved:

    reference     refmla.reference.mla_decode_ref (fp64, blocked: refmla.blocked); its peak memory
                  on its first call, before anything else ran in the process
    aiter         aiter's own op_tests/test_mla.py::torch_mla_extend (+ ref_masked_attention), fp32
                  einsum, loaded at run time from the checkout --aiter-repo names (or $REFMLA_AITER_REPO:
                  tools/aiter_peer.py executes only those functions, never imports aiter, copies
                  nothing of it), called as aiter's tests call it for decode (qo_indptr = 0..B)
    ref_python    the same reference with its lockstep loop run as Python ($REFMLA_NO_TORCHSCRIPT)
                  instead of compiled by TorchScript: what releasing the GIL is worth
    peer_loop     the per-request fp64 loop peers write
    dgemm         the limit on compute: a square fp64 GEMM (N = --gemm-n), torch's threads
    gather        the limit on memory: every attended row gathered as stored and upcast to
                  fp64, in blocks of 64k rows into one reused buffer, torch's threads
    floor         the limit of the reference's shape: its own work and nothing else, in the
                  units refmla.blocked plans, on the same worker threads (run_units) - per
                  lockstep step the rows' blocks of BLOCK_ROWS gathered at once and upcast into
                  a reused buffer, then the two fp64 bmm [H, D] x [D, n] and [H, n] x [n, Dv]
                  (no softmax, no merge; a last partial block alone); and those GEMMs alone on
                  one in-cache block, for their rate (M = H = 16 rows: a skinny GEMM runs well
                  below a square one)

reference, ref_python, aiter, peer_loop and the floor are timed in that one process, best of --repeat rounds, a round
running each of them at each thread count (after one untimed call each per count): the ratios
between formulations and between thread counts come from the same minutes, so a shared machine's
drift (the same 1-thread call measured 0.27 s and 0.35 s ten minutes apart on the CI-class VM)
moves both sides of each ratio alike. aiter's output is checked against the reference (bf16
rounding) in the memory process.

    flops  = sum_b 2 * H * L_b * D  (q.k)  +  2 * H * L_b * Dv  (p.v)
    bytes  = sum_b L_b * D * itemsize      (the attended rows as stored, read once)

Targets (exit 1 when one is missed, 0 when all that were measured hold): reference / aiter <= 1.2
at 1 thread and <= 0.8 at 2; the reference 1.7x faster at 2 threads than at 1; the reference at
>= 60 % of the limit that bounds it (the largest of flops / dgemm rate, the gather time and the
floor); reference / peer_loop <= 1.0; its peak memory (RSS above the opened, pre-read capture)
within its stated budget: threads x refmla.blocked.unit_budget + COMPILE_BYTES (the first call
in a process compiles the lockstep loop) + the outputs + 16 MiB. Without an
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
from refmla.blocked import BLOCK_ROWS, COMPILE_BYTES, NO_TORCHSCRIPT, long_batch, plan, run_units, unit_budget  # noqa: E402
from refmla.capture import read_capture, write_capture  # noqa: E402
from refmla.reference import mla_decode_ref  # noqa: E402
from refmla.scales import Scales  # noqa: E402
from refmla.synthetic import SynthSpec, make_inputs, make_meta  # noqa: E402

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


def floor(q, kv_buffer, kv_indptr, kv_indices, kv_lora_rank: int):
    """The reference's irreducible work (module docstring: floor) as a function of no arguments: the
    units refmla.blocked plans for this batch on torch's threads (lockstep rows, longest first), per
    step one gather of the whole blocks, one upcast and the two bmm; a last partial block alone."""
    pool, H, D, Dv, n = kv_buffer[:, 0], q.shape[1], kv_buffer.shape[-1], kv_lora_rank, BLOCK_ROWS
    lens = kv_indptr[1:] - kv_indptr[:-1]
    k = long_batch(H, D, Dv, kv_buffer.dtype.itemsize)
    local = threading.local()

    def unit(u) -> None:
        rows = u[1].tolist()
        if not hasattr(local, "bufs"):
            local.bufs = (pool.new_empty(k * n, D), torch.empty(k * n, D, dtype=torch.float64),
                          torch.rand(k, H, n, dtype=torch.float64))  # fmt: skip
        stored, up, p = local.bufs  # p stands for the probabilities: [k, H, n]
        qs = q[rows].double()  # [w, H, D]
        spans = [kv_indices[int(kv_indptr[b]) : int(kv_indptr[b + 1])].long() for b in rows]
        for j in range(len(spans[0]) // n):
            w = sum(len(x) // n > j for x in spans)
            idx = torch.cat([x[j * n : (j + 1) * n] for x in spans[:w]])
            torch.index_select(pool, 0, idx, out=stored[: w * n])
            kv = up[: w * n].copy_(stored[: w * n]).view(w, n, D)
            torch.bmm(qs[:w], kv.transpose(1, 2))  # [w, H, n]
            torch.bmm(p[:w], kv[..., :Dv])  # [w, H, Dv]
        for i, x in enumerate(spans):
            r = len(x) % n
            if r:
                torch.index_select(pool, 0, x[len(x) - r :], out=stored[:r])
                kv = up[:r].copy_(stored[:r])
                qs[i] @ kv.T
                p[0, :, :r] @ kv[:, :Dv]

    def run() -> None:
        run_units(unit, list(plan(lens, H, D, Dv, 8, k, torch.get_num_threads())))  # short rows: one at a time

    return run


def probe_gemm_block(q, kv_lora_rank: int) -> float:
    """Seconds of one block's two GEMMs [H, D] x [D, n] and [H, n] x [n, Dv] on one in-cache block, on
    one thread as a worker runs them (the skinny-GEMM rate: M = H = 16 rows run well below a square
    GEMM)."""
    H, D = q.shape[1], q.shape[2]
    kv, qb, p = torch.randn(BLOCK_ROWS, D, dtype=torch.float64), q[0].double(), torch.rand(H, BLOCK_ROWS, dtype=torch.float64)

    def gemms() -> None:
        for _ in range(256):
            qb @ kv.T
            p @ kv[:, :kv_lora_rank]

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return min(_seconds(gemms) for _ in range(3)) / 256
    finally:
        torch.set_num_threads(before)


def reference(q, kv_buffer, kv_indptr, kv_indices, *, kv_lora_rank, sm_scale):
    """refmla's: the token-index metadata described once (Attended), the fp64 reference over it."""
    att = Attended.token_index(kv_indptr, kv_indices)
    return mla_decode_ref(q, kv_buffer, att, Scales(kv_lora_rank=kv_lora_rank, sm_scale=sm_scale))


def reference_python(*args, **kw):
    """The reference with its lockstep loop run as Python ($REFMLA_NO_TORCHSCRIPT), not compiled."""
    os.environ[NO_TORCHSCRIPT] = "1"
    try:
        return reference(*args, **kw)
    finally:
        del os.environ[NO_TORCHSCRIPT]


def _seconds(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def run_memory(path: str, threads: int, aiter_repo: str | None) -> dict:
    """In this (fresh) process, at ``threads``: open the capture, read its pool once, then the
    reference's peak on its first call (before anything else ran here) and aiter's, and aiter's
    error against the reference."""
    torch.set_num_threads(threads)
    cap = read_capture(path)
    kv, m = cap.kv_buffer, cap.meta
    float(kv[:, 0, :1].float().sum())  # page the pool in: its file pages are the capture, not the work
    args, kw = (cap.q, kv, cap.kv_indptr, cap.kv_indices), dict(kv_lora_rank=m.kv_lora_rank, sm_scale=m.sm_scale)
    r: dict = {"peak_above_open_mib": {}}
    _reset_peak()
    base = _status_kib("VmRSS")
    want, _ = reference(*args, **kw)  # the first call: this process image's peak (ru_maxrss would include the parent's)
    r["peak_above_open_mib"]["reference"] = (_status_kib("VmHWM") - base) / 1024
    if aiter_repo:
        peer = load_aiter_peer(aiter_repo)
        _reset_peak()
        base = _status_kib("VmRSS")
        got, _ = peer.decode(*args, **kw)
        r["peak_above_open_mib"]["aiter"] = (_status_kib("VmHWM") - base) / 1024
        r["aiter_error"] = float((got.double() - want).abs().max() / want.abs().max())
    return r


def run_timing(path: str, threads: list[int], repeat: int, gemm_n: int, aiter_repo: str | None) -> dict:
    """In this (fresh) process: the probes at each thread count, then the formulations' times, every
    formulation at every thread count in each of ``repeat`` rounds (interleaved: a machine whose speed
    drifts over minutes, as a shared VM's does, moves all of them alike, so the ratios between
    formulations and between thread counts stay side by side); best of the rounds."""
    cap = read_capture(path)
    kv, m = cap.kv_buffer, cap.meta
    float(kv[:, 0, :1].float().sum())
    args, kw = (cap.q, kv, cap.kv_indptr, cap.kv_indices), dict(kv_lora_rank=m.kv_lora_rank, sm_scale=m.sm_scale)
    formulations = {"reference": reference, "ref_python": reference_python, "peer_loop": peer_loop}
    if aiter_repo:
        formulations["aiter"] = load_aiter_peer(aiter_repo).decode
    floor_run = floor(*args, m.kv_lora_rank)
    formulations["floor"] = lambda *a, **k: floor_run()
    out: dict = {t: {"load": [os.getloadavg()[0]]} for t in threads}
    for t in threads:
        torch.set_num_threads(t)
        for fn in formulations.values():
            fn(*args, **kw)  # warm at this thread count
        r = out[t]
        r["dgemm"] = probe_dgemm(gemm_n)
        r["gather"] = probe_gather(kv, cap.kv_indices)
        r["gemm_block"] = probe_gemm_block(cap.q, m.kv_lora_rank)
    times: dict[tuple[int, str], list[float]] = {}
    for _ in range(repeat):
        for t in threads:
            torch.set_num_threads(t)
            for name, fn in formulations.items():
                times.setdefault((t, name), []).append(_seconds(lambda: fn(*args, **kw)))
    for t in threads:
        out[t]["load"].append(os.getloadavg()[0])
        out[t]["times"] = {name: min(times[(t, name)]) for name in formulations if name != "floor"}
        out[t]["floor"] = min(times[(t, "floor")])
    return out


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
    ap.add_argument("--memory", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    threads = [int(t) for t in args.threads.split(",")]
    if args.child and args.memory:
        print(json.dumps(run_memory(args.child, threads[0], args.aiter_repo)))
        return 0
    if args.child:
        print(json.dumps(run_timing(args.child, threads, args.repeat, args.gemm_n, args.aiter_repo)))
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
        child = [sys.executable, __file__, "--child", path, "--repeat", str(args.repeat), "--gemm-n", str(args.gemm_n),
                 *(["--aiter-repo", args.aiter_repo] if args.aiter_repo else [])]  # fmt: skip
        for t in threads:  # a fresh process per thread count: a first call's peak
            results[t] = json.loads(subprocess.check_output([*child, "--memory", "--threads", str(t)]))
        timed = json.loads(subprocess.check_output([*child, "--threads", args.threads]))  # all counts, interleaved
        for t in threads:
            results[t].update(timed[str(t)])
    H, D, Dv = args.heads, spec.head_dim, spec.kv_lora_rank
    shape = Shape(H, D, Dv, spec.kv_dtype.itemsize, sum(2 * H * L * D + 2 * H * L * Dv for L in lens),
                  sum(lens) * D * spec.kv_dtype.itemsize, args.requests * H * (Dv + 1) * 8 / 2**20)  # fmt: skip
    ok = all([report(t, results[t], shape, args.gemm_n) for t in threads])
    if 1 in results and 2 in results:
        gain = results[1]["times"]["reference"] / results[2]["times"]["reference"]
        good = gain >= TARGET_SCALING
        plain = results[1]["times"]["ref_python"] / results[2]["times"]["ref_python"]
        print(f"-- reference 2 threads vs 1: {gain:.2f}x (target >= {TARGET_SCALING}): {'ok' if good else 'MISSED'} "
              f"(its lockstep loop as Python: {plain:.2f}x)")  # fmt: skip
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
    budget = (t * unit_budget(x.H, x.D, x.Dv, x.itemsize) + COMPILE_BYTES) / 2**20 + x.out_mib + ALLOWANCE_MIB
    peak = mem["reference"]
    verdicts.append((f"reference peak +{peak:.0f} MiB vs budget {budget:.0f} MiB "
                     f"({t} x unit_budget + the loop's compile + outputs + {ALLOWANCE_MIB} MiB)", peak <= budget, "within"))  # fmt: skip
    for text, good, target_text in verdicts:
        print(f"   {text} (target {target_text}): {'ok' if good else 'MISSED'}")
    return all(good for _, good, _ in verdicts)

if __name__ == "__main__":
    sys.exit(main())

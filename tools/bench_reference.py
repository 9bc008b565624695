"""Benchmark: the fp64 reference against this machine's limits and the peers users would pick instead.

In one run, interleaved, best of --repeat, at each --threads count (each measurement in a fresh
process that reads the same capture: 64 requests x 16 heads x 2k-4k tokens, bf16, page size 1,
shuffled slots):

    reference         refmla.reference.mla_decode_ref (fp64, blocked: refmla.blocked)
    peer_loop         the per-request fp64 loop peers write
    peer_fp32_einsum  aiter's fp32 torch reference for MLA decode, written as aiter writes it
                      (op_tests/test_mla.py: torch_mla_extend + ref_masked_attention)
    dgemm             the limit on compute: a square fp64 GEMM (N = --gemm-n), torch's threads
    gather            the limit on memory: every attended row gathered as stored and upcast to
                      fp64, in blocks of 64k rows into one reused buffer, torch's threads
    floor             the limit of the reference's shape: its own work and nothing else, on the
                      same worker threads (refmla.blocked.run_units) - every block of BLOCK_ROWS
                      rows gathered and upcast into a reused buffer, then its two fp64 GEMMs
                      [H, D] x [D, n] and [H, n] x [n, Dv] (no softmax, no merge); and those GEMMs
                      alone on one in-cache block, for their rate (M = H = 16 rows: a skinny GEMM
                      runs well below a square one)

    flops  = sum_b 2 * H * L_b * D  (q.k)  +  2 * H * L_b * Dv  (p.v)
    bytes  = sum_b L_b * D * itemsize      (the attended rows as stored, read once)

Targets (exit 1 when one is missed, 0 when all hold): the reference at >= 60 % of the limit that
bounds it (the largest of flops / dgemm rate, the gather time and the floor), at most 0.8x peer_fp32_einsum at 2
threads and 1.2x at 1 thread, and its peak memory (RSS above the opened, pre-read capture) within
its stated budget: threads x refmla.blocked.unit_budget + the outputs + a 16 MiB runtime allowance.

    python tools/bench_reference.py [--repeat 3] [--threads 1,2] [--requests 64] [--heads 16]

Other helpers share a 2-core machine: every figure is printed with the 1-minute load average
taken around its runs; a loaded machine makes the absolute times (and the fraction of the limits)
pessimistic.
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

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from refmla.attended import Attended  # noqa: E402
from refmla.blocked import BLOCK_ROWS, run_units, unit_budget  # noqa: E402
from refmla.capture import read_capture, write_capture  # noqa: E402
from refmla.reference import mla_decode_ref  # noqa: E402
from refmla.scales import Scales  # noqa: E402
from refmla.synth import SynthSpec, make_inputs, make_meta  # noqa: E402

ALLOWANCE_MIB = 16  # interpreter, thread stacks and BLAS scratch besides the reference's own buffers
TARGET_FRACTION, TARGET_PEER = 0.6, {1: 1.2, 2: 0.8}


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


def peer_masked_attention(q, k, v, scale, dtype):
    """aiter's ref_masked_attention: fp32 einsum, a causal bias in q's dtype, lse, softmax, einsum."""
    w = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * scale  # [H, n, L]
    n_q, n_k = q.shape[0], k.shape[0]
    bias = torch.zeros(n_q, n_k, dtype=q.dtype)  # [n, L]
    keep = torch.ones(n_q, n_k, dtype=torch.bool).tril(diagonal=n_k - n_q)
    bias.masked_fill_(keep.logical_not(), float("-inf"))
    w += bias
    lse = w.logsumexp(dim=-1)  # [H, n]
    w = torch.softmax(w, dim=-1)
    out = torch.einsum("hqk,khd->qhd", w.float(), v.float())  # [n, H, Dv]
    return out.to(dtype), lse


def peer_fp32_einsum(q, kv_buffer, kv_indptr, kv_indices, *, kv_lora_rank, sm_scale):
    """aiter's torch_mla_extend for decode (qo_indptr = 0..B): split q per request, gather every
    attended row at once as stored, split them per request, split each into V and the rope part."""
    qo_indptr = torch.arange(q.shape[0] + 1)
    qs = torch.tensor_split(q, qo_indptr.tolist()[1:])  # B x [1, H, D]
    kvc = torch.index_select(kv_buffer, 0, kv_indices.long())  # [nnz, 1, D] as stored
    kvs = torch.tensor_split(kvc, kv_indptr.tolist()[1:])
    outs, lses = [], []
    for b in range(q.shape[0]):
        v, _ = torch.split(kvs[b], [kv_lora_rank, kv_buffer.shape[-1] - kv_lora_rank], dim=-1)
        o, lse = peer_masked_attention(qs[b], kvs[b], v, sm_scale, torch.bfloat16)
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses, dim=1).transpose(0, 1)  # [B, H, Dv], [B, H]


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
    return {"seconds": total, "gemm_block_seconds": with_one, "blocks": blocks}


def reference(q, kv_buffer, kv_indptr, kv_indices, *, kv_lora_rank, sm_scale):
    """refmla's: the token-index metadata described once (Attended), the fp64 reference over it."""
    att = Attended.token_index(kv_indptr, kv_indices)
    return mla_decode_ref(q, kv_buffer, att, Scales(kv_lora_rank=kv_lora_rank, sm_scale=sm_scale))


FORMULATIONS = {"reference": reference, "peer_loop": peer_loop, "peer_fp32_einsum": peer_fp32_einsum}
PROBES = ("dgemm", "gather", "floor")


def _seconds(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def run_one(path: str, name: str, threads: int, gemm_n: int) -> dict:
    """In this (fresh) process: open the capture, read its pool once, run one formulation or probe."""
    torch.set_num_threads(threads)
    cap = read_capture(path)
    kv = cap.kv_buffer
    float(kv[:, 0, :1].float().sum())  # page the pool in: its file pages are the capture, not the work
    _reset_peak()
    base = _status_kib("VmRSS")
    if name == "dgemm":
        return {"seconds": probe_dgemm(gemm_n)}
    if name == "gather":
        return {"seconds": probe_gather(kv, cap.kv_indices)}
    if name == "floor":
        return probe_floor(cap.q, kv, cap.kv_indptr, cap.kv_indices, cap.meta.kv_lora_rank)
    t0 = time.perf_counter()
    out, _ = FORMULATIONS[name](cap.q, kv, cap.kv_indptr, cap.kv_indices,
                                kv_lora_rank=cap.meta.kv_lora_rank, sm_scale=cap.meta.sm_scale)  # fmt: skip
    dt = time.perf_counter() - t0
    peak = _status_kib("VmHWM")  # this process image's peak (ru_maxrss would include the parent's, from fork)
    return {"seconds": dt, "peak_above_open_mib": (peak - base) / 1024, "checksum": float(out.double().sum())}


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


def measure(path: str, threads: list[int], repeat: int, gemm_n: int) -> tuple[dict, dict, list[float]]:
    """Best time and worst peak per (name, threads), every child run interleaved; load averages seen."""
    times, mem, loads = {}, {}, []
    for _ in range(repeat):
        for t in threads:
            for name in (*PROBES, *FORMULATIONS):
                loads.append(os.getloadavg()[0])
                cmd = [sys.executable, __file__, "--child", path, name, "--threads", str(t), "--gemm-n", str(gemm_n)]
                r = json.loads(subprocess.check_output(cmd))
                times.setdefault((name, t), []).append(r["seconds"])
                if "gemm_block_seconds" in r:  # the floor's skinny-GEMM rate: flops of one block's two GEMMs
                    times.setdefault(("gemm_block", t), []).append(r["gemm_block_seconds"])
                if "peak_above_open_mib" in r:
                    mem[(name, t)] = max(mem.get((name, t), 0.0), r["peak_above_open_mib"])
    return {k: min(v) for k, v in times.items()}, mem, loads


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--min-len", type=int, default=2048)
    ap.add_argument("--max-len", type=int, default=4096)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts, each measured (default 1,2)")
    ap.add_argument("--gemm-n", type=int, default=2048, help="square dgemm size of the compute probe")
    ap.add_argument("--child", nargs=2, metavar=("PATH", "NAME"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(run_one(*args.child, int(args.threads), args.gemm_n)))
        return 0
    threads = [int(t) for t in args.threads.split(",")]
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(args.min_len, args.max_len + 1, (args.requests,), generator=g).tolist()
    spec = SynthSpec(name="bench", num_heads=args.heads, seq_lens=tuple(lens), free_pages=0)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "bench.safetensors")
        write_capture(path, make_inputs(spec), make_meta(spec), compact=False)
        size_mib = os.path.getsize(path) / 2**20
        print(f"capture: {args.requests} requests x {args.heads} heads x {args.min_len}-{args.max_len} tokens, "
              f"bf16, {size_mib:.0f} MiB; torch {torch.__version__}, best of {args.repeat}, interleaved")  # fmt: skip
        print(f"1-min load average before: {os.getloadavg()[0]:.2f} ({os.cpu_count()} CPUs)")
        times, mem, loads = measure(path, threads, args.repeat, args.gemm_n)
    H, D, Dv = args.heads, spec.head_dim, spec.kv_lora_rank
    flops = sum(2 * H * L * D + 2 * H * L * Dv for L in lens)
    row_bytes = sum(lens) * D * spec.kv_dtype.itemsize
    out_mib = args.requests * H * (Dv + 1) * 8 / 2**20
    print(f"1-min load average during: {min(loads):.2f}-{max(loads):.2f}, after: {os.getloadavg()[0]:.2f}")
    ok = True
    for t in threads:
        ok &= report(t, times, mem, flops, row_bytes, args.gemm_n, H, D, Dv, spec.kv_dtype.itemsize, out_mib)
    print("all targets met" if ok else "TARGET MISSED")
    return 0 if ok else 1


def report(t, times, mem, flops, row_bytes, gemm_n, H, D, Dv, isz, out_mib) -> bool:
    """Print one thread count's figures and verdicts; True when its targets hold."""
    peak_rate = 2 * gemm_n**3 / times[("dgemm", t)]  # flop/s
    gather_t = times[("gather", t)]
    ref_t = times[("reference", t)]
    print(f"-- {t} thread(s): dgemm {peak_rate / 1e9:.1f} GFLOP/s fp64 (n = {gemm_n}), "
          f"gather {row_bytes / gather_t / 1e9:.2f} GB/s ({gather_t:.3f} s for {row_bytes / 2**20:.0f} MiB as stored)")  # fmt: skip
    for name in FORMULATIONS:
        s, prec = times[(name, t)], "fp32" if "fp32" in name else "fp64"
        print(f"   {name:<16} {s:7.3f} s  {flops / s / 1e9:6.2f} GFLOP/s {prec}  peak +{mem[(name, t)]:.0f} MiB")
    compute_t, floor_t = flops / peak_rate, times[("floor", t)]
    skinny_rate = (2 * H * BLOCK_ROWS * D + 2 * H * BLOCK_ROWS * Dv) / times[("gemm_block", t)]  # one thread's BLAS
    print(f"   floor            {floor_t:7.3f} s  (the reference's gathers and GEMMs alone; its GEMMs at "
          f"[{H}, {D}] x [{D}, {BLOCK_ROWS}]: {skinny_rate / 1e9:.1f} GFLOP/s per thread = "
          f"{skinny_rate * t / peak_rate:.0%} of the square dgemm)")  # fmt: skip
    bound, which = max((compute_t, "fp64 peak"), (gather_t, "gather"), (floor_t, "floor"))
    frac = bound / ref_t
    verdicts = [(f"reference at {frac:.0%} of the {which} bound ({compute_t / ref_t:.0%} of the fp64 peak, "
                 f"{gather_t / ref_t:.0%} of the gather time, {floor_t / ref_t:.0%} of the floor)",
                 frac >= TARGET_FRACTION, f">= {TARGET_FRACTION:.0%}")]  # fmt: skip
    ratio = ref_t / times[("peer_fp32_einsum", t)]
    target = TARGET_PEER.get(t, TARGET_PEER[2])
    verdicts.append((f"ratio reference / peer_fp32_einsum = {ratio:.3f}", ratio <= target, f"<= {target}"))
    loop = ref_t / times[("peer_loop", t)]
    verdicts.append((f"ratio reference / peer_loop = {loop:.3f}", loop <= 1.0, "<= 1.0"))
    budget = t * unit_budget(H, D, Dv, isz) / 2**20 + out_mib + ALLOWANCE_MIB
    peak = mem[("reference", t)]
    verdicts.append((f"reference peak +{peak:.0f} MiB vs budget {budget:.0f} MiB "
                     f"({t} x unit_budget + outputs + {ALLOWANCE_MIB} MiB)", peak <= budget, "within"))  # fmt: skip
    for text, good, target_text in verdicts:
        print(f"   {text} (target {target_text}): {'ok' if good else 'MISSED'}")
    return all(good for _, good, _ in verdicts)


if __name__ == "__main__":
    sys.exit(main())

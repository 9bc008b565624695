"""Benchmark: the fp64 reference vs the two peers users would pick instead, side by side in one run.

Peers: ``peer_loop``, the per-request fp64 loop peers write; ``peer_fp32_einsum``, aiter's own
fp32 torch reference for MLA decode (op_tests/test_mla.py, torch_mla_extend), written the same way.

    python tools/bench_reference.py [--requests 64] [--heads 16] [--min-len 2048] [--max-len 4096] [--threads N]

All read the same capture file (64 requests x 16 heads x 2k-4k tokens, bf16, page size 1,
shuffled slots). Time: best of --repeat runs each, alternating. Memory: each formulation runs
in a fresh subprocess; its peak RSS above the RSS right after opening the capture must stay
under the capture size plus twice the largest single request's working set
(its gathered rows as stored and in fp64 + the [H, L] logits and probabilities + the [H, Dv] output).

FLOPs per formulation: 2 * H * L * D (q.k) + 2 * H * L * Dv (p.v) per request (fp64; fp32 for
peer_fp32_einsum).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from refmla.capture import read_capture  # noqa: E402
from refmla.reference import mla_decode_ref  # noqa: E402
from refmla.synth import SynthSpec, make_inputs, make_meta  # noqa: E402


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


def peer_fp32_einsum(q, kv_buffer, kv_indptr, kv_indices, *, kv_lora_rank, sm_scale):
    """fp32, as aiter's own torch reference computes decode (op_tests/test_mla.py, torch_mla_extend):
    gather every request's rows at once as stored, split them per request, then per request an fp32
    einsum with the causal bias (all zero for one query token), LSE, softmax, einsum with V."""
    rows = kv_buffer.index_select(0, kv_indices.long())  # [nnz, 1, D] as stored
    per_request = torch.tensor_split(rows, kv_indptr[1:-1].tolist())  # B x [L, 1, D]
    queries = torch.tensor_split(q, q.shape[0])  # B x [1, H, D]: one new token per request
    outs, lses = [], []
    for qb, kv in zip(queries, per_request):
        v = kv[..., :kv_lora_rank]  # [L, 1, Dv]
        s = torch.einsum("qhd,khd->hqk", qb.float(), kv.float()) * sm_scale  # [H, 1, L]
        n_q, n_k = qb.shape[0], kv.shape[0]
        keep = torch.ones(n_q, n_k, dtype=torch.bool).tril(diagonal=n_k - n_q)  # [1, L] causal
        s += torch.zeros(n_q, n_k, dtype=qb.dtype).masked_fill(~keep, float("-inf"))  # [H, 1, L]
        lses.append(s.logsumexp(dim=-1))  # [H, 1]
        p = torch.softmax(s, dim=-1)  # [H, 1, L]
        outs.append(torch.einsum("hqk,khd->qhd", p.float(), v.float()).to(q.dtype))  # [1, H, Dv]
    return torch.cat(outs), torch.cat(lses, dim=1).T  # [B, H, Dv], [B, H]


FORMULATIONS = {"reference": mla_decode_ref, "peer_loop": peer_loop, "peer_fp32_einsum": peer_fp32_einsum}


def run_one(path: str, name: str, threads: int) -> dict:
    """In this (fresh) process: open the capture, run one formulation, report time and memory."""
    if threads:
        torch.set_num_threads(threads)
    cap = read_capture(path)
    _reset_peak()
    base = _status_kib("VmRSS")
    t0 = time.perf_counter()
    out, lse = FORMULATIONS[name](cap.q, cap.kv_buffer, cap.kv_indptr, cap.kv_indices,
                                  kv_lora_rank=cap.meta.kv_lora_rank, sm_scale=cap.meta.sm_scale)  # fmt: skip
    dt = time.perf_counter() - t0
    peak = _status_kib("VmHWM")  # this process image's peak (ru_maxrss would include the parent's, from fork)
    return {"seconds": dt, "peak_above_open_mib": (peak - base) / 1024, "checksum": float(out.sum())}


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--min-len", type=int, default=2048)
    ap.add_argument("--max-len", type=int, default=4096)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads in each run (0: torch's default)")
    ap.add_argument("--child", nargs=2, metavar=("PATH", "NAME"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(run_one(*args.child, args.threads)))
        return

    g = torch.Generator().manual_seed(0)
    lens = torch.randint(args.min_len, args.max_len + 1, (args.requests,), generator=g).tolist()
    spec = SynthSpec(name="bench", num_heads=args.heads, seq_lens=tuple(lens), free_pages=0)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "bench.safetensors")
        from refmla.capture import write_capture

        t = make_inputs(spec)
        write_capture(path, t, make_meta(spec), compact=False)
        size_mib = os.path.getsize(path) / 2**20
        L, H, D, Dv = max(lens), args.heads, spec.head_dim, spec.kv_lora_rank
        # rows as stored (bf16) + the same rows in fp64 + logits and probabilities + output
        ws_mib = (L * D * (2 + 8) + 2 * H * L * 8 + H * Dv * 8) / 2**20
        times = {n: [] for n in FORMULATIONS}
        mem = {}
        for _ in range(args.repeat):
            for name in FORMULATIONS:
                cmd = [sys.executable, __file__, "--child", path, name, "--threads", str(args.threads)]
                r = json.loads(subprocess.check_output(cmd))
                times[name].append(r["seconds"])
                mem[name] = max(mem.get(name, 0.0), r["peak_above_open_mib"])
        flops = sum(2 * H * l * D + 2 * H * l * Dv for l in lens)
        print(f"capture: {args.requests} requests x {H} heads x {args.min_len}-{args.max_len} tokens, "
              f"bf16, {size_mib:.0f} MiB; largest request working set {ws_mib:.1f} MiB")  # fmt: skip
        threads = args.threads or torch.get_num_threads()
        print(f"torch {torch.__version__}, {threads} threads, best of {args.repeat}, 1-min load average {os.getloadavg()[0]:.1f}")
        for name in FORMULATIONS:
            t, prec = min(times[name]), "fp32" if "fp32" in name else "fp64"
            print(f"  {name:<16} {t:7.3f} s  {flops / t / 1e9:6.2f} GFLOP/s {prec}  peak +{mem[name]:.0f} MiB")
        ref_t = min(times["reference"])
        for peer, target in (("peer_loop", 1.0), ("peer_fp32_einsum", 0.8)):
            ratio = ref_t / min(times[peer])
            print(f"ratio reference / {peer:<16} = {ratio:.3f} (target <= {target}): "
                  f"{'ok' if ratio <= target else 'OVER'}")  # fmt: skip
        budget = size_mib + 2 * ws_mib
        print(f"reference peak +{mem['reference']:.0f} MiB vs budget {budget:.0f} MiB "
              f"(capture + 2 x working set): {'ok' if mem['reference'] <= budget else 'OVER'}")  # fmt: skip


if __name__ == "__main__":
    main()

"""The blocked reference (refmla.blocked): the dense formulation's numbers, a memory budget that holds
whatever the index pattern, many short requests batched, and results independent of the batching
and the thread count."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from helpers import MEASURE_ENV, ROOT, measure_control, paged_case
from refmla import blocked
from refmla import reference as ref
from refmla.attended import Attended
from refmla.control import mla_control
from refmla.scales import Scales
from refmla.schedule import split_bounds

SCALE = 0.1309
# lengths on both sides of one block and of several, and the empty request
LENGTHS = [0, 1, 2, 31, blocked.BLOCK_ROWS - 1, blocked.BLOCK_ROWS, blocked.BLOCK_ROWS + 1, 3 * blocked.BLOCK_ROWS + 7, 1300]


def decode(q, kv, indptr, idx, **scales):
    """refmla.reference.mla_decode_ref of SGLang's token-index metadata."""
    return ref.mla_decode_ref(q, kv, Attended.token_index(indptr, idx), Scales(kv_lora_rank=512, sm_scale=SCALE, **scales))


def dense(q, kv, indptr, idx, Dv, sm_scale, logit_cap=0.0, k_scale=1.0, v_scale=1.0):
    """This test's own formulation: the whole request at once in fp64, plus the condition scale
    sum_j p_j |v_j| of each (request, head) that an fp64 rounding error is relative to."""
    B, H, _ = q.shape
    out, scale = torch.zeros(B, H, Dv, dtype=torch.float64), torch.zeros(B, H, Dv, dtype=torch.float64)
    lse = torch.full((B, H), -math.inf, dtype=torch.float64)
    for b in range(B):
        rows = idx[int(indptr[b]) : int(indptr[b + 1])].long()
        if len(rows):
            K = kv[rows, 0].double()  # [L, D]
            s = torch.einsum("hd,ld->hl", q[b].double(), K) * (sm_scale * k_scale)  # [H, L]
            if logit_cap > 0:
                s = logit_cap * torch.tanh(s / logit_cap)
            p = torch.softmax(s, dim=-1)  # [H, L]
            out[b], scale[b] = p @ K[:, :Dv] * v_scale, p @ K[:, :Dv].abs() * v_scale
            lse[b] = torch.logsumexp(s, dim=-1)
    return out, lse, scale


def assert_fp64_close(out, lse, want, want_lse, scale, rel=1e-14):
    assert torch.equal(torch.isfinite(lse), torch.isfinite(want_lse))
    err = ((out - want).abs() / scale.clamp(min=1e-300)).max()
    assert err <= rel, f"out off by {float(err):.2e} of sum p|v| (allowed {rel})"
    fin = torch.isfinite(want_lse)
    lerr = ((lse - want_lse)[fin].abs() / want_lse[fin].abs().clamp(min=1.0)).max()
    assert lerr <= rel, f"lse off by {float(lerr):.2e} relative"


@pytest.mark.parametrize("heads", [1, 16, 128])
@pytest.mark.parametrize("page_size", [1, 64])
def test_decode_matches_the_dense_formulation_to_fp64_rounding(heads, page_size):
    q, kv, indptr, idx = paged_case(LENGTHS, heads, page_size, seed=heads + page_size)
    out, lse = decode(q, kv, indptr, idx)
    assert torch.isfinite(out).all(), "NaN from unattended pool rows leaked into the output"
    assert_fp64_close(out, lse, *dense(q, kv, indptr, idx, 512, SCALE))


@pytest.mark.parametrize("logit_cap,k_scale,v_scale", [(2.5, 1.0, 1.0), (0.0, 0.5, 0.25), (30.0, 2.0, 0.5)])
def test_caps_and_scales_in_every_block(logit_cap, k_scale, v_scale):
    q, kv, indptr, idx = paged_case([3 * blocked.BLOCK_ROWS + 5, 40], 8, 16, seed=7)
    q = q * 4  # logits large enough for a cap of 2.5 to bite, and for the running max to move
    kw = dict(logit_cap=logit_cap, k_scale=k_scale, v_scale=v_scale)
    out, lse = decode(q, kv, indptr, idx, **kw)
    assert_fp64_close(out, lse, *dense(q, kv, indptr, idx, 512, SCALE, logit_cap, k_scale, v_scale))


def test_the_running_max_rising_late_is_merged_exactly():
    """The largest logit in the last block: every earlier block is rescaled by exp(m - m')."""
    q, kv, indptr, idx = paged_case([4 * blocked.BLOCK_ROWS], 4, seed=3)
    last = idx[-1]
    kv[last, 0] = q[0, 0] * 3  # one row aligned with head 0's query, at the very end
    out, lse = decode(q, kv, indptr, idx)
    want, want_lse, scale = dense(q, kv, indptr, idx, 512, SCALE)
    assert float(torch.softmax(torch.einsum("d,ld->l", q[0, 0].double(), kv[idx, 0].double()) * SCALE, 0)[-1]) > 0.5
    assert_fp64_close(out, lse, want, want_lse, scale)


def test_a_row_is_the_same_alone_in_a_batch_and_at_any_thread_count():
    lens = [1, 7, 7, 7, 200, blocked.BLOCK_ROWS + 3, 7, 1300, 1, 1]
    q, kv, indptr, idx = paged_case(lens, 8, 16, seed=5)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = decode(q, kv, indptr, idx)
        torch.set_num_threads(2)
        two = decode(q, kv, indptr, idx)
        assert torch.get_num_threads() == 2, "the reference must leave torch's thread count as it found it"
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])
    for b in (0, 2, 4, 5):  # alone: a group of one, or a long row on its own
        sub = torch.tensor([0, lens[b]])
        alone = decode(q[b : b + 1], kv, sub, idx[int(indptr[b]) : int(indptr[b + 1])])
        assert torch.equal(alone[0][0], one[0][b]) and torch.equal(alone[1][0], one[1][b]), f"request {b}"


# long rows on both sides of whole blocks, of 2 to 12 blocks: in lockstep units their steps end apart
LOCKSTEP = [257, 3 * blocked.BLOCK_ROWS, 1300, 2 * blocked.BLOCK_ROWS + 1, 600, 1100, 511, 4 * blocked.BLOCK_ROWS,
            900, 1025, 700, 260, 800, 999, 3 * blocked.BLOCK_ROWS - 1, 300]  # fmt: skip


def test_long_rows_run_in_lockstep_units_longest_first_within_the_budget():
    H, D, Dv = 16, 576, 512
    k = blocked.long_batch(H, D, Dv, 2)
    block = blocked.BLOCK_ROWS * D * (2 + 8) + H * (blocked.BLOCK_ROWS + D + 2 * Dv + 4) * 8
    assert k >= 3 and k * block <= blocked.unit_budget(H, D, Dv, 2), "k blocks within one worker's budget"
    lens = torch.tensor(LOCKSTEP + [5, 5, 40])
    units = list(blocked.plan(lens, H, D, Dv, lockstep=k, workers=1))
    long = [rows for kind, rows in units if kind == "long"]
    assert [len(r) for r in long] == [k] * (len(LOCKSTEP) // k) + ([len(LOCKSTEP) % k] if len(LOCKSTEP) % k else [])
    order = torch.cat(long)
    assert torch.equal(lens[order], lens[: len(LOCKSTEP)].sort(descending=True, stable=True).values), "longest first"
    assert sorted(order.tolist()) == list(range(len(LOCKSTEP)))
    shrunk = [rows for kind, rows in blocked.plan(lens, H, D, Dv, lockstep=k, workers=2) if kind == "long"]
    assert len(shrunk) >= blocked.UNITS_PER_WORKER * 2, "enough units for every worker to share the tail"
    k2 = len(LOCKSTEP) // (blocked.UNITS_PER_WORKER * 2)  # lockstep shrunk so that each worker has 4 units
    assert [len(r) for r in shrunk] == [k2] * (len(LOCKSTEP) // k2 - 2) + [1] * (2 * k2), "the last 2 units: a row each"
    assert torch.equal(torch.cat(shrunk), order), "still longest first"
    assert [len(rows) for _, rows in blocked.plan(lens[:3], H, D, Dv, lockstep=k, workers=1)] == [1, 1, 1]


def test_a_long_row_in_lockstep_has_its_own_bits_alone_and_at_any_thread_count():
    """16 long rows: lockstep units of long_batch rows at 1 thread, single rows at 2 (too few to share);
    every row's out and lse bit-equal to it run alone, and to fp64 rounding of the dense formulation
    (a logit cap that bites, and a running max that moves: q scaled up)."""
    q, kv, indptr, idx = paged_case(LOCKSTEP, 4, 16, seed=11)
    q, logit_cap = q * 4, 2.5
    sc = Scales(kv_lora_rank=512, sm_scale=SCALE, logit_cap=logit_cap)
    before = torch.get_num_threads()
    try:
        runs = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            runs.append(ref.mla_decode_ref(q, kv, Attended.token_index(indptr, idx), sc))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
    for b in range(len(LOCKSTEP)):
        one = Attended.token_index(torch.tensor([0, LOCKSTEP[b]]), idx[int(indptr[b]) : int(indptr[b + 1])])
        alone = ref.mla_decode_ref(q[b : b + 1], kv, one, sc)
        assert torch.equal(alone[0][0], runs[0][0][b]) and torch.equal(alone[1][0], runs[0][1][b]), f"row {b}"
    assert_fp64_close(*runs[0], *dense(q, kv, indptr, idx, 512, SCALE, logit_cap))


def test_split_partials_in_lockstep_read_their_own_query_rows():
    """Split partials: the spans of several requests' splits, each with its query row (Spans.query),
    long enough to run in lockstep; every split equal to its request run alone."""
    lens, splits = [1300, 3000, 2100, 900], torch.tensor([3, 5, 6, 3])
    q, kv, indptr, idx = paged_case(lens, 4, 16, seed=12)
    sc = Scales(kv_lora_rank=512, sm_scale=SCALE)
    spans = torch.tensor([e - s for L, n in zip(lens, splits.tolist()) for s, e in split_bounds(L, n, 1)])
    assert max(len(r) for _, r in blocked.plan(spans, 4, 576, 512, lockstep=blocked.long_batch(4, 576, 512, 4))) > 1
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        parts, lses, _ = ref.mla_decode_split_ref(q, kv, Attended.token_index(indptr, idx), splits, sc, split_block=1)
    finally:
        torch.set_num_threads(before)
    for b in range(len(lens)):
        alone = Attended.token_index(torch.tensor([0, lens[b]]), idx[int(indptr[b]) : int(indptr[b + 1])])
        p1, l1, _ = ref.mla_decode_split_ref(q[b : b + 1], kv, alone, splits[b : b + 1], sc, split_block=1)
        S = p1.shape[2]
        assert torch.equal(p1[0], parts[b, :, :S]) and torch.equal(l1[0], lses[b, :, :S]), f"request {b}"


def test_split_partials_and_extend_go_through_the_same_core():
    lens = [blocked.BLOCK_ROWS * 2 + 9, 33]
    q, kv, indptr, idx = paged_case(lens, 4, 16, seed=9)
    splits = torch.tensor([1, 2])
    sc = Scales(kv_lora_rank=512, sm_scale=SCALE)
    parts, lses, valid = ref.mla_decode_split_ref(q, kv, Attended.token_index(indptr, idx), splits, sc)
    out, lse = ref.merge_splits(parts, lses, valid)
    assert_fp64_close(out, lse, *dense(q, kv, indptr, idx, 512, SCALE))
    qo = torch.tensor([0, 2, 3])  # request 0 has 2 new tokens: the first sees all but the last row
    qe = torch.cat([q[:1], q[:1] * 0.5, q[1:]])
    ext, ext_lse = ref.mla_verify_ref(qe, kv, Attended.token_index(indptr, idx, qo), sc)
    short = torch.tensor([0, lens[0] - 1])
    want, want_lse, scale = dense(qe[:1], kv, short, idx[: lens[0] - 1], 512, SCALE)
    assert_fp64_close(ext[:1], ext_lse[:1], want, want_lse, scale)


def test_many_short_requests_are_batched_not_looped():
    """3 x 10^4 requests of one row: a group per group_size rows (one bmm pair each), not a Python
    iteration per request, and the exact answer (one row: p = 1, out = v * v_scale, lse = the logit)."""
    B, H, D = 30_000, 2, 576
    g = torch.Generator().manual_seed(1)
    pool = torch.randn(1000, 1, D, generator=g).to(torch.bfloat16)
    idx = torch.randint(0, 1000, (B,), generator=g)
    q = torch.randn(B, H, D, generator=g).to(torch.bfloat16)
    indptr = torch.arange(B + 1)
    units = list(blocked.plan(indptr[1:] - indptr[:-1], H, D, 512))
    assert len(units) == math.ceil(B / blocked.group_size(1, H, D, 512)) <= B / 100, f"{len(units)} units"
    out, lse = decode(q, pool, indptr, idx, v_scale=0.5)
    assert torch.equal(out, pool[idx, 0, None, :512].double().expand(B, H, 512) * 0.5)
    want_lse = torch.einsum("bhd,bd->bh", q.double(), pool[idx, 0].double()) * SCALE
    assert ((lse - want_lse).abs() <= 1e-14 * want_lse.abs().clamp(min=1)).all()


HOSTILE = textwrap.dedent(
    """
    import json, math, sys, torch
    from refmla import blocked, reference as ref
    from refmla.attended import Attended
    from refmla.scales import Scales
    torch.set_num_threads(int(sys.argv[2]))
    L, R, H, D = int(sys.argv[1]), int(sys.argv[3]), 2, 576
    g = torch.Generator().manual_seed(0)
    pool = torch.randn(1, 1, D, generator=g).to(torch.bfloat16)  # a one-row pool
    q = torch.randn(1, H, D, generator=g).to(torch.bfloat16).expand(R, H, D).contiguous()
    idx = torch.zeros(L, dtype=torch.int32)  # every index at that row
    indptr = torch.linspace(0, L, R + 1).round().to(torch.int32)  # R rows of about L / R indices
    def kib(key):
        return int(next(l for l in open("/proc/self/status") if l.startswith(key + ":")).split()[1])
    open("/proc/self/clear_refs", "w").write("5")
    base = kib("VmRSS")
    out, lse = ref.mla_decode_ref(q, pool, Attended.token_index(indptr, idx), Scales(kv_lora_rank=512, sm_scale=0.1))
    peak = (kib("VmHWM") - base) * 1024
    v = pool[0, 0, :512].double()
    s = (q[0].double() @ pool[0, 0].double()) * 0.1
    want = s + torch.log((indptr[1:] - indptr[:-1]).double())[:, None]  # [R, H]
    budget = torch.get_num_threads() * blocked.unit_budget(H, D, 512, 2) + blocked.COMPILE_BYTES
    print(json.dumps({"peak": peak, "budget": budget,
                      "out_exact": bool(torch.equal(out, v.expand(R, H, 512))),
                      "lse_err": float(((lse - want).abs() / want.abs()).max())}))
    """
)


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc to measure the peak")
@pytest.mark.parametrize("threads,rows", [(1, 1), (2, 1), (2, 40)])
def test_a_million_indices_at_one_row_stay_within_the_budget(threads, rows):
    """The issue's capture scaled down (it had 4,000,000): 500,000 kv_indices all at the one row of a
    one-row pool, as one request or as 40 (run in lockstep, long_batch at a time). Gathering the
    sequence in fp64 would ask for 5e5 x 576 x 8 = 2.3 GB (18 GB for the issue's); blocked, the peak
    resident memory above the inputs stays within unit_budget per thread and the loop's one compile
    (COMPILE_BYTES: this is the process's first call) (+ 16 MiB for the
    interpreter and BLAS), and the answer is exact: every row equal, so out = v and lse = s + log(L)."""
    L = 500_000
    r = subprocess.run([sys.executable, "-c", HOSTILE, str(L), str(threads), str(rows)], capture_output=True,
                       text=True, cwd=ROOT, env=MEASURE_ENV, timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["peak"] <= got["budget"] + (16 << 20), f"peak {got['peak'] / 2**20:.1f} MiB > budget {got['budget'] / 2**20:.1f} MiB"
    assert got["out_exact"] and got["lse_err"] <= 1e-14, got


# --- the control: the same bounds -----------------------------------------------------------


def test_the_control_of_a_batch_is_each_requests_control_alone():
    """Short requests of one length run as one batch; every request's bits are its own."""
    lens = [1, 1, 1, 7, 7, 300, 1, 7]
    q, kv, indptr, idx = paged_case(lens, 8, 16, dtype=torch.bfloat16, seed=4)
    sc, bf16 = Scales(kv_lora_rank=512, sm_scale=SCALE), torch.bfloat16
    out, lse = mla_control(q, kv, Attended.token_index(indptr, idx), sc, bf16)
    for b in range(len(lens)):
        alone = Attended.token_index(torch.tensor([0, lens[b]]), idx[int(indptr[b]) : int(indptr[b + 1])])
        one, one_lse = mla_control(q[b : b + 1], kv, alone, sc, bf16)
        assert torch.equal(one[0], out[b]) and torch.equal(one_lse[0], lse[b]), f"request {b}"
    truth, _ = decode(q, kv, indptr, idx)
    err = (out.double() - truth).abs().max()
    assert 0 < err < 8 * torch.finfo(torch.bfloat16).eps * truth.abs().max(), "the control is rounding noise"


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc to measure the peak")
def test_the_control_of_half_a_million_indices_at_one_row_stays_within_its_budget():
    """As stored, 5e5 rows are 576 MB and 1.2 GB in fp32; the control gathers CONTROL_BLOCK_ROWS at
    a time. Every row equal: out = v to bf16 rounding."""
    got = measure_control(500000, 2)
    assert got["peak"] <= got["budget"] + (16 << 20), f"peak {got['peak'] / 2**20:.1f} MiB > budget {got['budget'] / 2**20:.1f} MiB"
    assert got["out_err"] <= 2 * torch.finfo(torch.bfloat16).eps, got


def _calls(fn) -> int:
    """The C functions fn calls from Python (each torch call takes the GIL: at 2 threads the workers
    take turns at it for every one of them)."""
    count = 0

    def prof(frame, event, arg):
        nonlocal count
        count += event == "c_call"

    sys.setprofile(prof)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return count


def test_a_lockstep_step_makes_the_same_calls_whatever_its_rows(monkeypatch):
    """Run as Python (where torch has no TorchScript): 12 rows of 8 whole blocks run as 4 lockstep
    units of 3; 4 such rows as 4 units of 1. The steps are as many, and a step's calls do not grow
    with its rows: the 12 rows cost at most a few calls per row more (laying out their indices),
    not a gather and a merge per row and block."""
    monkeypatch.setenv(blocked.NO_TORCHSCRIPT, "1")
    L, H = 8 * blocked.BLOCK_ROWS, 4
    q, kv, indptr, idx = paged_case([L] * 12, H, 16, seed=13)
    assert blocked.long_batch(H, 576, 512, 2) >= 3
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        units = [len(r) for _, r in blocked.plan(torch.full((12,), L), H, 576, 512, lockstep=3)]
        assert units == [3, 3, 3, 3]
        twelve = _calls(lambda: decode(q, kv, indptr, idx))
        four = _calls(lambda: decode(q[:4], kv, indptr[:5], idx[: 4 * L]))
    finally:
        torch.set_num_threads(before)
    assert four < twelve <= four + 4 * 12, f"12 rows in lockstep made {twelve} calls, 4 rows alone {four}"


@pytest.mark.parametrize("heads,logit_cap", [(1, 0.0), (4, 2.5), (8, 0.0), (16, 30.0)])
def test_the_compiled_lockstep_loop_has_the_plain_ones_bits(monkeypatch, heads, logit_cap):
    """The lockstep loop compiled by TorchScript (the default where torch has it: no GIL while a unit
    runs) and the same function run as Python: every output bit the same, at 1 and 2 threads, on
    ragged long rows in lockstep with a logit cap that bites and a running max that moves."""
    if os.environ.get(blocked.NO_TORCHSCRIPT):
        pytest.skip(f"${blocked.NO_TORCHSCRIPT} is set: the loop runs as Python")
    if sys.version_info >= (3, 14) or not hasattr(torch.jit, "script"):
        pytest.skip("no TorchScript here (torch without torch.jit.script, or Python 3.14+): the loop runs as Python")
    assert isinstance(blocked.lockstep_fn(), torch.jit.ScriptFunction), "TorchScript did not compile the loop"
    q, kv, indptr, idx = paged_case(LOCKSTEP, heads, 16, seed=heads)
    sc = Scales(kv_lora_rank=512, sm_scale=SCALE, logit_cap=logit_cap)
    att = Attended.token_index(indptr, idx)
    before = torch.get_num_threads()
    try:
        runs = {}
        for threads in (1, 2):
            torch.set_num_threads(threads)
            runs["compiled", threads] = ref.mla_decode_ref(q * 4, kv, att, sc)
            with monkeypatch.context() as m:
                m.setenv(blocked.NO_TORCHSCRIPT, "1")
                assert blocked.lockstep_fn() is blocked.lockstep
                runs["python", threads] = ref.mla_decode_ref(q * 4, kv, att, sc)
    finally:
        torch.set_num_threads(before)
    want = runs["python", 1]
    for key, (out, lse) in runs.items():
        assert torch.equal(out, want[0]) and torch.equal(lse, want[1]), key

"""diff-kv: the KV rows a decode node received vs the rows the prefill node stored."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Callable, Optional

import pytest
import torch

from refmla.capture import CaptureError, write_capture
from refmla.cli import main
from refmla.capture import read_capture
from refmla.diffkv import DiffResult, RequestDiff, diff_kv, diff_kv_files
from refmla.render.diffkv import render_diff

DV, DR = 32, 8  # small latent / rope widths keep the files tiny; the code never assumes 576
D = DV + DR


@dataclass
class Side:
    """One node's capture of some requests: its own pool layout, the positions it holds."""

    lens: list  # positions held per request
    new: Optional[list] = None  # extend: new tokens per request (the last `new` positions); None: decode
    page_size: int = 16
    rids: Optional[list] = None
    contiguous: bool = False  # pages handed out in order (long runs), else shuffled
    seed: int = 0
    mutate: Optional[Callable] = None  # mutate(pool [N, 1, D], slots: list of [L] slot tensors)
    slots: list = field(default_factory=list)  # filled by write_side: physical slots per request


def tokens_for(lens: list, seed: int = 1) -> list[torch.Tensor]:
    """The true latent KV rows of each request, [L, D] bf16 (what the prefill node computed)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(L, D, generator=g).to(torch.bfloat16) for L in lens]


def write_side(path, tokens: list, side: Side) -> str:
    g = torch.Generator().manual_seed(side.seed)
    P = side.page_size
    pages_per = [-(-L // P) for L in side.lens]
    total = sum(pages_per) + 3
    order = torch.arange(total) if side.contiguous else torch.randperm(total, generator=g)
    pool = torch.full(((total + 1) * P, 1, D), math.nan).to(torch.bfloat16)  # page 0 stays unused
    used, side.slots = 0, []
    for b, (L, n) in enumerate(zip(side.lens, pages_per)):
        pages = order[used : used + n] + 1
        used += n
        slots = (pages[:, None] * P + torch.arange(P)).reshape(-1)[:L]
        pool[slots, 0] = tokens[b][:L]
        side.slots.append(slots)
    if side.mutate is not None:
        side.mutate(pool, side.slots)
    B = len(side.lens)
    lens = torch.tensor(side.lens)
    indptr = torch.zeros(B + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(lens, 0)
    t = {"kv_buffer": pool, "kv_indptr": indptr, "kv_indices": torch.cat(side.slots).int(), "seq_lens": lens.int()}
    if side.new is None:
        t["q"] = torch.randn(B, 1, D, generator=g).to(torch.bfloat16)
    else:
        t["qo_indptr"] = torch.tensor([0, *torch.cumsum(torch.tensor(side.new), 0).tolist()], dtype=torch.int32)
        t["q"] = torch.randn(sum(side.new), 1, D, generator=g).to(torch.bfloat16)
    meta = {"mode": "decode" if side.new is None else "extend", "backend": "unknown", "kv_lora_rank": DV,
            "qk_rope_head_dim": DR, "sm_scale": 0.1, "logit_cap": 0.0, "page_size": P}  # fmt: skip
    if side.rids is not None:
        meta["rids"] = side.rids
    write_capture(path, t, meta)  # compacts: orig_kv_indices keeps the physical slots
    return str(path)


LENS = [70, 33, 128]  # prompt lengths
GEN = 5  # tokens the decode side generated since


def pair(tmp_path, decode_mutate=None, decode_order=(2, 0, 1), decode_rids=True, **decode_kw):
    """A prefill capture (extend, whole prompts) and a decode capture of the same requests at other,
    shuffled slots, the decode batch in another order. Returns (prefill path, decode path, sides)."""
    toks = tokens_for([L + GEN for L in LENS])
    rids = [f"req-{b}" for b in range(len(LENS))]
    pre = Side(lens=LENS, new=LENS, rids=rids, seed=10)
    dec = Side(
        lens=[LENS[b] + GEN for b in decode_order],
        rids=[rids[b] for b in decode_order] if decode_rids else None,
        seed=20,
        mutate=decode_mutate,
        **decode_kw,
    )
    p = write_side(tmp_path / "prefill.safetensors", toks, pre)
    d = write_side(tmp_path / "decode.safetensors", [toks[b] for b in decode_order], dec)
    return p, d, (pre, dec)


def by_request(result: DiffResult) -> dict[object, RequestDiff]:
    return {e.request: e for e in result.requests}


# --------------------------------------------------------------------------------------------


def test_identical_rows_at_shuffled_slots_match(tmp_path):
    p, d, (pre, dec) = pair(tmp_path)
    assert not torch.equal(pre.slots[0], dec.slots[1][: LENS[0]])  # really at other slots
    res = diff_kv_files([p], d)
    assert res.ok and res.pairing == "rid"
    reqs = by_request(res)
    assert set(reqs) == {"req-0", "req-1", "req-2"}
    for b, L in enumerate(LENS):
        e = reqs[f"req-{b}"]
        assert (e.positions_compared, e.mismatched_positions, e.first_mismatch, e.mismatched_pages) == (
            L,
            0,
            None,
            [],
        )
    assert res.positions_compared == sum(LENS)
    assert "verdict  match" in render_diff(res)


def test_one_perturbed_page_is_found_with_its_page_and_first_position(tmp_path):
    P, page = 16, 3  # request req-2 (decode request 0), its page 3: positions 48..63

    def corrupt(pool, slots):
        rows = slots[0][page * P : (page + 1) * P]
        pool[rows[5:], 0, 7] += 1.0  # positions 53..63, one element each

    p, d, _ = pair(tmp_path, decode_mutate=corrupt)
    res = diff_kv_files(p, d)
    assert not res.ok
    reqs = by_request(res)
    e = reqs["req-2"]
    assert e.mismatched_positions == P - 5
    assert e.first_mismatch == page * P + 5
    assert e.mismatched_pages == [page]
    assert e.mismatches.first.differing_dims == 1
    assert 0 < e.mismatches.max_abs_diff <= 8.0
    assert e.mismatches.first.prefill_norm != e.mismatches.first.decode_norm
    assert e.transfer_runs.with_mismatches == 1
    assert reqs["req-0"].mismatched_positions == 0 and reqs["req-1"].mismatched_positions == 0
    assert res.mismatched_positions == P - 5 and res.mismatched_requests == 1


def test_not_landed_page_reads_as_zero_rows(tmp_path):
    def zero(pool, slots):
        pool[slots[1][16:32]] = 0  # decode request 1 is req-0: its page 1

    p, d, _ = pair(tmp_path, decode_mutate=zero)
    e = by_request(diff_kv_files(p, d))["req-0"]
    assert e.mismatched_pages == [1] and e.first_mismatch == 16
    assert e.mismatches.decode_zero_rows == 16 and e.mismatches.first.decode_norm == 0.0
    assert "not landed" in e.summary


def test_offset_bug_over_a_contiguous_run_is_one_run(tmp_path):
    """Both pools hand out pages in order, so each request is one contiguous run on both sides; a
    transfer that wrote request req-2's rows shifted by one position shows as one run, offset 1."""

    def shift(pool, slots):
        rows = slots[0]  # req-2 on the decode side, positions 0..132
        pool[rows[40:100]] = pool[rows[41:101]].clone()

    p, d, _ = pair(tmp_path, decode_mutate=shift, contiguous=True)
    # the prefill side must be contiguous too: rewrite it so
    toks = tokens_for([L + GEN for L in LENS])
    p = write_side(tmp_path / "prefill_contig.safetensors", toks,
                   Side(lens=LENS, new=LENS, rids=[f"req-{b}" for b in range(3)], contiguous=True))  # fmt: skip
    e = by_request(diff_kv_files(p, d))["req-2"]
    runs = e.transfer_runs
    assert runs.with_mismatches == 1
    run = runs.mismatched[0]
    assert run.offset == 1
    assert run.first_mismatch == 40 and run.mismatched_positions == 60
    assert e.mismatched_pages == [2, 3, 4, 5, 6]  # positions 40..99, pages of 16
    assert "shifted by 1" in e.summary


def test_request_on_one_side_only_is_reported(tmp_path):
    toks = tokens_for([L + GEN for L in LENS])
    p = write_side(tmp_path / "p.safetensors", toks, Side(lens=LENS, new=LENS, rids=["a", "b", "c"]))
    d = write_side(tmp_path / "d.safetensors", [toks[0], toks[2], tokens_for([9], seed=5)[0]],
                   Side(lens=[LENS[0] + GEN, LENS[2] + GEN, 9], rids=["a", "c", "z"], seed=3))  # fmt: skip
    res = diff_kv_files([p], d)
    reqs = by_request(res)
    assert res.ok
    assert reqs["b"].status == "prefill_only" and reqs["b"].positions_compared == 0
    assert reqs["z"].status == "decode_only"
    assert res.prefill_only == ["b"] and res.decode_only == ["z"]
    assert reqs["a"].positions_compared == LENS[0] and reqs["c"].positions_compared == LENS[2]


def test_chunked_prefill(tmp_path):
    """Three chunk captures of one 100-token prompt (each covers the whole sequence after its
    write, in the same prefill pool); position 70 was re-read differently by the last chunk."""
    L, chunks = 100, [(0, 40), (40, 80), (80, 100)]
    toks = tokens_for([L + GEN])
    pre = Side(lens=[L], new=[L], rids=["r"], seed=1)
    write_side(tmp_path / "full.safetensors", toks, pre)  # fixes the prefill pool layout
    paths = []
    for k, (a, e) in enumerate(chunks):

        def keep(pool, slots, e=e, k=k):
            if k == 2:
                pool[slots[0][70], 0, 0] += 1.0  # the last chunk's view of position 70 differs

        side = Side(lens=[e], new=[e - a], rids=["r"], seed=1, mutate=keep)
        paths.append(write_side(tmp_path / f"chunk{k}.safetensors", toks, side))
    d = write_side(tmp_path / "decode.safetensors", toks, Side(lens=[L + GEN], rids=["r"], seed=9))
    res = diff_kv_files(paths, d)
    e = by_request(res)["r"]
    assert res.ok, "position 70 is owned by chunk 1, which wrote it"
    assert e.positions_compared == L and e.prefill_captures == [0, 1, 2]
    assert e.prefill_disagreements.to_json() == {"positions": 1, "first": 70}

    def bad(pool, slots):
        pool[slots[0][85], 0, 3] = -pool[slots[0][85], 0, 3] - 1  # in the last chunk's range

    d2 = write_side(tmp_path / "decode2.safetensors", toks, Side(lens=[L + GEN], rids=["r"], seed=9, mutate=bad))
    e = by_request(diff_kv_files(paths, d2))["r"]
    assert (e.mismatched_positions, e.first_mismatch, e.mismatched_pages) == (1, 85, [85 // 16])


def test_pairs_by_order_without_rids(tmp_path):
    p, d, _ = pair(tmp_path, decode_order=(0, 1, 2), decode_rids=False)
    res = diff_kv_files(p, d)
    assert res.pairing == "order" and res.ok
    assert [e.request for e in res.requests] == [0, 1, 2]


def test_unusable_inputs_raise_capture_error(tmp_path):
    p, d, _ = pair(tmp_path)
    broken = tmp_path / "broken.safetensors"
    broken.write_bytes(b"not a safetensors file")
    with pytest.raises(CaptureError, match="broken.safetensors"):
        diff_kv_files([p], str(broken))
    toks = tokens_for([5])
    other = write_side(tmp_path / "other.safetensors", toks, Side(lens=[5], new=[5], rids=["nobody"]))
    with pytest.raises(CaptureError, match="no rid in common"):
        diff_kv_files([other], d)


def test_cli_exit_codes_and_json(tmp_path, capsys):
    p, d, _ = pair(tmp_path)
    assert main(["diff-kv", p, d, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] is True
    for e in out["requests"]:
        assert {"request", "positions_compared", "mismatched_positions", "first_mismatch", "mismatched_pages"} <= set(e)

    def corrupt(pool, slots):
        pool[slots[2][3], 0, 0] += 2.0

    (tmp_path / "bad").mkdir()
    p2, d2, _ = pair(tmp_path / "bad", decode_mutate=corrupt)
    assert main(["diff-kv", p2, d2]) == 1
    assert "MISMATCH" in capsys.readouterr().out
    broken = tmp_path / "broken.safetensors"
    broken.write_bytes(b"\x00" * 3)
    assert main(["diff-kv", p, str(broken)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "broken.safetensors" in err[0]


def test_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")

    def corrupt(pool, slots):
        pool[slots[0][20:40], 0, 1] += 1.0

    from refmla.plots import plot_diff_kv

    p, d, _ = pair(tmp_path, decode_mutate=corrupt)
    paths = plot_diff_kv(diff_kv_files(p, d), tmp_path / "plots")
    assert len(paths) == 1
    with open(paths[0], "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert main(["diff-kv", p, d, "--json", "--plot", str(tmp_path / "cli-plots")]) == 1
    out = json.loads(capsys.readouterr().out)
    assert len(out["plots"]) == 1 and out["plots"][0].startswith(str(tmp_path / "cli-plots"))


def test_already_read_captures_give_typed_per_request_answers(tmp_path, capsys):
    """What `refmla disagg` will ask per (request, layer, rank): faithful, or the first mismatching
    position, page and transfer run -- from captures it has already read and grouped."""

    def shift(pool, slots):
        pool[slots[0][40:60]] = pool[slots[0][41:61]].clone()  # req-2 on the decode side

    p, d, _ = pair(tmp_path, decode_mutate=shift)
    res = diff_kv([read_capture(p)], read_capture(d))
    assert not res.ok
    e = res.request("req-2")
    assert not e.faithful and e.paired
    assert (e.first_mismatch, e.first_page) == (40, 40 // 16)
    run = e.first_run
    assert run is not None and run.start <= e.first_mismatch < run.end and run.offset == 1
    assert all(res.request(rid).faithful and res.request(rid).first_run is None for rid in ("req-0", "req-1"))
    with pytest.raises(KeyError):
        res.request("nobody")
    main(["diff-kv", p, d, "--json"])
    assert json.loads(capsys.readouterr().out) == res.to_json()  # the JSON is the typed result's


def test_diffkv_sits_below_plots_and_cli():
    """diffkv imports nothing above it (plots, cli, series, golden): the CLI draws the plots."""
    import ast
    from pathlib import Path

    import refmla.diffkv

    above = {"refmla.plots", "refmla.cli", "refmla.series", "refmla.golden"}
    for path in Path(refmla.diffkv.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
            elif isinstance(node, ast.Import):
                names = {a.name for a in node.names}
            else:
                continue
            assert not names & above, f"{path.name} imports {sorted(names & above)}"


@pytest.mark.parametrize("path", ["runs", "gather", "values"])
def test_rows_differ_agrees_with_a_plain_loop(path, monkeypatch):
    """The three ways rows are compared (memcmp over runs, chunked gather, by value across dtypes)
    find exactly the rows a per-row loop finds: a NaN payload, a sign of zero, one flipped bit."""
    import refmla.pool as dk

    g = torch.Generator().manual_seed(3)
    a = torch.randn(300, 1, D, generator=g).to(torch.bfloat16)
    b = a.clone()
    b[7, 0, 0] = -b[7, 0, 0]
    b[50, 0, D - 1] = math.nan
    a[50, 0, D - 1] = math.nan  # NaN == NaN: the same bits, no mismatch
    b[51, 0, 3] = 0.0
    a[51, 0, 3] = -0.0  # different bits, equal values
    b.view(torch.int16)[200, 0, 5] ^= 1  # the lowest mantissa bit
    ra = torch.arange(300)
    rb = torch.arange(300) if path == "runs" else torch.randperm(300, generator=g)
    pool_b = torch.empty_like(b)
    pool_b[rb] = b  # row i of a sits at row rb[i] of pool_b
    if path == "gather":
        monkeypatch.setattr(dk, "MIN_RUN", 10**9)
    if path == "values":
        pool_b = pool_b.float()  # another dtype: compared by value, -0.0 == 0.0
    got = dk.rows_differ(a, ra, pool_b, rb)
    want = {7, 200} if path == "values" else {7, 51, 200}
    assert set(torch.nonzero(got).flatten().tolist()) == want

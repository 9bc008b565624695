"""Issue 12: a seeded fuzz campaign over the capture format, in the suite.

Byte-level mutations of a small synthetic capture's file (flips, truncations, header length and
header text edits) and semantic ones written through the safetensors API (tensor shapes, dtypes and
values, meta keys and their types), each run in-process through the CLI's ``main`` (replay; inspect
and diff-kv on some). Every run must end with an exit code in {0, 1, 2}, exactly one stderr line
when it is 2, no traceback, within a time and memory bound.

``REFMLA_FUZZ_CASES`` (default 300) sets the number of cases, ``REFMLA_FUZZ_SEED`` (default 12) the
seed: e.g. ``REFMLA_FUZZ_CASES=3000 pytest tests/test_fuzz.py`` for a long campaign.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import resource
import time
from pathlib import Path

import pytest
import torch

from helpers import raw_write
from hostile import error_lines, reference_out, run_cli, small_capture

CASES = int(os.environ.get("REFMLA_FUZZ_CASES", "300"))
SEED = int(os.environ.get("REFMLA_FUZZ_SEED", "12"))
CASE_SECONDS = 20.0  # one case (all its commands) on a loaded 2-core machine
RSS_GROWTH_KIB = 1 << 20  # 1 GiB of peak RSS over the whole campaign

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int32, torch.int64, torch.int8,
          torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2]  # fmt: skip
WEIRD_NUMBERS = [0, -1, 1, 2, 7, 31, 32, 33, 2**31 - 1, 2**31, 2**63 - 1, -(2**63), 10**8, 10**40]
WEIRD_FLOATS = [0.0, -0.0, 1e-308, 1e-7, 1e308, math.inf, -math.inf, math.nan, -1.0, 1.5]
WEIRD_VALUES = WEIRD_NUMBERS + WEIRD_FLOATS + ["", "x" * 300, "decode", "extend", None, True, [], [1, 2], {"a": 1}]


def _base() -> tuple[dict, dict]:
    """A small decode capture with every optional tensor production stores."""
    from refmla import reference as ref
    from refmla.attended import Attended
    from refmla.scales import Scales

    t, m = small_capture()
    sc = Scales(512, m["sm_scale"], m["logit_cap"], m["k_scale"])
    args = (t["q"], t["kv_buffer"], Attended.from_tensors(t))
    t["lse"] = ref.mla_decode_ref(*args, sc.but(v_scale=m["v_scale"]))[1].float()
    parts, lses, _ = ref.mla_decode_split_ref(*args, t["num_kv_splits"], sc, max_kv_splits=m["max_kv_splits"])
    t["attn_logits"], t["attn_lse"] = parts.float(), lses.float()
    return t, m


# --- semantic mutations (through the safetensors API) -------------------------------------------


def _tensor_values(rng: random.Random, t: dict, m: dict) -> str:
    name = rng.choice(sorted(t))
    x = t[name].clone()
    flat = x.view(-1) if x.is_contiguous() else x.reshape(-1)
    if flat.numel():
        i = rng.randrange(flat.numel())
        if x.dtype.is_floating_point:
            v = rng.choice(WEIRD_FLOATS + [float(flat[i]) + rng.choice([0.5, -3.0, 1e4])])
            flat[i] = torch.tensor(v, dtype=torch.float64).to(x.dtype)  # overflows to inf, as a writer would
        else:
            flat[i] = max(min(rng.choice(WEIRD_NUMBERS), torch.iinfo(x.dtype).max), torch.iinfo(x.dtype).min)
    t[name] = x
    return f"value of {name}"


def _tensor_shape(rng: random.Random, t: dict, m: dict) -> str:
    name = rng.choice(sorted(t))
    x = t[name]
    how = rng.choice(["slice", "unsqueeze", "flatten", "empty", "grow"])
    if how == "slice" and x.dim():
        d = rng.randrange(x.dim())
        t[name] = x.narrow(d, 0, rng.randrange(x.shape[d] + 1)).contiguous()
    elif how == "unsqueeze":
        t[name] = x.unsqueeze(rng.randrange(x.dim() + 1))
    elif how == "flatten":
        t[name] = x.reshape(-1)
    elif how == "empty":
        t[name] = x.reshape(-1)[:0]
    else:
        t[name] = torch.cat([x, x[:1]]) if x.dim() and x.shape[0] else x
    return f"shape of {name} ({how})"


def _tensor_dtype(rng: random.Random, t: dict, m: dict) -> str:
    name = rng.choice(sorted(t))
    dtype = rng.choice(DTYPES)
    t[name] = t[name].float().nan_to_num(0.0).clamp(-100, 100).to(dtype)
    return f"dtype of {name} -> {dtype}"


def _tensor_set(rng: random.Random, t: dict, m: dict) -> str:
    name = rng.choice(sorted(t))
    if rng.random() < 0.7:
        del t[name]
        return f"drop {name}"
    t["unknown_" + name] = t[name].clone()
    return f"extra tensor next to {name}"


def _meta_value(rng: random.Random, t: dict, m: dict) -> str:
    key = rng.choice(sorted(m) + ["max_kv_splits", "k_scale", "rids"])
    value = rng.choice(WEIRD_VALUES)
    if key == "rids" and rng.random() < 0.5:
        value = [rng.choice(WEIRD_VALUES) for _ in range(rng.randrange(4))]
    m[key] = value
    return f"meta {key} = {str(value)[:40]}"


def _meta_drop(rng: random.Random, t: dict, m: dict) -> str:
    key = rng.choice(sorted(m))
    del m[key]
    return f"drop meta {key}"


def _splits(rng: random.Random, t: dict, m: dict) -> str:
    n = [rng.choice(WEIRD_NUMBERS[:12]) for _ in range(rng.choice([1, 2, 2, 3]))]
    t["num_kv_splits"] = torch.tensor([max(min(v, 2**31 - 1), -(2**31)) for v in n], dtype=torch.int32)
    if rng.random() < 0.5:
        m.pop("max_kv_splits", None)
    return f"num_kv_splits = {n}"


SEMANTIC = [_tensor_values, _tensor_values, _tensor_shape, _tensor_dtype, _tensor_set, _meta_value, _meta_value,
            _meta_drop, _splits]  # fmt: skip


def semantic_case(rng: random.Random, base: tuple[dict, dict], path) -> str:
    t = {k: v.clone() for k, v in base[0].items()}
    m = json.loads(json.dumps(base[1]))
    done = [rng.choice(SEMANTIC)(rng, t, m) for _ in range(rng.choice([1, 1, 2, 3]))]
    meta_text = json.dumps(m, allow_nan=True) if rng.random() < 0.95 else json.dumps(list(m))
    raw_write(path, t, meta_text)
    return "; ".join(done)


# --- byte-level mutations -----------------------------------------------------------------------


def byte_case(rng: random.Random, data: bytes, path) -> str:
    b = bytearray(data)
    n = int.from_bytes(b[:8], "little")
    how = rng.choice(["flip", "flip_header", "truncate", "append", "length", "header_text", "zero"])
    if how == "flip":
        for _ in range(rng.randrange(1, 16)):
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
    elif how == "flip_header":
        for _ in range(rng.randrange(1, 4)):
            b[8 + rng.randrange(n)] = rng.randrange(32, 127)
    elif how == "truncate":
        del b[rng.randrange(len(b)) :]
    elif how == "append":
        b += bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))
    elif how == "length":
        b[:8] = rng.choice([0, 1, n - 1, n + 8, len(b), 2**63, 2**64 - 1]).to_bytes(8, "little")
    elif how == "header_text":  # valid JSON, wrong meaning: shapes, offsets, dtypes
        header = json.loads(b[8 : 8 + n])
        name = rng.choice([k for k in header if k != "__metadata__"])
        field = rng.choice(["shape", "data_offsets", "dtype"])
        header[name][field] = rng.choice([[0], [2**40], [-1, 3], "F64", "I8", [0, 2**62], [5, 1], "BOGUS"])
        text = json.dumps(header).encode()
        text += b" " * (-len(text) % 8)
        b = bytearray(len(text).to_bytes(8, "little")) + text + b[8 + n :]
    else:
        start = rng.randrange(8 + n, len(b))
        b[start : start + rng.randrange(1, 4096)] = bytes(min(4096, len(b) - start))[: len(b[start : start + 4096])]
    path.write_bytes(bytes(b))
    return f"bytes: {how}"


# --- the campaign -------------------------------------------------------------------------------


def _check_run(what: str, code, out: str, err: str) -> None:
    assert code in (0, 1, 2), f"{what}: exit {code}"
    assert "Traceback" not in err and "Traceback" not in out, f"{what}: traceback\n{err}"
    if code == 2:
        lines = error_lines(err)
        assert len(lines) == 1 and lines[0].startswith("refmla: error: "), f"{what}: stderr {lines}"


def test_fuzz_the_capture_format(tmp_path):
    rng = random.Random(SEED)
    base = _base()
    good = tmp_path / "base.safetensors"
    raw_write(good, *base)
    data = good.read_bytes()
    assert run_cli("replay", str(good), "--backend", "reference")[0] == 0, "the base capture must agree"
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    codes = {0: 0, 1: 0, 2: 0}
    t_all = time.perf_counter()
    for i in range(CASES):
        path = tmp_path / f"case{i % 8}.safetensors"
        what = byte_case(rng, data, path) if rng.random() < 0.4 else semantic_case(rng, base, path)
        what = f"case {i} (seed {SEED}): {what}"
        t0 = time.perf_counter()
        code, out, err = run_cli("replay", str(path), "--backend", "reference", *(["--json"] if i % 2 else []))
        _check_run(what + " [replay]", code, out, err)
        codes[code] += 1
        if i % 3 == 0:
            _check_run(what + " [inspect]", *run_cli("inspect", str(path), "--json"))
        if i % 7 == 0:
            _check_run(what + " [diff-kv]", *run_cli("diff-kv", str(good), str(path), "--json"))
        if i % 10 == 0:  # several captures: the series checks between them, one error line per bad one
            code, out, err = run_cli("replay", str(good), str(path), "--backend", "reference", "--json")
            assert code in (0, 1, 2) and "Traceback" not in err, f"{what} [replay pair]"
            assert len(json.loads(out)) == 2, f"{what} [replay pair]: every capture is reported"
            assert sum(ln.startswith("refmla: error:") for ln in error_lines(err)) == (code == 2), what
        assert time.perf_counter() - t0 < CASE_SECONDS, f"{what}: too slow"
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0
    assert grown < RSS_GROWTH_KIB, f"peak RSS grew by {grown} KiB"
    assert codes[2] > CASES // 4 and codes[0] + codes[1] > CASES // 20, f"a campaign that tests both sides: {codes}"
    print(f"fuzz: {CASES} cases, exit codes {codes}, {time.perf_counter() - t_all:.1f} s")


# --- issue 22: the second round's classes, generated --------------------------------------------
# Each generator writes one capture and says what the contract promises for it: (what, exit code,
# a text the one error line or the diagnosis must hold). REFMLA_FUZZ_CASES scales this campaign
# too (2/3 of it: 200 cases by default).

CASES2 = max(1, CASES * 2 // 3)
RAW = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069\ud800-\udfff]")
ODD_CHARS = ["\x1b", "\x07", "\n", "\r", "\x00", "\x7f", "\x9b", "\u202e", "\u2028", "\ud800", "\udfff", "é", "a", "]"]
INT_KEYS = ["kv_pool_rows", "kv_pool_row_bytes", "kv_pool_layers_per_buffer", "kv_pool_layers", "kv_pool_size",
            "mori_max_mr_bytes", "layer_id", "tp_rank", "step", "page_size", "max_kv_splits"]  # fmt: skip


def _odd_text(rng: random.Random, surrogates: bool = True) -> str:
    pool = ODD_CHARS if surrogates else [c for c in ODD_CHARS if not 0xD800 <= ord(c) <= 0xDFFF]
    return "".join(rng.choice(pool) for _ in range(rng.randrange(1, 12)))


def _escape_case(rng, t, m, path):
    field = rng.choice(["backend", "sglang_version", "rids", "extra", "tensor"])
    value = _odd_text(rng, surrogates=field != "tensor")  # safetensors names are UTF-8
    if field == "rids":
        m["rids"] = [f"{value}{b}" for b in range(len(m["rids"]))]
    elif field == "extra":
        m[value] = value
    elif field == "tensor":
        t["x" + value] = torch.zeros(1)
    else:
        m[field] = value
    return f"odd text in {field}: {value!r}", 0, None


def _depth_case(rng, t, m, path):
    depth = rng.choice([rng.randrange(1, 40), rng.randrange(1, 3000)])
    key = rng.choice(["nested", "golden_notes", "x"])
    opens = [rng.choice(['[', '{"k": ']) for _ in range(depth - 1)]  # as text: json.dumps recurses
    closes = "".join("]" if o == "[" else "}" for o in reversed(opens))
    m[DEEP] = (key, "".join(opens) + "0" + closes)
    return f"meta {key} nested {depth} deep", (2 if depth > 32 else 0), key if depth > 32 else None


def _bigint_case(rng, t, m, path):
    key = rng.choice(INT_KEYS + ["sm_scale", "k_scale"])
    value = rng.choice([1, -1]) * 10 ** rng.randrange(19, 500)
    m[key] = value
    return f"meta {key} with {len(str(abs(value)))} digits", 2, f"meta key '{key}'"


def _duprid_case(rng, t, m, path):
    rid = _odd_text(rng)
    m["rids"] = [rid, rid]
    return f"rids repeated: {rid!r}", 2, "meta key 'rids'"


def _nonfinite_case(rng, t, m, path):
    value = rng.choice([math.nan, math.inf, -math.inf])
    attended = sorted(set(t["kv_indices"].tolist()))
    where = rng.choice(["q", "kv", "kv_unattended"])
    if where == "q":
        q = t["q"].clone()
        q[rng.randrange(q.shape[0]), rng.randrange(q.shape[1]), rng.randrange(q.shape[2])] = value
        t["q"] = q
    else:
        free = [r for r in range(t["kv_buffer"].shape[0]) if r not in attended]
        row = rng.choice(attended if where == "kv" else free)
        kv = t["kv_buffer"].clone()
        kv[row, 0, rng.randrange(kv.shape[2])] = value
        t["kv_buffer"] = kv
    reference_out(t, m)  # production "agrees" with the reference, NaN for NaN
    if where == "kv_unattended":
        return f"{value} in an unattended pool row", 0, None
    return f"{value} in {where}", 1, "the input is already non-finite: the fault is upstream of attention"


DEEP = "\0deep"  # (key, JSON text) a generator hands the writer for a value too deep for json.dumps


def _meta_text(m: dict) -> str:
    deep = m.pop(DEEP, None)
    text = json.dumps(m)
    return text if deep is None else f"{text[:-1]}, {json.dumps(deep[0])}: {deep[1]}}}"


ROUND2 = [_escape_case, _depth_case, _bigint_case, _duprid_case, _nonfinite_case]


def _check_round2(what: str, want: int, text, code: int, out: str, err: str, as_json: bool) -> None:
    _check_run(what, code, out, err)
    assert code == want, f"{what}: exit {code}, want {want}\n{err}"
    assert not RAW.search(out + err), f"{what}: raw control text reached the output"
    if code == 2 and text:
        assert text in error_lines(err)[0], f"{what}: {error_lines(err)}"
    if as_json:
        report = json.loads(out)
        if code == 1 and text:
            assert report["diagnosis"] == "upstream_nonfinite" and text in report["diagnosis_text"], what


def test_fuzz_round_two(tmp_path):
    """Issue 22's classes, generated: escaped text, bounded depth and ints, duplicate rids, NaN
    inputs; and a bad capture among good ones never costs theirs (the JSON array is whole)."""
    rng = random.Random(SEED + 22)
    base = small_capture()
    good = tmp_path / "good.safetensors"
    raw_write(good, *base)
    counts: dict[str, int] = {}
    t_all = time.perf_counter()
    for i in range(CASES2):
        t = {k: v.clone() for k, v in base[0].items()}
        m = json.loads(json.dumps(base[1]))
        gen = ROUND2[i % len(ROUND2)]
        name = f"case{i % 4}" + (_odd_text(rng, surrogates=False).replace("\x00", "").replace("/", "") if i % 6 == 0 else "")
        path = tmp_path / f"{name}.safetensors"
        what, want, text = gen(rng, t, m, path)
        what = f"case {i} (seed {SEED + 22}): {what}"
        raw_write(path, t, _meta_text(m))
        as_json = i % 2 == 1
        t0 = time.perf_counter()
        code, out, err = run_cli("replay", str(path), "--backend", "reference", "--no-explain",
                                 *(["--json"] if as_json else []))  # fmt: skip
        _check_round2(what, want, text, code, out, err, as_json)
        if i % 5 == 0:  # among others: every report still comes out
            code, out, err = run_cli("replay", str(good), str(path), str(good), "--backend", "reference",
                                     "--no-explain", "--json")  # fmt: skip
            assert [r["verdict"] for r in json.loads(out)][::2] == ["agree", "agree"], what
            assert not RAW.search(out + err), what
        assert time.perf_counter() - t0 < CASE_SECONDS, f"{what}: too slow"
        counts[gen.__name__] = counts.get(gen.__name__, 0) + 1
    print(f"fuzz round two: {CASES2} cases {counts}, {time.perf_counter() - t_all:.1f} s")


# --- issue 33: block tables, meta numbers of every kind, mixed folders, generated ----------------
# Block-table captures built here (a random page permutation, padding, a plain fp64 loop for `out`),
# planted faults with the promise each keeps, and folders mixing dense, block-table and sparse
# captures, good and bad: one JSON document, every capture's report, one error line per bad one.
# REFMLA_FUZZ_CASES scales it (1/10: 30 cases by default).

CASES3 = max(1, CASES // 10)
TABLE_FAULTS = ["none", "none", "past_pool", "negative", "short", "positions", "meta_number"]


def _table_capture(rng: random.Random) -> tuple[dict, dict]:
    """A decode capture in the block-table layout (vLLM / FlashMLA): B requests, pages of P rows in
    a shuffled order, padding past each sequence, `out` from a plain fp64 loop over the positions."""
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    B, H, Dv, rope, P = rng.randrange(1, 4), rng.choice([1, 2, 4]), 32, rng.choice([0, 16]), rng.choice([1, 4, 16, 64])
    lens = [rng.randrange(1, 150) for _ in range(B)]
    need = [-(-n // P) for n in lens]
    M = max(need) + rng.randrange(3)
    pages = sum(need) + rng.randrange(1, 4)
    order = torch.randperm(pages, generator=g)
    table = torch.full((B, M), rng.choice([0, -1]), dtype=torch.int32)
    used = 0
    for b in range(B):
        table[b, : need[b]] = order[used : used + need[b]].int()
        used += need[b]
    D, scale = Dv + rope, 0.1
    q = torch.randn(B, H, D, generator=g).bfloat16()
    kv = torch.randn(pages * P, 1, D, generator=g).bfloat16()
    out = torch.zeros(B, H, Dv)
    for b in range(B):
        rows = [int(table[b, j // P]) * P + j % P for j in range(lens[b])]
        k = kv[rows, 0].double()  # [L, D]
        p = torch.softmax((q[b].double() @ k.T) * scale, dim=-1)  # [H, L]
        out[b] = (p @ k[:, :Dv]).float()
    t = {"q": q, "kv_buffer": kv, "block_table": table, "seq_lens": torch.tensor(lens, dtype=torch.int32),
         "out": out.bfloat16()}  # fmt: skip
    m = {"mode": "decode", "backend": "unknown", "kv_lora_rank": Dv, "qk_rope_head_dim": rope, "sm_scale": scale,
         "logit_cap": 0.0, "page_size": P, "engine": "vllm", "null_block": 0 if rng.random() < 0.5 else None}  # fmt: skip
    return t, {k: v for k, v in m.items() if v is not None}


def _bad_number(rng: random.Random, key: str) -> str:
    """JSON text for a value of ``key`` that breaks its type, finiteness or range."""
    from refmla.capture.numbers import META_NUMBERS

    typ, lo, hi = META_NUMBERS[key]
    return rng.choice(["1e400", "-1e400", "NaN", "9" * rng.randrange(41, 5000), '"3"', "true", "[1]",
                       json.dumps(lo - 1 if lo > -(2**63) and rng.random() < 0.5 else (hi * 10 if typ is float else hi + 1))])  # fmt: skip


def _table_case(rng: random.Random, path) -> tuple[str, int, str]:
    """Write one block-table capture with a planted fault; (what, exit code, text of the one error line)."""
    from refmla.blocktable import MAX_POSITIONS
    from refmla.capture.numbers import META_NUMBERS

    t, m = _table_capture(rng)
    fault = rng.choice(TABLE_FAULTS)
    table, P, pool_pages = t["block_table"], m["page_size"], t["kv_buffer"].shape[0] // m["page_size"]
    b = rng.randrange(table.shape[0])
    inside = -(-int(t["seq_lens"][b]) // P)
    want, text, meta_text = 0, "", json.dumps(m)
    if fault == "past_pool":
        table[b, rng.randrange(inside)] = pool_pages + rng.randrange(0, 1 << 20)
    elif fault == "negative":
        table[b, rng.randrange(inside)] = -1
    elif fault == "short":
        t["seq_lens"][b] += table.shape[1] * P
    elif fault == "positions":  # a few pages named over and over: more positions than the bound, no rows
        m["page_size"], P = 1 << 16, 1 << 16
        t["kv_buffer"] = t["kv_buffer"][:1].expand(P, 1, -1).contiguous()
        n = MAX_POSITIONS // P + rng.randrange(1, 64)
        t["block_table"], t["seq_lens"] = torch.zeros(1, n, dtype=torch.int32), torch.tensor([n * P], dtype=torch.int32)
        t["q"], t["out"] = t["q"][:1], t["out"][:1]
        meta_text = json.dumps(m)
    if fault in ("past_pool", "negative", "short", "positions"):
        want, text = 2, "tensor 'block_table'"
    if fault == "meta_number":
        key = rng.choice(sorted(META_NUMBERS))
        m.pop(key, None)
        meta_text = json.dumps(m)[:-1] + f", {json.dumps(key)}: {_bad_number(rng, key)}}}"
        want, text = 2, f"meta key '{key}'"
    raw_write(path, t, meta_text)
    return f"block table, {fault}", want, text


def _sparse_number_case(rng: random.Random, sparse: tuple[dict, dict], path) -> tuple[str, int, str]:
    """A sparse capture with one numeric meta key broken."""
    key = rng.choice(["compress_ratio", "softmax_scale", "page_size", "head_dim_v", "window", "layer_id", "step"])
    m = dict(sparse[1])
    m.pop(key, None)
    raw_write(path, sparse[0], json.dumps(m)[:-1] + f", {json.dumps(key)}: {_bad_number(rng, key)}}}")
    return f"sparse, meta {key}", 2, f"meta key '{key}'"


def test_fuzz_round_three(tmp_path):
    """Issue 33's classes, generated: block tables (valid, past the pool, -1 inside, too short, more
    positions than the bound), a bad number in any numeric meta key of a dense or sparse capture;
    and folders mixing them with good dense and sparse captures: one document, every report."""
    from safetensors import safe_open

    from refmla.sparse.make import synth_sparse

    rng = random.Random(SEED + 33)
    synth_sparse(tmp_path / "sparse.safetensors", "deepseek-v4-flash-tp8-swa")
    with safe_open(str(tmp_path / "sparse.safetensors"), "pt") as f:
        sparse = ({k: f.get_tensor(k) for k in f.keys()}, json.loads(f.metadata()["meta"]))
    counts = {0: 0, 1: 0, 2: 0}
    t_all = time.perf_counter()
    for i in range(CASES3):
        path = tmp_path / f"case{i % 4}.safetensors"
        what, want, text = _sparse_number_case(rng, sparse, path) if i % 5 == 4 else _table_case(rng, path)
        what = f"case {i} (seed {SEED + 33}): {what}"
        t0 = time.perf_counter()
        code, out, err = run_cli("replay", str(path), "--backend", "reference", "--no-explain", "--json")
        _check_run(what, code, out, err)
        json.loads(out)
        assert code == want, f"{what}: exit {code}, want {want}\n{err}"
        if want == 2:
            assert text in error_lines(err)[0] and str(path) in error_lines(err)[0], f"{what}: {error_lines(err)}"
        counts[code] += 1
        if i % 3 == 0:  # a folder: this capture among good dense, block-table and sparse ones
            folder = tmp_path / f"mixed{i}"
            (folder / "sparse").mkdir(parents=True)
            raw_write(folder / "dense.safetensors", *small_capture())
            raw_write(folder / "table.safetensors", *_table_capture(rng))
            raw_write(folder / "sparse" / "good.safetensors", *sparse)
            path.rename(folder / "planted.safetensors")
            for cmd in (["replay", "--backend", "reference", "--no-explain"], ["inspect"]):
                code, out, err = run_cli(cmd[0], str(folder), *cmd[1:], "--json")
                reports = {Path(r["capture"]).stem: r for r in json.loads(out)}  # the whole stdout: one document
                assert sorted(reports) == ["dense", "good", "planted", "table"], f"{what} [{cmd[0]} folder]"
                bad = [ln for ln in error_lines(err) if ln.startswith("refmla: error:")]
                assert len(bad) == (want == 2) and code == max(want, 0 if cmd[0] == "replay" else code), f"{what}: {bad}"
                if cmd[0] == "replay":
                    assert all(reports[n]["verdict"] == "agree" for n in ("dense", "good", "table")), what
        assert time.perf_counter() - t0 < CASE_SECONDS, f"{what}: too slow"
    assert counts[0] and counts[2], f"a campaign that tests both sides: {counts}"
    print(f"fuzz round three: {CASES3} cases, exit codes {counts}, {time.perf_counter() - t_all:.1f} s")

"""diff-kv of KV that came back from a host tier or a prefix cache: rows paired by the token ids they
hold (kv_token_ids), not by rid.

The data is laid out the way SGLang's HiCache moves it, by this file's own code (never refmla's):
a writer request computes its prompt's latent rows into the device pool (pages of 16, handed out
shuffled); the radix cache backs them up to the host pool (``MLATokenToKVPoolHost``, layout
``page_first``: [host rows, layers, 1, D]) and the device pages are evicted and reused; a later
request with another rid whose prompt starts with the same tokens gets the prefix as a host hit,
``init_load_back`` copies the host rows into freshly allocated device pages
(``load_to_device_per_layer``), and it computes and decodes the rest. Its capture's ``kv_origin`` is
SGLang's tier split of the cached prefix (``cached_tokens_device`` / ``_host`` / ``_storage``).
The fault: one page loaded from the host rows of another layer (a layer_first / page_first mix-up
of the host layout), or not loaded at all (zeros: a missing sync before the kernel read it).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Optional

import pytest
import torch

from refmla.capture import read_capture, write_capture
from refmla.cli import main
from refmla.diffkv import diff_kv_files

DV, DR = 32, 8
D = DV + DR
P = 16  # SGLang's page size here
LAYERS = 2
CAPTURED_LAYER = 1
COMPUTED, DEVICE_HIT, HOST, STORAGE = 0, 1, 2, 3  # docs/contract.md: kv_origin codes


def latent(tokens: list[int], layer: int) -> torch.Tensor:
    """The latent KV rows [L, D] of a token sequence: row j depends on tokens 0..j (a running hash)."""
    rows, h = [], 1469598103934665603
    for t in tokens:
        h = (h * 1099511628211 + t + 7) % (1 << 61)
        g = torch.Generator().manual_seed(h ^ (layer * 0x9E3779B9))
        rows.append(torch.randn(D, generator=g))
    return torch.stack(rows).to(torch.bfloat16)


@dataclass
class Device:
    """The device KV pool of every layer, and its page allocator (shuffled free pages)."""

    pages: int = 64
    seed: int = 0
    pool: torch.Tensor = field(init=False)  # [layers, pages * P, 1, D]
    free: list = field(init=False)

    def __post_init__(self):
        self.pool = torch.full((LAYERS, self.pages * P, 1, D), math.nan).to(torch.bfloat16)
        g = torch.Generator().manual_seed(self.seed)
        self.free = [int(p) for p in torch.randperm(self.pages - 1, generator=g) + 1]  # page 0 is SGLang's padding page

    def alloc(self, n_tokens: int) -> torch.Tensor:
        """Slots for n tokens, whole pages [n_tokens]."""
        k = -(-n_tokens // P)
        pages, self.free = self.free[:k], self.free[k:]
        return (torch.tensor(pages)[:, None] * P + torch.arange(P)).flatten()[:n_tokens]

    def evict(self, slots: torch.Tensor) -> None:
        """The pages go back to the allocator, their rows overwritten by whoever gets them next."""
        self.pool[:, slots] = torch.randn(LAYERS, slots.numel(), 1, D).to(torch.bfloat16)
        self.free += sorted({int(s) // P for s in slots})


@dataclass
class Host:
    """MLATokenToKVPoolHost, layout page_first: [host rows, layers, 1, D]."""

    rows: int = 512
    buf: torch.Tensor = field(init=False)
    used: int = 0

    def __post_init__(self):
        self.buf = torch.zeros(self.rows, LAYERS, 1, D, dtype=torch.bfloat16)

    def backup(self, dev: Device, slots: torch.Tensor) -> torch.Tensor:
        """write_backup: device rows of every layer -> host rows; the host indices [n]."""
        idx = torch.arange(self.used, self.used + slots.numel())
        self.used += slots.numel()
        self.buf[idx] = dev.pool[:, slots].transpose(0, 1)
        return idx


@dataclass
class Request:
    rid: str
    tokens: list  # prompt + generated
    slots: torch.Tensor  # device slot per position
    origin: list  # kv_origin per position


def prefill(dev: Device, rid: str, prompt: list) -> tuple[Request, dict]:
    """A request computed from scratch: every row computed, the extend capture's tensors."""
    slots = dev.alloc(len(prompt))
    for layer in range(LAYERS):
        dev.pool[layer, slots, 0] = latent(prompt, layer)
    return Request(rid, list(prompt), slots, [COMPUTED] * len(prompt)), {"new": [len(prompt)]}


def reload_prefix(dev: Device, host: Host, host_idx: torch.Tensor, k: int, fault: Optional[str],
                  bad_page: int, tier: int = HOST) -> torch.Tensor:  # fmt: skip
    """init_load_back: k host rows -> new device pages, layer by layer (load_to_device_per_layer)."""
    slots = dev.alloc(k)
    for layer in range(LAYERS):
        src = host.buf[host_idx[:k], layer]  # [k, 1, D]
        if fault == "wrong_layer" and layer == CAPTURED_LAYER:  # page `bad_page` read from the other layer's rows
            lo, hi = bad_page * P, (bad_page + 1) * P
            src = src.clone()
            src[lo:hi] = host.buf[host_idx[lo:hi], 1 - layer]
        if fault == "not_landed" and layer == CAPTURED_LAYER:
            src = src.clone()
            src[bad_page * P : (bad_page + 1) * P] = 0
        dev.pool[layer, slots] = src
    return slots


def extend_after_hit(dev: Device, rid: str, prompt: list, prefix_slots: torch.Tensor, origin: list) -> Request:
    """The rest of a prompt computed after a prefix hit: rows [k, L) at new slots."""
    k = prefix_slots.numel()
    new = dev.alloc(len(prompt) - k)
    for layer in range(LAYERS):
        dev.pool[layer, new, 0] = latent(prompt, layer)[k:]
    return Request(rid, list(prompt), torch.cat([prefix_slots, new]), origin + [COMPUTED] * (len(prompt) - k))


def decode_steps(dev: Device, r: Request, n: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        r.tokens.append(int(torch.randint(5, 30000, (1,), generator=g)))
        slot = dev.alloc(1) if r.slots.numel() % P == 0 else r.slots[-1:] + 1
        for layer in range(LAYERS):
            dev.pool[layer, slot, 0] = latent(r.tokens, layer)[-1:]
        r.slots = torch.cat([r.slots, slot])
        r.origin.append(COMPUTED)


def capture(path, dev: Device, reqs: list[Request], new: Optional[list] = None, tokens: bool = True) -> str:
    """One call's capture of the captured layer (extend when ``new`` lists each request's new tokens)."""
    lens = torch.tensor([len(r.tokens) for r in reqs])
    t = {"kv_buffer": dev.pool[CAPTURED_LAYER].clone(), "kv_indptr": torch.cat([torch.zeros(1), lens.cumsum(0)]).int(),
         "kv_indices": torch.cat([r.slots for r in reqs]).int(), "seq_lens": lens.int()}  # fmt: skip
    if tokens:
        t["kv_token_ids"] = torch.tensor([x for r in reqs for x in r.tokens], dtype=torch.int64)
        t["kv_origin"] = torch.tensor([x for r in reqs for x in r.origin], dtype=torch.int8)
    rows = sum(new) if new else len(reqs)
    t["q"] = torch.randn(rows, 1, D).to(torch.bfloat16)
    if new:
        t["qo_indptr"] = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32)
    meta = {"mode": "extend" if new else "decode", "backend": "unknown", "kv_lora_rank": DV, "qk_rope_head_dim": DR,
            "sm_scale": 0.1, "logit_cap": 0.0, "page_size": P, "layer_id": CAPTURED_LAYER, "tp_rank": 0,
            "rids": [r.rid for r in reqs]}  # fmt: skip
    write_capture(path, t, meta)
    return str(path)


def hicache_world(tmp_path, fault: Optional[str] = None, bad_page: int = 2, tokens: bool = True,
                  storage_from: Optional[int] = None) -> dict:  # fmt: skip
    """Writer req-A (96 tokens) captured at its extend; backed up to host, evicted; req-B (another rid) hits
    64 of A's tokens on the host tier (``storage_from``: positions from there came from the L3 store
    first), computes 40 more, decodes 5, captured at its extend and its decode beside an unrelated req-C."""
    dev, host = Device(), Host()
    g = torch.Generator().manual_seed(11)
    prompt_a = torch.randint(5, 30000, (96,), generator=g).tolist()
    a, _ = prefill(dev, "req-A", prompt_a)
    cap_a = capture(tmp_path / "A-extend.safetensors", dev, [a], new=[96], tokens=tokens)
    host_idx = host.backup(dev, a.slots)
    dev.evict(a.slots)  # the device copy is gone: B's prefix can only come from the host
    k = 64
    prompt_b = prompt_a[:k] + torch.randint(5, 30000, (40,), generator=g).tolist()
    origin = [HOST] * k if storage_from is None else [HOST] * storage_from + [STORAGE] * (k - storage_from)
    prefix = reload_prefix(dev, host, host_idx, k, fault, bad_page)
    b = extend_after_hit(dev, "req-B", prompt_b, prefix, origin)
    c, _ = prefill(dev, "req-C", torch.randint(5, 30000, (50,), generator=g).tolist())
    cap_b = capture(tmp_path / "B-extend.safetensors", dev, [b], new=[40], tokens=tokens)
    cap_c = capture(tmp_path / "C-extend.safetensors", dev, [c], new=[50], tokens=tokens)
    decode_steps(dev, b, 5, seed=1)
    decode_steps(dev, c, 5, seed=2)
    cap_d = capture(tmp_path / "decode.safetensors", dev, [c, b], tokens=tokens)
    return {"A": cap_a, "B": cap_b, "C": cap_c, "decode": cap_d}


# ---------------------------------------------------------------------------------------------


def test_a_clean_host_reload_agrees_against_the_capture_that_wrote_it(tmp_path):
    w = hicache_world(tmp_path)
    res = diff_kv_files([w["A"], w["B"], w["C"]], w["decode"])
    assert res.pairing == "tokens" and res.ok, res.to_json()
    b = res.request("req-B")
    assert b.faithful and b.positions_compared == 104  # 64 reloaded + 40 computed; 5 decoded: no counterpart
    by = {w_.rid: w_.ranges for w_ in b.reuse.written_by}
    assert by == {"req-A": [(0, 64)], "req-B": [(64, 104)]}  # the prefix against the writer, not B's own reader
    assert b.reuse.unmatched == [(104, 109)]
    assert b.reuse.origins == {"host": 64, "computed": 40} and b.reuse.tier is None
    assert res.request("req-C").faithful


def test_a_host_reload_with_one_page_from_another_layer_is_found_naming_the_page(tmp_path):
    w = hicache_world(tmp_path, fault="wrong_layer", bad_page=2)
    res = diff_kv_files([w["A"], w["B"], w["C"]], w["decode"])
    assert not res.ok
    b = res.request("req-B")
    assert b.status == "mismatch" and b.mismatched_pages == [2] and b.mismatched_positions == P
    assert b.first_mismatch == 2 * P
    assert b.reuse.tier == "host" and b.reuse.mismatch_origins == {"host": P}
    assert b.reuse.mismatch_pages == {"host": [2]}
    assert "host tier" in b.summary and "req-A" in b.summary and "page 2" in b.summary
    assert res.request("req-C").faithful  # 0 false alarms beside it
    # the reader's own extend capture read the same reloaded rows: it alone would have agreed
    alone = diff_kv_files([w["B"]], w["decode"])
    assert alone.request("req-B").faithful


def test_a_page_not_landed_from_the_l3_store_names_the_store(tmp_path):
    w = hicache_world(tmp_path, fault="not_landed", bad_page=3, storage_from=48)
    res = diff_kv_files([w["A"], w["C"]], w["decode"])
    b = res.request("req-B")
    assert b.mismatched_pages == [3] and b.reuse.tier == "storage"
    assert b.mismatches.decode_zero_rows == P
    assert b.reuse.unmatched == [(64, 109)]  # B's own rows: no capture given holds them, said, not dropped


def test_captures_without_token_ids_keep_rid_pairing(tmp_path):
    w = hicache_world(tmp_path, fault="wrong_layer", tokens=False)
    cap = read_capture(w["decode"])
    assert cap.kv_token_ids is None and cap.kv_origin is None
    res = diff_kv_files([w["A"], w["B"], w["C"]], w["decode"])
    assert res.pairing == "rid"
    assert res.request("req-B").faithful  # paired with its own extend capture: the reload is invisible this way
    assert res.request("req-A").status == "prefill_only"


def test_cli_json_names_the_tier_and_the_page_and_exits_1(tmp_path, capsys):
    w = hicache_world(tmp_path, fault="wrong_layer", bad_page=1)
    code = main(["diff-kv", w["A"], w["C"], w["decode"], "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 1 and out["pairing"] == "tokens"
    b = next(e for e in out["requests"] if e["request"] == "req-B")
    assert b["mismatched_pages"] == [1] and b["reuse"]["tier"] == "host"
    assert b["reuse"]["written_by"][0] == {"capture": 0, "rid": "req-A", "positions": [[0, 64]]}
    assert b["reuse"]["unmatched_positions"] == [[64, 109]]
    code = main(["diff-kv", w["A"], w["C"], w["decode"]])
    text = capsys.readouterr().out
    assert code == 1 and "host tier" in text and "req-A" in text


@pytest.mark.parametrize("name,bad,why", [
    ("kv_token_ids", lambda t: t["kv_token_ids"][:-1], "expected"),
    ("kv_origin", lambda t: torch.full_like(t["kv_origin"], 9), "code 9"),
    ("kv_origin", lambda t: t["kv_origin"].float(), "dtype"),
])  # fmt: skip
def test_bad_row_tensors_are_one_clear_error(tmp_path, capsys, name, bad, why):
    w = hicache_world(tmp_path)
    from safetensors.torch import load_file, save_file
    import safetensors

    with safetensors.safe_open(w["decode"], "pt") as f:
        meta = f.metadata()
    t = load_file(w["decode"])
    t[name] = bad(t)
    save_file(t, tmp_path / "bad.safetensors", metadata=meta)
    code = main(["diff-kv", w["A"], str(tmp_path / "bad.safetensors")])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "bad.safetensors" in err and name in err and why in err


@pytest.mark.parametrize("preset", ["hicache-reload", "hicache-l3-reload"])
@pytest.mark.parametrize("fault", ["none", "reload_corrupt_page", "reload_not_landed"])
def test_synth_reload_presets_are_found_by_diff_kv_as_planted(tmp_path, capsys, preset, fault):
    code = main(["synth-disagg", str(tmp_path), "--preset", preset, "--fault", fault])
    planted = json.loads(capsys.readouterr().out.split("planted ", 1)[1].rstrip().rstrip(")"))
    assert code == 0
    code = main(["diff-kv", str(tmp_path / "prefill"), str(tmp_path / "decode"), "--json"])
    (res,) = json.loads(capsys.readouterr().out)
    reader = next(e for e in res["requests"] if e["request"] == "reader-1")
    assert reader["reuse"]["written_by"][0]["rid"] == "writer-0"
    other = next(e for e in res["requests"] if e["request"] == "other-2")
    assert other["status"] == "match"
    exp = planted["expect"]
    if exp is None:
        assert code == 0 and res["ok"] and reader["status"] == "match"
        return
    assert code == 1 and reader["mismatched_pages"] == exp["pages"]
    assert reader["mismatch_ranges"] == [exp["positions"]] and reader["reuse"]["tier"] == exp["tier"]


# ---------------------------------------------------------------------------------------------
# vLLM: block tables. Prefix caching hands a request the very blocks another request filled (full
# blocks only, by block hash: the same block ids in both tables); the CPU offload connector loads
# blocks stored on the host by their hash into blocks freshly taken from the free queue.
# ---------------------------------------------------------------------------------------------

BS = 16  # vLLM's block size (TRITON_MLA)


def vllm_capture(path, kv_cache: torch.Tensor, tables: list, reqs: list, origin: list, tokens: bool = True) -> str:
    """A vLLM decode capture as the hook writes it: the kernel's block table, no kv_indices."""
    lens = [len(t) for t in reqs]
    M = max(len(t) for t in tables)
    table = torch.zeros(len(tables), M, dtype=torch.int32)  # padding: vLLM's null block 0
    for b, row in enumerate(tables):
        table[b, : len(row)] = torch.tensor(row, dtype=torch.int32)
    t = {"kv_buffer": kv_cache.flatten(0, 1).unsqueeze(1), "block_table": table, "seq_lens": torch.tensor(lens, dtype=torch.int32),
         "q": torch.randn(len(reqs), 1, D).to(torch.bfloat16)}  # fmt: skip
    if tokens:
        t["kv_token_ids"] = torch.tensor([x for r in reqs for x in r], dtype=torch.int64)
        t["kv_origin"] = torch.tensor([x for o in origin for x in o], dtype=torch.int8)
    meta = {"mode": "decode", "backend": "vllm_triton", "kv_lora_rank": DV, "qk_rope_head_dim": DR, "sm_scale": 0.1,
            "logit_cap": 0.0, "page_size": BS, "null_block": 0, "engine": "vllm", "layer_id": CAPTURED_LAYER,
            "rids": [f"vreq-{b}" for b in range(len(reqs))] if len(reqs) > 1 else ["cmpl-A"]}  # fmt: skip
    write_capture(path, t, meta)
    return str(path)


@pytest.mark.parametrize("fault", [None, "stale_block"])
def test_vllm_offloaded_blocks_loaded_into_new_blocks_are_paired_by_tokens(tmp_path, fault):
    g = torch.Generator().manual_seed(5)
    kv = torch.full((40, BS, D), math.nan).to(torch.bfloat16)  # vLLM's MLA kv_cache [num_blocks, block_size, D]
    free = (torch.randperm(39, generator=g) + 1).tolist()  # the free block queue (block 0: the null block)
    prompt = torch.randint(5, 30000, (80,), generator=g).tolist()
    a_blocks = [free.pop() for _ in range(5)]
    for i, blk in enumerate(a_blocks):
        kv[blk] = latent(prompt, CAPTURED_LAYER)[i * BS : (i + 1) * BS]
    cap_a = vllm_capture(tmp_path / "A.safetensors", kv.clone(), [a_blocks], [prompt], [[COMPUTED] * 80])
    cpu = {i: kv[blk].clone() for i, blk in enumerate(a_blocks)}  # the offload connector's CPU copies, by block
    for blk in a_blocks:  # A finished; its blocks are freed and reused
        kv[blk] = torch.randn(BS, D).to(torch.bfloat16)
    mine = torch.randint(5, 30000, (21,), generator=g).tolist()
    b_tokens = prompt[:64] + mine  # 4 full blocks hit in the CPU tier
    b_blocks = [free.pop() for _ in range(6)]
    for i in range(4):
        kv[b_blocks[i]] = cpu[i] if not (fault == "stale_block" and i == 1) else cpu[3]
    full = latent(b_tokens, CAPTURED_LAYER)
    for i in (4, 5):
        kv[b_blocks[i], : min(BS, len(b_tokens) - i * BS)] = full[i * BS : (i + 1) * BS]
    other = torch.randint(5, 30000, (30,), generator=g).tolist()
    o_blocks = [free.pop() for _ in range(2)]
    for i, blk in enumerate(o_blocks):
        kv[blk, : min(BS, 30 - i * BS)] = latent(other, CAPTURED_LAYER)[i * BS : (i + 1) * BS]
    cap_d = vllm_capture(tmp_path / "decode.safetensors", kv.clone(), [o_blocks, b_blocks], [other, b_tokens],
                         [[COMPUTED] * 30, [HOST] * 64 + [COMPUTED] * 21])  # fmt: skip
    res = diff_kv_files([cap_a], cap_d)
    b = res.request("vreq-1")
    assert res.pairing == "tokens" and b.positions_compared == 64 and b.reuse.unmatched == [(64, 85)]
    assert res.request("vreq-0").status == "decode_only"  # no capture holds its tokens: said, not dropped
    if fault is None:
        assert b.faithful
    else:
        assert b.mismatched_pages == [1] and b.reuse.tier == "host" and b.reuse.written_by[0].rid == "cmpl-A"
        assert "page 1" in b.summary and b.sources[0].text(b.rid).endswith("page 3")


@pytest.mark.parametrize("fault", ["none", "reload_corrupt_page"])
def test_disagg_pairs_a_reloaded_prefix_by_tokens_and_names_the_tier(tmp_path, capsys, fault):
    assert main(["synth-disagg", str(tmp_path), "--preset", "hicache-reload", "--fault", fault]) == 0
    capsys.readouterr()
    code = main(["disagg", str(tmp_path / "prefill"), "--decode", str(tmp_path / "decode"), "--json"])
    out = json.loads(capsys.readouterr().out)
    row = next(r for r in out["rows"] if r["rid"] == "reader-1")
    assert row["transfer"]["reuse"]["written_by"][0]["rid"] == "writer-0"  # paired although no prefill capture holds its rid
    other = next(r for r in out["rows"] if r["rid"] == "other-2")
    assert other["fault"] == "none"
    if fault == "none":
        assert code == 0 and row["fault"] == "none" and row["transfer"]["status"] == "faithful"
    else:
        assert code == 1 and row["fault"] == "transfer" and row["transfer"]["mismatched_pages"] == [3]
        assert "reloaded from the host tier" in row["sentence"] and "writer-0" in row["sentence"]


# ---------------------------------------------------------------------------------------------
# DeepSeek-V4: the window ring and the compressed (C4) cache of a reused prefix. A clean V4 pair
# from synth-disagg (its KV map laid out as SGLang's V4 pool pages it); this file's own code gives
# both sides token ids, renames the decode side's requests (their prefix came back under other
# rids, from the host tier) and corrupts one window page or one compressed page of one request.
# ---------------------------------------------------------------------------------------------


def _rewrite(path, edit) -> None:
    import safetensors
    from safetensors.torch import load_file, save_file

    with safetensors.safe_open(path, "pt") as f:
        md = dict(f.metadata())
    t = load_file(path)
    meta = json.loads(md["meta"])
    edit(t, meta)
    md["meta"] = json.dumps(meta)
    save_file(t, path, metadata=md)


@pytest.fixture(scope="module")
def v4_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("v4reload")
    assert main(["synth-disagg", str(root), "--preset", "disagg-v4", "--fault", "none"]) == 0
    return root


@pytest.mark.parametrize("fault", [None, "window", "compressed"])
def test_v4_window_ring_and_compressed_cache_of_a_reloaded_prefix_against_their_writer(v4_pair, tmp_path, fault):
    import shutil

    pre, dec = tmp_path / "writer.safetensors", tmp_path / "reader.safetensors"
    shutil.copy(v4_pair / "prefill" / "L2-R0-c0.safetensors", pre)
    shutil.copy(v4_pair / "decode" / "L2-R0-s0.safetensors", dec)
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(5, 30000, (n,), generator=g) for n in (600, 130, 1100, 45)]

    def tokens(extra: int, origin: int):
        def edit(t, meta):
            ptr = t["slot_indptr"].long()
            t["kv_token_ids"] = torch.cat([torch.cat([p, torch.randint(5, 30000, (int(ptr[b + 1] - ptr[b]) - p.numel(),), generator=g)])
                                           for b, p in enumerate(prompts)])  # fmt: skip
            t["kv_origin"] = torch.cat([torch.tensor([origin] * p.numel() + [COMPUTED] * (int(ptr[b + 1] - ptr[b]) - p.numel()))
                                        for b, p in enumerate(prompts)]).to(torch.int8)  # fmt: skip
            if extra:
                meta["rids"] = [f"reader-{b}" for b in range(len(prompts))]
                b, name, page_size, ptr_name, slots_name = ((2, "k_cache", 256, "slot_indptr", "slots") if fault == "window" else
                                                            (2, "extra_k_cache", 64, "extra_slot_indptr", "extra_slots"))  # fmt: skip
                if fault is not None:
                    s = t[slots_name][int(t[ptr_name][b]) : int(t[ptr_name][b + 1])].long()
                    held = torch.nonzero(s >= 0).flatten()
                    p = int(held[held % page_size == 0][0])  # the first whole page the cache holds
                    t[name][int(s[p]) // page_size] ^= 0x5A  # the page's bytes as they came back from the host
                    edit.position = p

        return edit

    edit_d = tokens(1, HOST)
    _rewrite(pre, tokens(0, COMPUTED))
    _rewrite(dec, edit_d)
    res = diff_kv_files([str(pre)], str(dec))
    assert res.pairing == "tokens"
    for b in range(4):
        for cache in ("window", "compressed"):
            e = res.request(f"reader-{b}", cache=cache)
            if b == 3 and cache == "compressed":
                continue
            assert e.reuse.written_by[0].rid == f"disagg-v4-r{b}"  # the writer, under its own rid
            if fault is None or b != 2 or cache != fault:
                assert e.faithful, (b, cache, e.summary)
    if fault is None:
        assert res.ok
        return
    e = res.request("reader-2", cache=fault)
    P = 256 if fault == "window" else 64
    assert not res.ok and e.first_mismatch == edit_d.position and e.mismatched_pages == [edit_d.position // P]
    assert e.reuse.tier == "host" and "host tier" in e.summary and "disagg-v4-r2" in e.summary


def test_sparse_row_tokens_without_the_kv_map_or_of_the_wrong_length_are_one_clear_error(v4_pair, tmp_path, capsys):
    import shutil

    bad = tmp_path / "bad.safetensors"
    shutil.copy(v4_pair / "decode" / "L2-R0-s0.safetensors", bad)
    _rewrite(bad, lambda t, meta: t.update(kv_token_ids=torch.zeros(t["slots"].numel() - 1, dtype=torch.int64)))
    code = main(["diff-kv", str(v4_pair / "prefill" / "L2-R0-c0.safetensors"), str(bad)])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "bad.safetensors" in err and "kv_token_ids" in err
    assert "like slots" in err

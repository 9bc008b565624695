"""The DSA indexer check (refmla.indexer): clean calls of SGLang's own indexer code and of a small
producer that follows DeepSeek's published model code agree; faults planted by the test's own
code are named with their detail; a wrong set names its entries with scores and ranks; bad input
is exit 2 with one line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import indexer_kit as kit
from refmla.capture import CaptureError
from refmla.compare import Tolerance
from refmla.context import ReplayOptions
from refmla.indexer.io import read_indexer
from refmla.indexer.judge import judge_indexer

V32 = dict(ratio=1, seq_lens=[150, 700, 1333, 2050])  # V3.2: one entry per token
V4C4 = dict(ratio=4, seq_lens=[500, 2051, 4099, 7000])  # V4 C4: entries = seq_len // 4
SHAPES = {"v32": V32, "v4c4": V4C4}


def judged(tmp_path, name="c.safetensors", backends=(), **kw):
    shape = SHAPES[kw.pop("shape", "v32")]
    kit.write(tmp_path / name, shape["seq_lens"], ratio=shape["ratio"], **kw)
    return judge_indexer(read_indexer(tmp_path / name), ReplayOptions(backends=list(backends), tol=Tolerance()))


@pytest.mark.parametrize("shape", ["v32", "v4c4"])
@pytest.mark.parametrize("kind", ["slots", "positions"])
def test_clean_sglang_fp8_calls_agree_and_its_torch_path_too(tmp_path, shape, kind):
    for seed in range(3):
        engines = ["sglang_indexer_torch", "vllm_indexer_torch"] if seed == 0 else []
        r = judged(tmp_path, backends=engines, shape=shape, seed=seed, kind=kind)
        assert r.verdict == "agree", r.diagnosis_text
        assert r.backends["observed"].status == "pass"
        for name in engines:  # the engines' own indexer code on the same inputs, judged by the reference
            assert r.backends[name].status == "pass", r.backends[name].reason


def test_an_engines_indexer_code_choosing_wrong_is_indexer_kernel(tmp_path, monkeypatch):
    from refmla.indexer import backends

    real = backends.BACKENDS["vllm_indexer_torch"]
    monkeypatch.setitem(backends.BACKENDS, "vllm_indexer_torch", lambda cap: real(cap).roll(1, dims=0))  # rows swapped
    r = judged(tmp_path, backends=["vllm_indexer_torch"], seed=2)
    assert r.diagnosis == "indexer_kernel" and r.backends["vllm_indexer_torch"].status == "fail"
    assert r.backends["observed"].status == "pass" and r.exit_code == 1


@pytest.mark.parametrize("shape", ["v32", "v4c4"])
def test_clean_bf16_calls_agree(tmp_path, shape):
    for seed in range(3):
        r = judged(tmp_path, shape=shape, seed=seed, bf16=True, kind="positions")
        assert r.verdict == "agree", r.diagnosis_text


FAULTS = [  # (fault, shape, bf16, hypothesis, detail that must be there)
    ("topk_stale", "v32", False, "topk_stale", {"source": "previous_step"}),
    ("topk_unwritten", "v4c4", False, "topk_unwritten", {"value": -1}),
    ("topk_future", "v32", False, "topk_future", {"past_bound": 3}),
    ("topk_off_by", "v32", False, "topk_off_by", {"by": 1, "unit": "positions"}),
    ("topk_off_by", "v4c4", True, "topk_off_by", {"by": 1, "unit": "positions"}),
    ("indexer_scale_not_applied", "v32", False, "indexer_scale_not_applied", {"scale": "k"}),
    ("indexer_scale_not_applied", "v4c4", False, "indexer_scale_not_applied", {"scale": "k"}),
    ("indexer_relu_omitted", "v32", False, "indexer_relu_omitted", {}),
    ("indexer_relu_omitted", "v4c4", True, "indexer_relu_omitted", {}),
    ("indexer_weights_ignored", "v32", True, "indexer_weights_ignored", {}),
    ("indexer_weights_ignored", "v4c4", False, "indexer_weights_ignored", {}),
    ("compress_ratio_wrong", "v4c4", False, "compress_ratio_wrong", {"ratio": 4, "positions_in": "tokens"}),
    ("topk_length_wrong", "v32", False, "topk_length_wrong", {}),
]


@pytest.mark.parametrize("fault,shape,bf16,hypothesis,detail", FAULTS)
def test_each_planted_fault_is_named_with_its_detail(tmp_path, fault, shape, bf16, hypothesis, detail):
    kind = "positions" if fault == "compress_ratio_wrong" or bf16 else "slots"
    r = judged(tmp_path, shape=shape, fault=fault, bf16=bf16, kind=kind)
    assert r.verdict == "diverged" and r.diagnosis == "indexer" and r.exit_code == 1
    e = r.backends["observed"].explanation
    assert e is not None and e.hypothesis == hypothesis, r.diagnosis_text
    assert {k: e.detail[k] for k in detail} == detail
    assert e.complete or fault.startswith("indexer_")  # a math mistake leaves a request with <= K entries alone
    assert hypothesis in r.diagnosis_text


def test_a_wrong_set_names_missing_and_extra_entries_with_scores_and_ranks(tmp_path):
    r = judged(tmp_path, fault="topk_off_by", kind="positions")
    sets = r.backends["observed"].info["index_sets"]
    v = next(f for f in sets["failing"] if f["expected"] == 256)  # a request with more entries than K
    assert v["n_missing"] > 0 and v["n_extra"] > 0
    assert all(e["rank"] <= 256 and e["score"] > v["kth_score"] for e in v["missing"])
    assert all(e["why"] == "past_bound" or e["score"] < v["kth_score"] for e in v["extra"])
    assert "missing" in r.diagnosis_text and "rank" in r.diagnosis_text


def test_a_near_tie_at_the_kth_entry_is_decided_by_score_not_position(tmp_path):
    tensors, meta = kit.call([1000], topk=64, seed=4, kind="positions", bf16=True)
    k, table = tensors["k_cache"].reshape(-1, kit.D), tensors["page_table"][0].long()
    row = table[torch.arange(1000) // kit.PS] * kit.PS + torch.arange(1000) % kit.PS  # position -> cache row
    s = (k[row].float() @ tensors["q"][0].float().T).relu() @ tensors["weights"][0]
    order = torch.argsort(s, descending=True)
    kth, nxt = int(order[63]), int(order[64])
    k[row[nxt]] = k[row[kth]]  # two entries with one score at the boundary: either belongs
    for chosen in (order[:64], torch.cat([order[:63], order[64:65]])):
        tensors["indices"] = chosen[None].int()
        kit.raw_write(tmp_path / "t.safetensors", tensors, meta)
        r = judge_indexer(read_indexer(tmp_path / "t.safetensors"), ReplayOptions(backends=[], tol=Tolerance()))
        assert r.verdict == "agree", r.diagnosis_text
    tensors["indices"] = torch.cat([order[:63], order[200:201]])[None].int()  # a clearly worse entry
    kit.raw_write(tmp_path / "t.safetensors", tensors, meta)
    assert judge_indexer(read_indexer(tmp_path / "t.safetensors"), ReplayOptions(backends=[], tol=Tolerance())).verdict == "diverged"


BAD = [  # (change, tensor or key named)
    (lambda t, m: t.update(indices=t["indices"][:, :10]), "tensor 'indices'"),
    (lambda t, m: t.update(page_table=t["page_table"] + 1000), "tensor 'page_table'"),
    (lambda t, m: t.pop("weights"), "tensor 'weights'"),
    (lambda t, m: m.update(compress_ratio=3), "meta key 'compress_ratio'"),
    (lambda t, m: t.update(k_cache=t["k_cache"][:, :100]), "tensor 'k_cache'"),
]


@pytest.mark.parametrize("change,named", BAD)
def test_bad_input_is_exit_2_with_one_line_naming_file_and_tensor(tmp_path, change, named):
    tensors, meta = kit.call([300, 900], seed=1, bf16=False)
    change(tensors, meta)
    path = tmp_path / "bad.safetensors"
    kit.raw_write(path, tensors, meta)
    with pytest.raises(CaptureError, match=named.replace("'", ".")):
        read_indexer(path)
    p = subprocess.run([sys.executable, "-m", "refmla", "replay", str(path)], capture_output=True, text=True, timeout=300)
    lines = [x for x in p.stderr.splitlines() if x.startswith("refmla:")]
    assert p.returncode == 2 and len(lines) == 1 and str(path) in lines[0] and named in lines[0], p.stderr
    assert "Traceback" not in p.stderr


def test_cli_replay_json_inspect_and_synth(tmp_path):
    run = lambda *a: subprocess.run([sys.executable, "-m", "refmla", *a], capture_output=True, text=True, timeout=300)  # noqa: E731
    for fault, code in (("none", 0), ("topk_stale", 1)):
        out = tmp_path / f"{fault}.safetensors"
        assert run("synth", str(out), "--preset", "indexer-v4-c4", "--fault", fault).returncode == 0
        p = run("replay", str(out), "--json", "--backend", "reference")
        doc = json.loads(p.stdout)
        assert p.returncode == code and doc["kind"] == "indexer"
        if code:
            assert doc["diagnosis"] == "indexer" and doc["backends"]["observed"]["explanation"]["hypothesis"] == fault
    p = run("inspect", str(tmp_path / "topk_stale.safetensors"), "--json")
    assert p.returncode == 0 and json.loads(p.stdout)["description"]["previous_step"] is True


@pytest.mark.parametrize("bf16", [False, True])
def test_the_reference_logits_are_deepseeks_formula_in_fp64_and_the_noise_covers_sglangs_bf16_dots(tmp_path, bf16):
    from refmla.indexer.reference import logits

    tensors, meta = kit.call([700, 1900], ratio=1, seed=9, bf16=bf16, kind="positions")
    kit.raw_write(tmp_path / "r.safetensors", tensors, meta)
    cap = read_indexer(tmp_path / "r.safetensors")
    for b, L in enumerate((700, 1900)):
        pages = tensors["page_table"][b]
        if bf16:
            k, ks = kit._rows(tensors["k_cache"].double(), pages, L), torch.ones(L, dtype=torch.float64)
        else:
            raw = tensors["k_cache"]  # [P, PS * (D + 4)]: a page's fp8 values, then its fp32 scales
            vals = raw[:, : kit.PS * kit.D].contiguous().view(torch.float8_e4m3fn).reshape(-1, kit.PS, kit.D)
            k = kit._rows(vals.double(), pages, L)
            ks = kit._rows(raw[:, kit.PS * kit.D :].contiguous().view(torch.float32).reshape(-1, kit.PS, 1).double(), pages, L)[:, 0]
        want = kit._deepseek(tensors["q"][b].double(), tensors["weights"][b].double(), k, ks, "none")
        got = logits(cap, b)
        assert torch.allclose(got.logits, want, rtol=1e-12, atol=1e-12)
        bf16_dots = (k.float() @ tensors["q"][b].float().T).to(torch.bfloat16).float().relu()  # SGLang's torch path
        sglang = (bf16_dots * tensors["weights"][b]).sum(1) * ks.float()
        assert float((sglang.double() - want).abs().max()) <= got.noise  # its own rounding is within the noise
        assert got.noise < 0.05 * float(want.abs().max())  # and the noise is no blanket


def test_slots_past_the_bound_and_slots_of_another_request_are_named_so(tmp_path):
    tensors, meta = kit.call([640, 1280], topk=256, seed=3, kind="slots", fault="topk_future")  # L a page multiple:
    other = int(tensors["indices"][1, 5])  # the future entries lie in the request's spare page
    tensors["indices"][0, 10] = other  # one of request 1's slots in request 0's row
    kit.raw_write(tmp_path / "s.safetensors", tensors, meta)
    r = judge_indexer(read_indexer(tmp_path / "s.safetensors"), ReplayOptions(backends=[], tol=Tolerance()))
    v0 = next(v for v in r.backends["observed"].info["index_sets"]["failing"] if v["request"] == 0)
    whys = [e["why"] for e in v0["extra"]]
    assert whys.count("past_bound") == 3 and whys.count("not_this_request") == 1
    assert [e["position"] for e in v0["extra"] if e["why"] == "past_bound"] == [640, 641, 642]
    assert next(e for e in v0["extra"] if e["why"] == "not_this_request")["value"] == other


@pytest.mark.parametrize("bf16", [False, True])
def test_the_reference_in_blocks_is_the_whole_requests_bits_on_any_number_of_workers(tmp_path, bf16, monkeypatch):
    from refmla.indexer import reference

    lens = [5000, 700, 64]  # 5000: several blocks and a last page of 8 entries; 64: one page exactly
    tensors, meta = kit.call(lens, ratio=1, seed=4, bf16=bf16, kind="positions")
    kit.raw_write(tmp_path / "b.safetensors", tensors, meta)
    cap = read_indexer(tmp_path / "b.safetensors")
    for b, L in enumerate(lens):  # the keys as stored, decoded here by torch's own fp8 conversion
        pages = tensors["page_table"][b]
        raw = tensors["k_cache"]
        if bf16:
            want_k = kit._rows(raw.double(), pages, L)
        else:
            vals = raw[:, : kit.PS * kit.D].contiguous().view(torch.float8_e4m3fn).reshape(-1, kit.PS, kit.D)
            want_k = kit._rows(vals.double(), pages, L)
        assert torch.equal(reference.keys(cap, b)[0], want_k)
    whole = [reference.logits(cap, b) for b in range(len(lens))]
    monkeypatch.setattr(reference, "BLOCK", 64)  # a page a block
    paged = [reference.logits(cap, b) for b in range(len(lens))]
    monkeypatch.setattr(reference, "BLOCK", 1 << 20)  # a request a block
    one = [reference.logits(cap, b) for b in range(len(lens))]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)  # two workers side by side
        filled = reference.Scores(cap).fill(range(len(lens)))
    finally:
        torch.set_num_threads(threads)
    for b in range(len(lens)):
        for other in (paged[b], one[b], filled[b]):
            assert torch.equal(other.logits, whole[b].logits) and other.noise == whole[b].noise


def test_an_fp8_q_scale_multiplies_the_exact_dot_once(tmp_path):
    from fractions import Fraction

    from refmla.indexer.reference import logits

    tensors, meta = kit.call([900], ratio=1, seed=5, kind="positions")
    H = tensors["q"].shape[1]
    g = torch.Generator().manual_seed(5)

    def codes(*shape):  # every e4m3 code but NaN, of either sign: subnormals to 448
        sign = (torch.rand(shape, generator=g) < 0.5).to(torch.uint8) << 7
        return torch.randint(0, 127, shape, generator=g, dtype=torch.uint8) | sign

    raw = tensors["k_cache"]  # keys and q of every magnitude: a dot's products span 2**-18 .. 2**17.6
    raw[:, : kit.PS * kit.D] = codes(raw.shape[0], kit.PS * kit.D)
    tensors["q"] = codes(*tensors["q"].shape).view(torch.float8_e4m3fn)
    qs = (1 + torch.rand(1, H, generator=g)).float()  # not powers of two: q * scale has 28 significant bits
    h = 3
    tensors["q_scale"] = qs
    tensors["weights"] = torch.zeros(1, H)
    tensors["weights"][0, h] = 1.0  # one head: the logit is that head's relu(scale * dot) times the key's scale
    kit.raw_write(tmp_path / "q.safetensors", tensors, meta)
    got = logits(read_indexer(tmp_path / "q.safetensors"), 0).logits
    pages = tensors["page_table"][0]
    vals = raw[:, : kit.PS * kit.D].contiguous().view(torch.float8_e4m3fn).reshape(-1, kit.PS, kit.D)
    k = kit._rows(vals.float(), pages, 900)
    ks = kit._rows(raw[:, kit.PS * kit.D :].contiguous().view(torch.float32).reshape(-1, kit.PS, 1), pages, 900)[:, 0]
    q = [Fraction(x) for x in tensors["q"][0, h].float().tolist()]
    scale = Fraction(float(qs[0, h]))
    for n in range(0, 900, 7):  # the exact dot in rationals, times the scale, rounded once; the key scale is 2**e
        dot = sum(a * Fraction(x) for a, x in zip(q, k[n].tolist()))
        want = max(0.0, float(dot * scale)) * float(ks[n])
        assert float(got[n]) == want, n

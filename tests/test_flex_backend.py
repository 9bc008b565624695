"""The ``flex`` backend: PyTorch's flex_attention compiled by Inductor, an independent correct kernel.

Fast tests check the packing (positions, the block mask from block ranges) without compiling;
the slow ones compile (seconds per shape bucket) and replay every preset through ``flex``: a
correct kernel that is not SGLang's must pass, and the same kernel fed wrong data must not.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from refmla.attended import Attended
from refmla.backends import NAMES, OPT_IN, get_backend
from refmla.backends.flex import BLOCK, Packed, bucket, compile_key, run_flex_mla
from refmla.capture import read_capture
from refmla.context import ReplayContext, ReplayOptions
from refmla.pipeline import backend_names, replay_file
from refmla.scales import Scales
from refmla.synthetic import PRESETS, preset, synth_capture

FLEX_OK, FLEX_WHY = get_backend("flex").availability()
needs_flex = pytest.mark.skipif(not FLEX_OK, reason=f"flex unavailable: {FLEX_WHY}")


def test_flex_is_opt_in_and_named():
    assert "flex" in OPT_IN and "flex" not in NAMES
    assert "flex" not in backend_names(ReplayOptions())
    assert backend_names(ReplayOptions(backends=["flex"])) == ["reference", "observed", "flex"]


def test_bucket_is_a_power_of_two_of_at_least_one_block():
    assert [bucket(n) for n in (0, 1, 128, 129, 1925, 4096)] == [BLOCK, BLOCK, 128, 256, 2048, 4096]


def _packed(spec):
    from refmla.synthetic import make_inputs

    t = make_inputs(spec)
    pk = Packed(t["q"], t["kv_buffer"], Attended.from_tensors(t), spec.scales(), "cpu")
    return t, pk


def _dense_mask(pk):
    qi = torch.arange(pk.NQ)[:, None]
    ki = torch.arange(pk.NK)[None, :]
    return (pk.kdoc[ki] == pk.qdoc[qi]) & (pk.kpos[ki] <= pk.qpos[qi])  # [NQ, NK]


@pytest.mark.parametrize("name", ["hostile", "kimi-k2-tp8-extend", "deepseek-v3-tp8"])
def test_packing_attends_exactly_each_requests_rows(name):
    """Row r = t * H + h attends the gathered rows of its request, causally in extend; the
    packed K holds kv_buffer[kv_indices] in order; no padding row is attended."""
    spec = preset(name)
    t, pk = _packed(spec)
    mask = _dense_mask(pk)
    lens = (t["kv_indptr"][1:] - t["kv_indptr"][:-1]).tolist()
    qo = t.get("qo_indptr", torch.arange(len(lens) + 1)).tolist()
    H, start = spec.num_heads, 0
    for b, L in enumerate(lens):
        n = qo[b + 1] - qo[b]
        for i, tok in enumerate(range(qo[b], qo[b + 1])):
            want = torch.zeros(pk.NK, dtype=torch.bool)
            want[start : start + L - n + i + 1] = True  # positions 0 .. L - n + i
            for h in range(H):
                assert torch.equal(mask[tok * H + h], want), (b, tok, h)
        start += L
    assert not mask[qo[-1] * H :].any()  # padded query rows read nothing
    rows = t["kv_buffer"][t["kv_indices"].long(), 0]
    assert torch.equal(pk.k[0, 0, : pk.nnz], rows) and not pk.k[0, 0, pk.nnz :].any()


@pytest.mark.parametrize("name", ["hostile", "kimi-k2-tp8-extend", "kimi-k2-tp8-page256"])
def test_block_mask_covers_every_attended_block(name):
    """The block ranges (built without a dense mask) include every block the dense mask touches."""
    _, pk = _packed(preset(name))
    bm = pk.block_mask()
    dense = _dense_mask(pk).reshape(pk.NQ // BLOCK, BLOCK, pk.NK // BLOCK, BLOCK).any(dim=(1, 3))
    counts, idx = bm.kv_num_blocks[0, 0], bm.kv_indices[0, 0]
    listed = torch.zeros_like(dense)
    for i in range(dense.shape[0]):
        listed[i, idx[i, : counts[i]].long()] = True
    assert bool((listed | ~dense).all())


# --------------------------------------------------------------------------------------------
# Compiled (slow: Inductor compiles each shape bucket once per process)
# --------------------------------------------------------------------------------------------

VARIANTS = {
    **{n: {} for n in PRESETS},
    "kimi-k2-tp8-fp8": dict(base="kimi-k2-tp8", kv_dtype=torch.float8_e4m3fn, k_scale=0.5, v_scale=0.5),
    "hostile-cap": dict(base="hostile", logit_cap=30.0),
}


def _synth(tmp_path, name: str, fault: str = "none"):
    over = dict(VARIANTS[name])
    spec = dataclasses.replace(preset(over.pop("base", name), **over), name=name)
    path = tmp_path / f"{name}.safetensors"
    synth_capture(path, spec, fault)
    return path


@needs_flex
@pytest.mark.slow
@pytest.mark.parametrize("name", list(VARIANTS))
def test_flex_passes_every_preset(tmp_path, name):
    rep = replay_file(_synth(tmp_path, name), ReplayOptions(backends=["flex"]))
    entry = rep.backends["flex"]
    if PRESETS.get(name) is not None and PRESETS[name].topk > 1:  # a tree: flex is causal only, and says so
        assert entry.status == "skipped" and "custom_mask" in entry.reason, entry.reason
        assert rep.verdict == "agree" and rep.exit_code == 0
        return
    assert entry.status == "pass", entry.reason
    assert rep.verdict == "agree" and rep.exit_code == 0
    assert entry.max_abs_err > 0  # a bf16 kernel, not the reference itself
    assert entry.info["compute_dtype"] == "bfloat16"
    want = {"split_schedule": "none", "q_round": "keep", "dequant": "to_q_dtype", "lse_base": "ln"}
    assert entry.info["arithmetic"] == want  # judged by its own arithmetic (issue 27; docs/contract.md section 5)


@needs_flex
@pytest.mark.slow
def test_flex_zero_length_requests_are_zero(tmp_path):
    cap = read_capture(_synth(tmp_path, "hostile"))
    m = cap.meta
    out, lse, _ = run_flex_mla(cap.q, cap.kv_buffer, cap.attended(), Scales(m.kv_lora_rank, m.sm_scale), device="cpu")
    empty = cap.seq_lens == 0
    assert bool(empty.any()) and torch.equal(out[empty], torch.zeros_like(out[empty]))
    assert torch.isfinite(out).all()


@needs_flex
@pytest.mark.slow
@pytest.mark.parametrize("wrong", ["sm_scale", "last_token", "cap"])
def test_flex_fed_wrong_data_fails(tmp_path, wrong):
    """The comparison is not blind to flex: the same kernel on wrong inputs is caught."""
    cap = read_capture(_synth(tmp_path, "kimi-k2-tp8"))
    ctx = ReplayContext(cap, ReplayOptions(backends=[]))
    m, b = cap.meta, 2
    indptr, idx = cap.kv_indptr.clone(), cap.kv_indices
    kw = dict(kv_lora_rank=m.kv_lora_rank, sm_scale=m.sm_scale, logit_cap=m.logit_cap)
    if wrong == "sm_scale":
        kw["sm_scale"] = m.sm_scale * 1.02
    elif wrong == "cap":
        kw["logit_cap"] = 5.0
    else:  # request b's last token dropped
        end = int(indptr[b + 1])
        idx = torch.cat([idx[: end - 1], idx[end:]])
        indptr[b + 1 :] -= 1
    out, _, _ = run_flex_mla(cap.q, cap.kv_buffer, Attended.token_index(indptr, idx), Scales(**kw), cap.out_dtype, "cpu")
    cmp = ctx.compare("flex", out)
    assert not cmp.passed
    if wrong == "last_token":
        assert cmp.worst.request == b


@pytest.mark.parametrize(
    "statuses,name,about",
    [
        ({"observed": "fail", "flex": "pass"}, "observed", ["observed"]),
        ({"observed": "pass", "flex": "fail"}, "decode", ["flex"]),
        ({"observed": "pass", "flex": "fail", "extend": "fail"}, "shared_input", ["flex", "extend"]),
    ],
)
def test_flex_counts_as_an_offline_decode_path(statuses, name, about):
    """A failing flex is never left undiagnosed; a passing flex clears the offline decode path."""
    from refmla.diagnosis import diagnose

    d = diagnose({"reference": "pass", **statuses})
    assert (d.name, d.backends) == (name, about)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU answer")
def test_flex_on_a_missing_gpu_is_skipped_with_the_reason(tmp_path):
    rep = replay_file(_synth(tmp_path, "hostile"), ReplayOptions(backends=["flex"], device="cuda"))
    entry = rep.backends["flex"]
    assert entry.status == "skipped" and "GPU" in entry.reason


@needs_flex
def test_a_guard_past_dynamos_recompile_limit_compiles_afresh(tmp_path, monkeypatch):
    """A recompile the shape key does not foresee ends in FailOnRecompileLimitHit under fullgraph
    (seen in the suite: V a view of K on one call, a tensor of its own on the next): the call is
    compiled afresh once, never a sweep's false `error`."""
    import refmla.backends.flex as flex

    cap = read_capture(_synth(tmp_path, "hostile"))
    m = cap.meta
    args = (cap.q, cap.kv_buffer, cap.attended(), Scales(m.kv_lora_rank, m.sm_scale))
    want, _, _ = run_flex_mla(*args, device="cpu")
    from torch._dynamo.exc import FailOnRecompileLimitHit  # the real one: the backend matches it by name
    real, calls = flex._call, []

    def once_past_the_limit(*a, **k):
        calls.append(len(flex._shapes))
        if len(calls) == 1:
            raise FailOnRecompileLimitHit("Hard failure due to fullgraph=True")
        return real(*a, **k)

    monkeypatch.setattr(flex, "_call", once_past_the_limit)
    got, _, _ = run_flex_mla(*args, device="cpu")
    assert len(calls) == 2 and calls[1] == 1 and torch.equal(got, want)  # caches emptied, then the one key
    monkeypatch.setattr(flex, "_call", lambda *a, **k: (_ for _ in ()).throw(ValueError("a kernel error")))
    with pytest.raises(ValueError):  # any other error is the kernel's, not retried
        run_flex_mla(*args, device="cpu")


def test_the_compile_key_tells_a_view_of_k_from_a_v_of_its_own():
    """V is K's first Dv columns when both scales are 1, a tensor of its own otherwise: dynamo
    guards on V's stride, so the key must too (else its recompiles go uncounted)."""
    att = Attended.token_index(torch.tensor([0, 3]), torch.arange(3))
    kv = torch.randn(3, 1, 576).to(torch.bfloat16)
    same = Packed(torch.randn(1, 2, 576).to(torch.bfloat16), kv, att, Scales(512, 0.1), "cpu")
    scaled = Packed(torch.randn(1, 2, 576).to(torch.bfloat16), kv, att, Scales(512, 0.1, v_scale=0.5), "cpu")
    assert same.v.stride() != scaled.v.stride()
    cpu = torch.device("cpu")
    assert compile_key(same, cpu, 0.0, False) != compile_key(scaled, cpu, 0.0, False)

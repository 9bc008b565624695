"""Speculative verify (issue 13): the format, its validation, the reference and its control.

A verify capture is several query tokens per request (the drafts, their KV already in the pool),
causal bottom-right or SGLang's tree ``custom_mask`` + ``mask_indptr``.
"""

from __future__ import annotations

import math

import pytest
import torch

from refmla import reference as ref
from refmla.attended import Attended
from refmla.capture import read_capture, write_capture
from refmla.cli import main
from refmla.control import mla_control
from refmla.scales import Scales
from refmla.synthetic import make_inputs, make_meta, preset
from tests.helpers import raw_write

SMALL = dict(seq_lens=(40, 9, 70), num_heads=4)


def _tree(**kw):
    spec = preset("kimi-k2-tp8-eagle-tree", **{**SMALL, **kw})
    return spec, make_inputs(spec), make_meta(spec)


def _chain(**kw):
    spec = preset("kimi-k2-tp8-mtp", **{**SMALL, **kw})
    return spec, make_inputs(spec), make_meta(spec)


def dense_masked(q, kv_buffer, kv_indptr, kv_indices, qo_indptr, visible, Dv, sm_scale):
    """Independent formulation: one [T, L] logit matrix per request, -inf where not visible."""
    T, H, _ = q.shape
    out = torch.zeros(T, H, Dv, dtype=torch.float64)
    for b in range(len(qo_indptr) - 1):
        q0, q1 = int(qo_indptr[b]), int(qo_indptr[b + 1])
        rows = kv_indices[int(kv_indptr[b]) : int(kv_indptr[b + 1])].long()
        K = kv_buffer[rows, 0].double()  # [L, D]
        s = torch.einsum("thd,ld->thl", q[q0:q1].double(), K) * sm_scale  # [n, H, L]
        s = s.masked_fill(~visible[b][:, None, :], -math.inf)
        out[q0:q1] = torch.einsum("thl,lv->thv", torch.softmax(s, -1), K[:, :Dv])
    return out


# --- reference ------------------------------------------------------------------------------


def test_chain_verify_is_causal_bottom_right():
    spec, t, _ = _chain()
    args = (t["q"], t["kv_buffer"], t["kv_indptr"], t["kv_indices"], t["qo_indptr"])
    out, lse = ref.mla_verify_ref(t["q"], t["kv_buffer"], Attended.token_index(*args[2:]), Scales(512, spec.sm_scale))
    n = spec.draft_token_num
    visible = [torch.arange(L)[None, :] <= torch.arange(L - n, L)[:, None] for L in spec.seq_lens]
    want = dense_masked(*args, visible, 512, spec.sm_scale)
    assert torch.allclose(out, want, atol=1e-12, rtol=0)
    assert torch.isfinite(lse).all()
    # query i of request b is a one-token decode over positions 0 .. L - n + i
    b, i = 2, 1
    L, q0 = spec.seq_lens[b], int(t["qo_indptr"][b])
    rows = t["kv_indices"][int(t["kv_indptr"][b]) : int(t["kv_indptr"][b]) + L - n + i + 1]
    dec, _ = ref.mla_decode_ref(t["q"][q0 + i : q0 + i + 1], t["kv_buffer"], Attended.token_index(torch.tensor([0, len(rows)]), rows), Scales(kv_lora_rank=512, sm_scale=spec.sm_scale))  # fmt: skip
    assert torch.equal(dec[0], out[q0 + i])


def test_tree_mask_is_applied_per_request():
    spec, t, _ = _tree()
    args = (t["q"], t["kv_buffer"], t["kv_indptr"], t["kv_indices"], t["qo_indptr"])
    sc = Scales(512, spec.sm_scale)
    out, _ = ref.mla_verify_ref(t["q"], t["kv_buffer"], Attended.from_tensors(t), sc)
    n, m = spec.draft_token_num, t["mask_indptr"]
    visible = [t["custom_mask"][int(m[b]) : int(m[b + 1])].view(n, L) for b, L in enumerate(spec.seq_lens)]
    assert any(not torch.equal(v[:, -n:], torch.ones(n, n, dtype=torch.bool).tril()) for v in visible), "a real tree"
    assert torch.allclose(out, dense_masked(*args, visible, 512, spec.sm_scale), atol=1e-12, rtol=0)
    chain, _ = ref.mla_verify_ref(t["q"], t["kv_buffer"], Attended.token_index(*args[2:]), sc)
    assert (out - chain).abs().max() > 1e-3, "the tree must differ from the chain on this input"


def test_control_follows_the_mask():
    spec, t, _ = _tree()
    sc, tree = Scales(512, spec.sm_scale), Attended.from_tensors(t)
    chain = Attended.token_index(t["kv_indptr"], t["kv_indices"], t["qo_indptr"])
    exp, _ = ref.mla_verify_ref(t["q"], t["kv_buffer"], tree, sc)
    masked, _ = mla_control(t["q"], t["kv_buffer"], tree, sc, torch.bfloat16)
    causal, _ = mla_control(t["q"], t["kv_buffer"], chain, sc, torch.bfloat16)
    assert (masked.double() - exp).abs().max() < 0.02
    assert (causal.double() - exp).abs().max() > 0.05


# --- format and validation --------------------------------------------------------------------


def test_verify_capture_round_trips(tmp_path):
    _, t, meta = _tree()
    path = tmp_path / "v.safetensors"
    write_capture(path, t, meta)
    cap = read_capture(path)
    assert cap.is_verify and not cap.is_decode
    assert cap.meta.draft_token_num == 4 and cap.meta.topk == 2
    assert torch.equal(cap.custom_mask, t["custom_mask"]) and torch.equal(cap.mask_indptr.long(), t["mask_indptr"].long())
    assert cap.request_of_row().tolist() == [0] * 4 + [1] * 4 + [2] * 4


def _verify_mutations(t, meta):
    """(name, tensors, meta, words in the one stderr line)"""
    qo = t["qo_indptr"].clone()
    qo[1] -= 1  # request 0 verifies 3 tokens, request 1 five
    yield "qlen != draft_token_num", dict(t, qo_indptr=qo), meta, "draft_token_num"
    qo = t["qo_indptr"].clone()
    qo[1] = 0  # request 0 has no query token
    yield "no query token", dict(t, qo_indptr=qo), dict(meta, draft_token_num=None), "no query token"
    big = dict(t, q=torch.cat([t["q"]] * 3), qo_indptr=t["qo_indptr"] * 3)
    yield "qlen > seq_len", big, dict(meta, draft_token_num=None), "seq_len"
    yield "mask without indptr", {k: v for k, v in t.items() if k != "mask_indptr"}, meta, "mask_indptr"
    yield "tree without mask", {k: v for k, v in t.items() if k not in ("custom_mask", "mask_indptr")}, meta, "custom_mask"
    yield "mask too short", dict(t, custom_mask=t["custom_mask"][:-1]), meta, "custom_mask"
    mp = t["mask_indptr"].clone()
    mp[1] += 1
    yield "mask size != n*L", dict(t, mask_indptr=mp), meta, "n*L"
    mp = t["mask_indptr"].clone()
    mp[0] = 1
    yield "mask_indptr[0]", dict(t, mask_indptr=mp), meta, "mask_indptr"
    yield "mask dtype", dict(t, custom_mask=t["custom_mask"].float()), meta, "custom_mask"
    cm = t["custom_mask"].clone()
    L0, n = int(t["seq_lens"][0]), 4
    cm[(n - 1) * L0 + L0 - 1] = False  # the last query of request 0 does not see itself
    yield "query blind to itself", dict(t, custom_mask=cm), meta, "does not see"
    yield "bad mode", t, dict(meta, mode="speculate"), "mode"
    yield "bad draft_token_num", t, dict(meta, draft_token_num=0), "draft_token_num"
    yield "missing qo_indptr", {k: v for k, v in t.items() if k != "qo_indptr"}, meta, "qo_indptr"


CASES = list(_verify_mutations(*_tree()[1:]))


@pytest.mark.parametrize("case", range(len(CASES)), ids=[c[0] for c in CASES])
def test_bad_verify_input_exits_2_with_one_line(tmp_path, capsys, case):
    name, t, meta, words = CASES[case]
    path = tmp_path / "bad.safetensors"
    raw_write(path, t, {k: v for k, v in meta.items() if v is not None})
    for argv in (["replay", str(path)], ["inspect", str(path)]):
        code = main(argv)
        err = capsys.readouterr().err.strip()
        assert code == 2, name
        assert len(err.splitlines()) == 1 and "Traceback" not in err, err
        assert str(path) in err and words in err, f"{name}: {err}"


def test_hidden_prefix_columns_are_a_warning(tmp_path):
    _, t, meta = _tree()
    cm = t["custom_mask"].clone()
    cm[0] = False  # request 0, query 0, position 0
    path = tmp_path / "w.safetensors"
    write_capture(path, dict(t, custom_mask=cm), meta)
    assert any("skip_prefix_custom_mask" in w for w in read_capture(path).warnings)


def test_a_mask_outside_verify_is_ignored_with_a_warning(tmp_path):
    spec = preset("kimi-k2-tp8-extend", seq_lens=(20, 9), num_heads=4)
    t, meta = make_inputs(spec), make_meta(spec)
    t["custom_mask"] = torch.zeros(3 * 29, dtype=torch.bool)  # nonsense: would hide everything
    t["mask_indptr"] = torch.tensor([0, 60, 87])
    path = tmp_path / "e.safetensors"
    write_capture(path, t, meta)
    cap = read_capture(path)
    assert any("ignored in extend mode" in w for w in cap.warnings)
    assert cap.mask_args() == {"custom_mask": None, "mask_indptr": None}

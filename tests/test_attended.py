"""refmla.attended: the one description of what each query row reads, checked against a dense
formulation written here from the conventions (docs/contract.md section 1), for every mode."""

from __future__ import annotations

import pytest
import torch

from refmla.attended import Attended

N = 23  # pool rows


def layout(seed: int, lens: list[int], n_new: list[int] | None = None):
    """kv_indptr, kv_indices (shuffled rows, one repeated), qo_indptr for the given lengths."""
    g = torch.Generator().manual_seed(seed)
    kv_indptr = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    kv_indices = torch.randint(0, N, (int(kv_indptr[-1]),), generator=g, dtype=torch.int32)
    if len(kv_indices) > 2:
        kv_indices[1] = kv_indices[0]  # a row listed twice is attended twice
    qo = None if n_new is None else torch.tensor([0, *torch.tensor(n_new).cumsum(0).tolist()], dtype=torch.int32)
    return kv_indptr, kv_indices, qo


def dense_expected(kv_indptr, kv_indices, qo_indptr=None, masks=None, n_pool=None) -> torch.Tensor:
    """[R, N] counts from the conventions, one loop per request: decode sees all; extend / chain verify:
    new token i of n sees positions 0..L-n+i; tree: the True entries of its mask row."""
    rows_out = []
    for b in range(len(kv_indptr) - 1):
        idx = kv_indices[int(kv_indptr[b]) : int(kv_indptr[b + 1])].tolist()
        L = len(idx)
        n = 1 if qo_indptr is None else int(qo_indptr[b + 1] - qo_indptr[b])
        for i in range(n):
            row = torch.zeros(n_pool or N, dtype=torch.long)
            for j, r in enumerate(idx):
                if qo_indptr is None:
                    seen = True
                elif masks is not None:
                    seen = bool(masks[b][i][j])
                else:
                    seen = j <= L - n + i
                row[r] += int(seen)
            rows_out.append(row)
    return torch.stack(rows_out) if rows_out else torch.zeros(0, n_pool or N, dtype=torch.long)


@pytest.mark.parametrize("lens", [[5, 0, 9, 1], [1], [0, 0]])
def test_decode_matches_dense(lens):
    kv_indptr, kv_indices, _ = layout(1, lens)
    att = Attended.token_index(kv_indptr, kv_indices)
    assert torch.equal(att.dense(N), dense_expected(kv_indptr, kv_indices))
    assert att.num_rows == att.num_groups == len(lens) and att.one_query_per_group
    assert torch.equal(att.seen_counts(), torch.tensor(lens))


@pytest.mark.parametrize("lens,n_new", [([5, 3, 9], [2, 3, 1]), ([4], [4]), ([7, 2], [1, 1])])
def test_extend_and_chain_verify_match_dense(lens, n_new):
    kv_indptr, kv_indices, qo = layout(2, lens, n_new)
    att = Attended.token_index(kv_indptr, kv_indices, qo)
    assert torch.equal(att.dense(N), dense_expected(kv_indptr, kv_indices, qo))
    assert att.num_rows == sum(n_new) and not att.one_query_per_group
    assert torch.equal(att.seen_counts(), att.dense(N).sum(1))
    assert torch.equal(att.query_indptr, qo.long())


def test_tree_verify_matches_dense():
    lens, n_new = [6, 4, 5], [3, 2, 3]
    kv_indptr, kv_indices, qo = layout(3, lens, n_new)
    g = torch.Generator().manual_seed(4)
    masks = [torch.rand(n, L, generator=g) < 0.5 for n, L in zip(n_new, lens)]
    flat = torch.cat([m.reshape(-1) for m in masks]).to(torch.uint8)  # SGLang's int8 buffer
    sizes = torch.tensor([m.numel() for m in masks])
    mask_indptr = torch.cat([torch.zeros(1, dtype=torch.long), sizes.cumsum(0)])
    want = dense_expected(kv_indptr, kv_indices, qo, masks)
    for mptr in (mask_indptr, None):  # given, or computed from n * L
        att = Attended.token_index(kv_indptr, kv_indices, qo, flat, mptr)
        assert torch.equal(att.dense(N), want)
        assert torch.equal(att.seen_counts(), want.sum(1))
        for b, m in enumerate(masks):
            assert torch.equal(att.visibility(b), m)


def test_rows_seen_is_the_dense_row_in_position_order():
    kv_indptr, kv_indices, qo = layout(5, [6, 3], [3, 1])
    att = Attended.token_index(kv_indptr, kv_indices, qo)
    # request 0 (rows 0..5) has 3 new tokens: token 0 sees positions 0..3
    assert att.rows_seen(0).tolist() == kv_indices[:4].tolist()
    assert att.rows_seen(2).tolist() == kv_indices[:6].tolist()
    assert att.rows_seen(3).tolist() == kv_indices[6:9].tolist()
    assert att.positions(0) == slice(0, 4)


def test_select_keeps_each_groups_rows_and_visibility():
    lens, n_new = [6, 4, 5], [3, 2, 3]
    kv_indptr, kv_indices, qo = layout(6, lens, n_new)
    masks = [torch.ones(n, L, dtype=torch.bool).tril(L - n) for n, L in zip(n_new, lens)]
    masks[1][0, 0] = False  # not the causal pattern
    flat = torch.cat([m.reshape(-1) for m in masks])
    att = Attended.token_index(kv_indptr, kv_indices, qo, flat)
    for a in (att, Attended.token_index(kv_indptr, kv_indices, qo)):
        sub = a.select([2, 0])
        dense = a.dense(N)
        assert torch.equal(sub.dense(N), dense[a.query_rows_of([2, 0])])
        assert a.query_rows_of([2, 0]) == [5, 6, 7, 0, 1, 2]


def test_two_pools_count_each_pool_apart():
    """pool_ids: one query reading two pools (a window cache and a compressed cache)."""
    att = Attended(
        indptr=torch.tensor([0, 4]), rows=torch.tensor([3, 4, 0, 3]), group_of_row=torch.tensor([0]),
        pool_ids=torch.tensor([0, 0, 1, 1], dtype=torch.int8),
    )  # fmt: skip
    assert att.dense(5, pool=0)[0].tolist() == [0, 0, 0, 1, 1]
    assert att.dense(5, pool=1)[0].tolist() == [1, 0, 0, 1, 0]
    assert att.group_pools(0).tolist() == [0, 0, 1, 1]


@pytest.mark.parametrize("name", ["hostile", "kimi-k2-tp8-extend", "kimi-k2-tp8-mtp", "kimi-k2-tp8-eagle-tree"])
def test_capture_builds_it_once_and_again_when_an_index_changes(tmp_path, name):
    from refmla.capture import read_capture
    from refmla.synthetic import preset, synth_capture

    path = tmp_path / "c.safetensors"
    synth_capture(path, preset(name, num_heads=2))
    cap = read_capture(path)
    att = cap.attended()
    assert cap.attended() is att  # built once by the reader
    tree = cap.is_verify and cap.custom_mask is not None
    masks = None
    if tree:
        mp, qo, ip = cap.mask_indptr.long(), cap.qo_indptr.long(), cap.kv_indptr.long()
        masks = [
            (cap.custom_mask[int(mp[b]) : int(mp[b + 1])] != 0).view(int(qo[b + 1] - qo[b]), int(ip[b + 1] - ip[b]))
            for b in range(cap.batch_size)
        ]  # fmt: skip
    qo = None if cap.is_decode else cap.qo_indptr
    n_pool = cap.kv_buffer.shape[0]
    assert torch.equal(att.dense(n_pool), dense_expected(cap.kv_indptr, cap.kv_indices, qo, masks, n_pool))
    assert att.has_mask == tree
    assert torch.equal(cap.request_of_row(), att.group_of_row)
    cap.kv_indices[0] = (cap.kv_indices[0] + 1) % n_pool  # changed in place: rebuilt
    assert cap.attended() is not att and int(cap.attended().rows[0]) == int(cap.kv_indices[0])


def test_capture_scales_is_the_dataclass(tmp_path):
    from refmla.capture import read_capture
    from refmla.scales import Scales
    from refmla.synthetic import preset, synth_capture

    synth_capture(tmp_path / "c.safetensors", preset("hostile", logit_cap=30.0))
    sc = read_capture(tmp_path / "c.safetensors").scales()
    assert isinstance(sc, Scales) and sc.logit_cap == 30.0 and sc.but(v_scale=2.0).v_scale == 2.0


def test_tree_visibility_of_a_chain_is_causal_and_a_tree_sees_only_its_ancestors():
    from refmla.attended import tree_visibility

    L, n = 7, 4
    chain = tree_visibility(L, [-1, 0, 1, 2])
    assert torch.equal(chain, torch.arange(L)[None, :] <= (L - n + torch.arange(n))[:, None])
    tree = tree_visibility(L, [-1, 0, 0, 1])  # drafts 1 and 2 both children of 0; 3 of 1
    assert tree[:, : L - n].all() and tree[2, L - n :].tolist() == [True, False, True, False]
    assert tree[3, L - n :].tolist() == [True, True, False, True]
    att = Attended.token_index(torch.tensor([0, L]), torch.arange(L), torch.tensor([0, n]), tree.reshape(-1))
    assert not att.is_bottom_right_causal() and Attended.token_index(
        torch.tensor([0, L]), torch.arange(L), torch.tensor([0, n]), chain.reshape(-1)
    ).is_bottom_right_causal()


def test_the_reference_refuses_two_pools_until_their_gather_exists():
    from refmla import reference as ref
    from refmla.control import mla_control
    from refmla.scales import Scales

    att = Attended(indptr=torch.tensor([0, 2]), rows=torch.tensor([0, 1]), group_of_row=torch.tensor([0]),
                   pool_ids=torch.tensor([0, 1], dtype=torch.int8))  # fmt: skip
    q, kv, sc = torch.randn(1, 2, 8), torch.randn(2, 1, 8), Scales(4, 0.1)
    for fn in (ref.mla_ref, ref.mla_verify_ref, ref.mla_decode_ref):
        with pytest.raises(ValueError, match="pool_ids"):
            fn(q, kv, att, sc)
    with pytest.raises(ValueError, match="pool_ids"):
        mla_control(q, kv, att, sc, torch.bfloat16)

"""STAND-IN for ``aiter.mla`` (tests only). Not a kernel.

Each function checks that its arguments follow aiter's conventions, raises ContractViolation
naming the first one that does not, records the call in CALLS, and writes the documented result,
computed with refmla's fp64 reference, into ``o``:

    mla_decode_fwd   q [S, Hk, D] (Hk a multiple of 16 in 16..128), kv_buffer [pages, page_size, 1, D],
                     o [S, Hk, Dv]; qo_indptr (one token per request: arange), kv_indptr over pages,
                     kv_indices page ids, kv_last_page_lens (1..page_size), all int32; max_seqlen_q an
                     int (> 1: MTP verify, qo_indptr over several tokens, causal bottom-right inside
                     each request, as mla_prefill_fwd); page_size == kv_buffer.shape[1], nhead_kv == 1 (v0.1.11 signature, where
                     page_size and nhead_kv come before sm_scale). Position j of request b is slot
                     kv_indices[kv_indptr[b] + j // P] * P + j % P of the flattened pool.
                     Persistent mode (work_meta_data given): aiter.ops.attention.check_persistent
                     (the six buffers filled by get_mla_metadata_v1 for this batch and heads).
    mla_decode_fwd_v0_1_10   the same before v0.1.11: no page_size / nhead_kv (read from the shape)
    mla_prefill_fwd  the same arguments, qo_indptr over several new tokens, causal bottom-right
"""

from __future__ import annotations

import torch

from aiter.ops.attention import ContractViolation, check_persistent
from refmla import reference as ref
from refmla.attended import Attended
from refmla.paged import page_to_token
from refmla.scales import Scales

CALLS: list[dict] = []  # one record per call, newest last
Q_DTYPES = (torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e4m3fnuz)
O_DTYPES = (torch.bfloat16, torch.float16)


def _need(ok: bool, what: str) -> None:
    if not ok:
        raise ContractViolation(what)


def _index(name: str, t, n=None) -> None:
    _need(isinstance(t, torch.Tensor), f"{name} must be a tensor, got {type(t).__name__}")
    _need(t.dtype == torch.int32, f"{name} must be int32, got {t.dtype}")
    _need(t.dim() == 1, f"{name} must be 1-D, got shape {list(t.shape)}")
    _need(t.is_contiguous(), f"{name} must be contiguous")
    if n is not None:
        _need(t.shape[0] == n, f"{name} has {t.shape[0]} entries, expected {n}")


def _check(q, kv_buffer, o, qo_indptr, kv_indptr, kv_indices, kv_last_page_lens, max_seqlen_q,
           page_size, nhead_kv, sm_scale, logit_cap, q_scale, kv_scale, decode: bool) -> dict:  # fmt: skip
    _need(q.dim() == 3, f"q must be [tokens, heads, D], got {list(q.shape)}")
    S, Hk, D = q.shape
    _need(q.dtype in Q_DTYPES, f"q dtype {q.dtype} not taken")
    _need(q.is_contiguous(), "q must be contiguous")
    _need(Hk % 16 == 0 and 16 <= Hk <= 128, f"q has {Hk} heads: aiter MLA wants a multiple of 16 in 16..128 (pad)")
    _need(kv_buffer.dim() == 4, f"kv_buffer must be [pages, page_size, nhead_kv, D], got {list(kv_buffer.shape)}")
    _need(kv_buffer.shape[3] == D, f"kv_buffer head dim {kv_buffer.shape[3]} != q's {D}")
    _need(kv_buffer.shape[2] == 1, f"kv_buffer has {kv_buffer.shape[2]} kv heads, MLA has 1")
    _need(page_size == kv_buffer.shape[1], f"page_size {page_size} != kv_buffer.shape[1] {kv_buffer.shape[1]}")
    _need(nhead_kv == 1, f"nhead_kv {nhead_kv} != 1")
    _need(o.dim() == 3 and o.shape[0] == S and o.shape[1] == Hk, f"o shape {list(o.shape)} != [{S}, {Hk}, Dv]")
    _need(o.dtype in O_DTYPES, f"o dtype {o.dtype} not taken")
    _need(0 < o.shape[2] < D, f"o's Dv {o.shape[2]} must be the latent part of D {D}")
    B = kv_indptr.shape[0] - 1
    _index("qo_indptr", qo_indptr, B + 1)
    _index("kv_indptr", kv_indptr, B + 1)
    _index("kv_indices", kv_indices)
    _index("kv_last_page_lens", kv_last_page_lens, B)
    _need(
        isinstance(max_seqlen_q, int) and not isinstance(max_seqlen_q, bool),
        f"max_seqlen_q must be an int, got {type(max_seqlen_q).__name__}",
    )
    qlen = qo_indptr[1:] - qo_indptr[:-1]
    _need(int(qo_indptr[0]) == 0 and int(qo_indptr[-1]) == S, f"qo_indptr must run 0..{S}, got {qo_indptr.tolist()}")
    _need(
        bool((qlen >= 0).all()) and (int(qlen.max()) if B else 0) <= max_seqlen_q, "qo_indptr steps exceed max_seqlen_q"
    )
    if decode:
        _need(max_seqlen_q == 1, f"decode: max_seqlen_q must be 1, got {max_seqlen_q}")
        _need(
            torch.equal(qo_indptr.cpu(), torch.arange(B + 1, dtype=torch.int32)),
            "decode: qo_indptr must be arange(B + 1)",
        )
    npages = kv_indptr[1:] - kv_indptr[:-1]
    _need(int(kv_indptr[0]) == 0 and bool((npages >= 0).all()), "kv_indptr must start at 0 and be monotone")
    _need(
        int(kv_indptr[-1]) == kv_indices.shape[0],
        f"kv_indptr[-1] {int(kv_indptr[-1])} != len(kv_indices) {kv_indices.shape[0]}",
    )
    if kv_indices.numel():
        _need(int(kv_indices.min()) >= 0 and int(kv_indices.max()) < kv_buffer.shape[0],
              f"kv_indices out of range for {kv_buffer.shape[0]} pages")  # fmt: skip
    last = kv_last_page_lens
    used = npages > 0
    _need(
        bool(((last[used] >= 1) & (last[used] <= page_size)).all()),
        f"kv_last_page_lens must be 1..{page_size}, got {last.tolist()}",
    )
    _need(isinstance(sm_scale, float) and sm_scale > 0, f"sm_scale must be a positive float, got {sm_scale!r}")
    assert logit_cap <= 0, f"{logit_cap=} is not support yet"  # as aiter itself asserts
    for name, sc in (("q_scale", q_scale), ("kv_scale", kv_scale)):
        _need(
            sc is None or (isinstance(sc, torch.Tensor) and sc.dtype == torch.float32),
            f"{name} must be None or an fp32 tensor",
        )
    devices = {t.device for t in (q, kv_buffer, o, qo_indptr, kv_indptr, kv_indices, kv_last_page_lens)}
    _need(len(devices) == 1, f"tensors on several devices: {devices}")
    return {"B": B, "S": S, "heads": Hk, "D": D, "Dv": o.shape[2], "page_size": page_size}


def _semantics(
    q, kv_buffer, o, qo_indptr, kv_indptr, kv_indices, kv_last_page_lens, page_size, sm_scale, kv_scale, decode
):
    tok_indptr, tok_indices = page_to_token(
        kv_indptr.long().cpu(), kv_indices.long().cpu(), kv_last_page_lens.cpu(), page_size
    )
    flat = kv_buffer.reshape(-1, 1, kv_buffer.shape[-1]).cpu()  # [pages * P, 1, D]
    s = float(kv_scale) if kv_scale is not None else 1.0
    kw = dict(kv_lora_rank=o.shape[2], sm_scale=sm_scale, k_scale=s, v_scale=s)
    if decode:
        out, _ = ref.mla_decode_ref(q.cpu(), flat, Attended.token_index(tok_indptr, tok_indices), Scales(**kw))
    else:
        out, _ = ref.mla_verify_ref(q.cpu(), flat, Attended.token_index(tok_indptr, tok_indices, qo_indptr.long().cpu()), Scales(**kw))
    o.copy_(out.to(o.dtype))


def mla_decode_fwd(
    q,
    kv_buffer,
    o,
    qo_indptr,
    kv_indptr,
    kv_indices,
    kv_last_page_lens,
    max_seqlen_q,
    page_size=1,
    nhead_kv=1,
    sm_scale=None,
    logit_cap=0.0,
    num_kv_splits=None,
    num_kv_splits_indptr=None,
    work_meta_data=None,
    work_indptr=None,
    work_info_set=None,
    reduce_indptr=None,
    reduce_final_map=None,
    reduce_partial_map=None,
    q_scale=None,
    kv_scale=None,
    intra_batch_mode=False,
    return_logits=False,
    return_lse=False,
):
    """v0.1.11 and later: page_size and nhead_kv before sm_scale; persistent when work_meta_data is given."""
    if sm_scale is None:
        sm_scale = 1.0 / (q.shape[-1] ** 0.5)
    facts = _check(q, kv_buffer, o, qo_indptr, kv_indptr, kv_indices, kv_last_page_lens, max_seqlen_q,
                   page_size, nhead_kv, sm_scale, logit_cap, q_scale, kv_scale, decode=max_seqlen_q == 1)  # fmt: skip
    buffers = dict(work_meta_data=work_meta_data, work_indptr=work_indptr, work_info_set=work_info_set,
                   reduce_indptr=reduce_indptr, reduce_final_map=reduce_final_map,
                   reduce_partial_map=reduce_partial_map)  # fmt: skip
    mode, plan = "non_persistent", None
    if work_meta_data is not None:
        mode = "persistent"
        plan = check_persistent(q, qo_indptr, kv_indptr, kv_last_page_lens, buffers, intra_batch_mode, num_kv_splits)
    fp8_q = q.dtype.itemsize == 1
    _need(not fp8_q or q_scale is not None, "an fp8 q needs q_scale")
    _need(kv_buffer.dtype.itemsize != 1 or kv_scale is not None, "an fp8 kv_buffer needs kv_scale")
    CALLS.append({"fn": "mla_decode_fwd", "signature": "v0.1.11", "mode": mode, "q": q,
                  "kv_buffer_shape": list(kv_buffer.shape), "kv_indices": kv_indices,
                  "kv_last_page_lens": kv_last_page_lens, "intra_batch_mode": intra_batch_mode,
                  "num_kv_splits": num_kv_splits, "q_scale": q_scale, "kv_scale": kv_scale,
                  "buffer_shapes": {k: list(v.shape) for k, v in buffers.items() if v is not None},
                  "metadata": plan, **facts})  # fmt: skip
    q_math = q.double() * float(q_scale) if fp8_q else q
    _semantics(q_math, kv_buffer, o, qo_indptr, kv_indptr, kv_indices, kv_last_page_lens, page_size, sm_scale,
               kv_scale, max_seqlen_q == 1)  # max_seqlen_q > 1: MTP verify, causal bottom-right inside each request
    return o.view(o.shape[0], 1, o.shape[1], o.shape[2]), None


def mla_decode_fwd_v0_1_10(
    q,
    kv_buffer,
    o,
    qo_indptr,
    kv_indptr,
    kv_indices,
    kv_last_page_lens,
    max_seqlen_q,
    sm_scale=None,
    logit_cap=0.0,
    num_kv_splits=None,
):
    """Before v0.1.11: no page_size / nhead_kv; both are read from kv_buffer's shape."""
    if sm_scale is None:
        sm_scale = 1.0 / (q.shape[-1] ** 0.5)
    page_size, nhead_kv = kv_buffer.shape[1], kv_buffer.shape[2]
    facts = _check(q, kv_buffer, o, qo_indptr, kv_indptr, kv_indices, kv_last_page_lens, max_seqlen_q,
                   page_size, nhead_kv, sm_scale, logit_cap, None, None, decode=max_seqlen_q == 1)  # fmt: skip
    CALLS.append({"fn": "mla_decode_fwd", "signature": "v0.1.10", "q": q, "kv_buffer_shape": list(kv_buffer.shape),
                  "kv_indices": kv_indices, "kv_last_page_lens": kv_last_page_lens, **facts})  # fmt: skip
    _semantics(q, kv_buffer, o, qo_indptr, kv_indptr, kv_indices, kv_last_page_lens, page_size, sm_scale, None,
               max_seqlen_q == 1)
    return o.view(o.shape[0], 1, o.shape[1], o.shape[2]), None


def mla_prefill_fwd(
    q,
    kv_buffer,
    o,
    qo_indptr,
    kv_indptr,
    kv_indices,
    kv_last_page_lens,
    max_seqlen_q,
    sm_scale=None,
    logit_cap=0.0,
    num_kv_splits=None,
):
    """Absorbed-MLA prefill over the cache: new tokens are the last qo_len positions, causal."""
    if sm_scale is None:
        sm_scale = 1.0 / (q.shape[-1] ** 0.5)
    page_size = kv_buffer.shape[1]
    facts = _check(q, kv_buffer, o, qo_indptr, kv_indptr, kv_indices, kv_last_page_lens, max_seqlen_q,
                   page_size, kv_buffer.shape[2], sm_scale, logit_cap, None, None, decode=False)  # fmt: skip
    CALLS.append({"fn": "mla_prefill_fwd", "q": q, **facts})
    _semantics(q, kv_buffer, o, qo_indptr, kv_indptr, kv_indices, kv_last_page_lens, page_size, sm_scale, None, False)
    return o, None

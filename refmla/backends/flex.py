"""The ``flex`` backend: PyTorch's ``flex_attention`` compiled by Inductor -- an independent kernel.

Not SGLang's, not aiter's, not refmla's: a compiled kernel refmla must pass without a false alarm
(a correct kernel that rounds its own way). On CPU Inductor generates C++ (gcc); on a GPU, Triton.
The first compile of a shape takes seconds (tens on a cold cache); the compiled function is kept
per process and shapes are padded to a few buckets, so a process compiles a handful of times.

Layout. MLA has one KV head that every query head reads, so the heads fold into the query length
and every request packs into one sequence ("document masking"):

    rows    = kv_buffer[kv_indices]                   [nnz, D]   gathered via kv_indices, in position order
    K       = rows (pad to NK)                        [1, 1, NK, D]   D = 576, q.k over all of it
    V       = rows[:, :Dv]                            [1, 1, NK, Dv]  Dv = kv_lora_rank
    Q       = q as [T * H] rows, token-major (pad NQ) [1, 1, NQ, D]
    mask    = same request and key position <= query position (causal, bottom-right: decode sees all)
    score   = cap * tanh(s * sm_scale / cap)  or  s * sm_scale           (score_mod)

Why gather instead of masking the pool in place: the pool holds rows no request attends (free
pages, a last page's tail) that may be NaN or garbage, and a masked score still multiplies its V row
(0 * NaN = NaN) -- a kernel that read those rows would be wrong, so this one does not. Gathering is
also what gives each key its position, which the causal mask of an extend capture needs.

The block mask is built from block ranges directly (the requests are contiguous in both Q and K),
never as a dense [NQ, NK] boolean, so large captures cost O(blocks).

Precision: flex computes in q's dtype (bf16) with fp32 softmax statistics and rounds the output
once. A pool narrower than q (fp8) is dequantized into q's dtype (K = kv * k_scale, V = kv[:, :Dv]
* v_scale, each rounded to bf16), as fp8 MLA kernels dequantize tiles into bf16. lse: Inductor's
CPU template does not return it (``return_lse`` is not supported there); on a GPU it does.
"""

from __future__ import annotations

import shutil
import time
from typing import Optional

import torch

from refmla.arithmetic import FLEX_ATTENTION
from refmla.attended import Attended
from refmla.backends.base import Backend, BackendResult, BackendUnavailable
from refmla.capture import Capture
from refmla.options import ReplayOptions
from refmla.scales import Scales

BLOCK = 128  # flex_attention's default sparse block size (rows of Q and K per tile)
_COMPUTE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

_compiled: dict[str, object] = {}  # device type -> torch.compile(flex_attention)
_shapes: set = set()  # (device type, NQ, NK, dtype, capped) compiled so far in this process


def bucket(n: int) -> int:
    """Padded length: the next power of two, at least one block (few shapes, few compiles)."""
    return max(BLOCK, 1 << (max(int(n), 1) - 1).bit_length())


def _flex_fn(device_type: str):
    """torch.compile(flex_attention) for this device type, compiled once per shape per process."""
    if device_type not in _compiled:
        from torch.nn.attention.flex_attention import flex_attention

        _compiled[device_type] = torch.compile(flex_attention, dynamic=False, fullgraph=True)
    return _compiled[device_type]


def _guard_recompiles(key: tuple) -> None:
    """Past dynamo's recompile limit a compiled function silently runs eagerly (the math path, not
    a compiled kernel); reset dynamo's caches before that happens, so every call is compiled."""
    if key in _shapes:
        return
    cfg = torch._dynamo.config
    limit = int(getattr(cfg, "recompile_limit", getattr(cfg, "cache_size_limit", 8)))
    if len(_shapes) + 1 >= limit:
        _reset_compiled()
    _shapes.add(key)


def _reset_compiled() -> None:
    """Dynamo's caches and ours emptied: the next call compiles afresh."""
    torch._dynamo.reset()
    _shapes.clear()
    _compiled.clear()


# --------------------------------------------------------------------------------------------
# Packing: the capture as one masked sequence
# --------------------------------------------------------------------------------------------


class Packed:
    """Q, K, V as one sequence and the per-row bookkeeping the mask reads (all on ``device``)."""

    def __init__(self, q: torch.Tensor, kv_buffer: torch.Tensor, att: Attended, sc: Scales, device):
        T, H, D = q.shape
        G = att.num_groups
        lens = att.lengths()  # [G]
        self.T, self.H, self.Dv = T, H, int(sc.kv_lora_rank)
        self.nnz = int(lens.sum())
        self.NQ, self.NK = bucket(T * H), bucket(self.nnz)
        self.dtype = self._compute_dtype(q.dtype, kv_buffer.dtype)
        keys = att.rows[int(att.indptr[0]) : int(att.indptr[-1])]  # [nnz] every group's rows, one after another
        rows = kv_buffer[:, 0].index_select(0, keys.to(kv_buffer.device))  # [nnz, D]
        self.k, self.v = self._kv(rows.to(device), sc.k_scale, sc.v_scale, D)
        self.q = torch.zeros(1, 1, self.NQ, D, dtype=self.dtype, device=device)  # [1, 1, NQ, D]
        self.q[0, 0, : T * H] = q.to(device, self.dtype).reshape(T * H, D)
        req_of_key = torch.repeat_interleave(torch.arange(G), lens)  # [nnz]
        pos_of_key = torch.arange(self.nnz) - torch.repeat_interleave(att.indptr[:-1] - att.indptr[0], lens)  # [nnz]
        req_of_tok = att.group_of_row  # [T]
        pos_of_tok = att.seen_counts() - 1  # [T] a query row sees its group's positions 0..pos (causal prefix)
        self.kdoc = _padded(req_of_key, self.NK, -1, device)  # [NK] padding matches no query
        self.kpos = _padded(pos_of_key, self.NK, 0, device)
        self.qdoc = _padded(req_of_tok.repeat_interleave(H), self.NQ, -2, device)  # [NQ] padding matches no key
        self.qpos = _padded(pos_of_tok.repeat_interleave(H), self.NQ, -1, device)
        self.key_span = _spans(lens, self.NK)  # [B, 2] key rows [start, end) of each request
        self.req_of_qrow = req_of_tok.repeat_interleave(H)  # [T * H]

    def _compute_dtype(self, q_dtype: torch.dtype, kv_dtype: torch.dtype) -> torch.dtype:
        dt = q_dtype if kv_dtype.itemsize == 1 else torch.promote_types(q_dtype, kv_dtype)
        if dt not in _COMPUTE_DTYPES:
            raise BackendUnavailable(f"flex_attention computes in bf16 / fp16 / fp32, not {dt} "
                                     f"(q {q_dtype}, pool {kv_dtype})")
        return dt

    def _kv(self, rows: torch.Tensor, k_scale: float, v_scale: float, D: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K [1, 1, NK, D] and V [1, 1, NK, Dv] in the compute dtype; scales dequantized into them."""
        k = torch.zeros(1, 1, self.NK, D, dtype=self.dtype, device=rows.device)
        if k_scale == 1.0 and v_scale == 1.0:
            k[0, 0, : self.nnz] = rows.to(self.dtype)  # exact: the compute dtype is at least as wide
            return k, k[..., : self.Dv]
        k[0, 0, : self.nnz] = (rows.float() * k_scale).to(self.dtype)
        v = torch.zeros(1, 1, self.NK, self.Dv, dtype=self.dtype, device=rows.device)
        v[0, 0, : self.nnz] = (rows[:, : self.Dv].float() * v_scale).to(self.dtype)
        return k, v

    def block_mask(self):
        """The BlockMask from block ranges: query block i reads the key blocks of the requests its
        rows belong to (contiguous in K), all as partial blocks that mask_mod refines."""
        from torch.nn.attention.flex_attention import BlockMask

        nq, nk = self.NQ // BLOCK, self.NK // BLOCK
        counts = torch.zeros(nq, dtype=torch.int32)
        idx = torch.zeros(nq, nk, dtype=torch.int32)
        for i in range(nq):
            reqs = self.req_of_qrow[i * BLOCK : (i + 1) * BLOCK]
            if not len(reqs):
                continue
            start, end = int(self.key_span[reqs.min(), 0]), int(self.key_span[reqs.max(), 1])
            if end <= start:
                continue
            lo, hi = start // BLOCK, -(-end // BLOCK)
            counts[i] = hi - lo
            idx[i, : hi - lo] = torch.arange(lo, hi, dtype=torch.int32)
        dev = self.q.device
        kdoc, kpos, qdoc, qpos = self.kdoc, self.kpos, self.qdoc, self.qpos

        def mask_mod(b, h, q_idx, kv_idx):
            return (kdoc[kv_idx] == qdoc[q_idx]) & (kpos[kv_idx] <= qpos[q_idx])

        return BlockMask.from_kv_blocks(counts[None, None].to(dev), idx[None, None].to(dev), BLOCK_SIZE=BLOCK,
                                        mask_mod=mask_mod, seq_lengths=(self.NQ, self.NK))  # fmt: skip


def _padded(x: torch.Tensor, n: int, fill: int, device) -> torch.Tensor:
    out = torch.full((n,), fill, dtype=torch.int32)
    out[: len(x)] = x.to(torch.int32)
    return out.to(device)


def _spans(lens: torch.Tensor, NK: int) -> torch.Tensor:
    """[B, 2] start and end of each request's keys in the packed K."""
    ends = torch.cumsum(lens, 0)
    return torch.stack([ends - lens, ends], dim=1) if len(lens) else torch.zeros(0, 2, dtype=torch.long)


def _score_mod(sm_scale: float, logit_cap: float, device):
    """s * sm_scale, then the tanh soft cap; the scalars are tensors so a new value never recompiles."""
    scale = torch.tensor(sm_scale, dtype=torch.float32, device=device)
    if logit_cap > 0:
        cap = torch.tensor(logit_cap, dtype=torch.float32, device=device)

        def capped(score, b, h, q_idx, kv_idx):
            return cap * torch.tanh(score * scale / cap)

        return capped

    def scaled(score, b, h, q_idx, kv_idx):
        return score * scale

    return scaled


# --------------------------------------------------------------------------------------------
# The plain-tensor runner
# --------------------------------------------------------------------------------------------


def compile_key(pk: "Packed", device: torch.device, logit_cap: float, want_lse: bool) -> tuple:
    """What dynamo guards on, as a key of compiles: the shapes, dtype, score_mod's code, and K's and
    V's strides (V a view of K, or a tensor of its own when a scale is applied)."""
    return (device.type, pk.NQ, pk.NK, pk.dtype, logit_cap > 0, want_lse, pk.k.stride(), pk.v.stride())


def run_flex_mla(
    q: torch.Tensor, kv_buffer: torch.Tensor, att: Attended, sc: Scales, out_dtype: Optional[torch.dtype] = None,
    device=None,
) -> tuple[torch.Tensor, Optional[torch.Tensor], dict]:  # fmt: skip
    """MLA decode or extend (a causal prefix per query row: ``att`` without a mask) through compiled
    flex_attention, on ``device`` (q's). q [T, H, D], kv_buffer [N, 1, D]. Returns out
    [T, H, Dv] in out_dtype (default q's), lse [T, H] fp32 natural log (None on CPU, where Inductor
    does not return it) and an info dict. A request with no tokens gets out 0 (lse -inf).
    """
    device = torch.device(device) if device is not None else q.device
    T, H, _ = q.shape
    if att.has_mask:
        raise BackendUnavailable("flex: a verify tree custom_mask is not modelled (causal only)")
    sm_scale, logit_cap = sc.sm_scale, sc.logit_cap
    pk = Packed(q, kv_buffer, att, sc, device)
    want_lse = device.type != "cpu"
    key = compile_key(pk, device, logit_cap, want_lse)
    _guard_recompiles(key)
    fn = _flex_fn(device.type)
    kwargs = dict(score_mod=_score_mod(sm_scale, logit_cap, device), block_mask=pk.block_mask(), scale=1.0)
    if want_lse:
        from torch.nn.attention.flex_attention import AuxRequest

        kwargs["return_aux"] = AuxRequest(lse=True)
    t0 = time.perf_counter()
    try:
        res, note = _call(fn, pk, kwargs, device)
    except Exception as e:  # a guard the key does not model: compile afresh, once
        if type(e).__name__ != "FailOnRecompileLimitHit":
            raise
        _reset_compiled()
        _shapes.add(key)
        res, note = _call(_flex_fn(device.type), pk, kwargs, device)
    seconds = time.perf_counter() - t0
    o, aux = (res[0], res[1]) if want_lse else (res, None)
    out = o[0, 0, : T * H].reshape(T, H, pk.Dv).to(out_dtype or q.dtype)  # [T, H, Dv]
    lse = None
    if aux is not None and getattr(aux, "lse", None) is not None:
        lse = aux.lse[0, 0, : T * H].reshape(T, H).float()  # [T, H]
    info = {
        "torch_version": torch.__version__, "device": str(device), "compute_dtype": str(pk.dtype).replace("torch.", ""),
        "padded_q_rows": pk.NQ, "padded_kv_rows": pk.NK, "block": BLOCK, "seconds": round(seconds, 3),
        "compiler": "inductor (C++)" if device.type == "cpu" else "inductor (Triton)",
    }  # fmt: skip
    if note:
        info["kernel_options"] = note
    if lse is None:
        info["lse"] = "not returned: Inductor's CPU flex_attention template does not support return_lse"
    return out, lse, info


# On a GPU, 576-dim q.k tiles with flex's default block sizes may not fit in shared memory: the
# call is retried once with small tiles (the math is the same; only the tiling changes).
SMALL_TILES = {"BLOCK_M": 16, "BLOCK_N": 16, "num_stages": 1, "num_warps": 4}


def _call(fn, pk: Packed, kwargs: dict, device: torch.device):
    """(flex_attention's result, a note on the kernel options used or None)."""
    with torch.no_grad():
        try:
            res = fn(pk.q, pk.k, pk.v, **kwargs)
            note = None
        except Exception as e:
            if device.type != "cuda":
                raise
            res = fn(pk.q, pk.k, pk.v, **kwargs, kernel_options=dict(SMALL_TILES))
            note = f"{SMALL_TILES} after the default tiles failed: {type(e).__name__}"
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return res, note


# --------------------------------------------------------------------------------------------
# The backend
# --------------------------------------------------------------------------------------------


def _compiler_note() -> tuple[bool, str]:
    """(a C++ compiler for Inductor's CPU code is here, which)."""
    try:
        cxx = torch._inductor.config.cpp.cxx
        names = [c for c in (cxx if isinstance(cxx, tuple) else (cxx,)) if c] or ["g++"]
    except Exception:
        names = ["g++"]
    for n in [*names, "g++", "gcc", "clang++"]:
        if shutil.which(n):
            return True, n
    return False, "no C++ compiler for Inductor's CPU flex_attention (g++ / clang++)"


class FlexBackend(Backend):
    name = "flex"

    def availability(self) -> tuple[bool, str]:
        try:
            from torch.nn.attention.flex_attention import flex_attention  # noqa: F401
            import torch._inductor.config  # noqa: F401
        except Exception as e:
            return False, f"torch {torch.__version__} has no flex_attention: {type(e).__name__}: {e}"
        if torch.cuda.is_available():
            return True, f"torch {torch.__version__} flex_attention, Inductor (Triton on GPU, C++ on CPU)"
        ok, cxx = _compiler_note()
        if not ok:
            return False, cxx
        return True, f"torch {torch.__version__} flex_attention compiled by Inductor on CPU ({cxx})"

    def run(self, cap: Capture, opts: ReplayOptions) -> BackendResult:
        if cap.attended().has_mask:  # a chain verify is causal: runs
            raise BackendUnavailable("flex: a verify tree custom_mask is not modelled (causal only)")
        device = opts.device or ("cuda" if torch.cuda.is_available() else "cpu")
        if torch.device(device).type == "cpu" and not _compiler_note()[0]:
            raise BackendUnavailable(_compiler_note()[1])
        if torch.device(device).type == "cuda" and not torch.cuda.is_available():
            raise BackendUnavailable(f"device {device} asked for and no GPU is visible to torch")
        out, lse, info = run_flex_mla(cap.q, cap.kv_buffer, cap.attended(), cap.scales(), cap.out_dtype, device)
        return BackendResult(out=out.cpu(), lse=None if lse is None else lse.cpu(), info=info,
                             arithmetic=FLEX_ATTENTION)  # one pass, q kept, fp8 K / V dequantized to q's dtype


__all__ = ["FlexBackend", "bucket", "run_flex_mla"]

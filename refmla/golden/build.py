"""Writing the golden suite: each case's inputs and fp64 reference, frozen in a capture file.

    case (GoldenCase) --BUILDERS[case.mode]--> inputs: q, hostile paged pool, SGLang metadata
                                               reference: out, lse (fp64 -> fp32), per-split partials
                      --write_capture-->       <case>.safetensors (refmla.capture/1) + manifest.json

A suite is the same bytes on every run and machine for one ``GENERATOR`` version: the inputs are
integer hashes on an exact grid (:mod:`refmla.golden.determinism`), so only the reference's own
fp64 softmax and ``P . V`` are left to floating point, rounded once to fp32; and write_capture
writes the safetensors header with its metadata keys sorted.

What a decode golden file holds (a capture whose ``out`` is the *reference*, not a production output):

    q, kv_buffer, kv_indptr, kv_indices, seq_lens, num_kv_splits   the inputs, unused pool rows NaN
    out   [B, H, Dv] fp32   fp64 reference (refmla.reference.mla_decode_ref), v_scale included
    lse   [B, H]     fp32   its natural-log LSE (-inf for a zero-length request)
    attn_logits [B, H, S, Dv], attn_lse [B, H, S] fp32   the reference per split of the Triton
          schedule for num_kv_splits, S = the most non-empty splits of any request, *without*
          v_scale (as SGLang's stage 1 stores them); empty splits 0 / -inf
    meta["golden"]   generator version, case parameters, tolerance inputs, what each tensor is

Tolerance inputs. The tolerance is docs/contract.md section 5: k times the low-precision control's
error per (request, head) row plus ulps of the output dtype. The file records k, ulps, cos, the
output dtype a kernel writes and the control that is meant (``refmla.control.mla_control``); the
control itself is recomputed from the stored inputs at check time, as ``refmla replay`` does,
because it rounds to bf16 at several points and so is not bit-reproducible across BLAS builds
(storing it would break the determinism above). It costs milliseconds.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch

from refmla import reference as ref
from refmla.atomic import WriteError, check_replaceable, check_target, make_dir, write_text
from refmla.attended import Attended, tree_visibility
from refmla.capture import write_capture
from refmla.compare import Tolerance
from refmla.golden.cases import SUITES, GoldenCase
from refmla.golden.determinism import DTYPES, grid_normal, nan_filled, shuffled
from refmla.scales import Scales
from refmla.signals import signals_deferred
from refmla.schedule import split_bounds

GENERATOR = "refmla.golden/2"  # bump when an unchanged case would come out as different bytes
MANIFEST = "manifest.json"
KV_LORA_RANK, QK_ROPE_HEAD_DIM = 512, 64  # DeepSeek-V3 and Kimi-K2

Tensors = dict[str, torch.Tensor]
PathLike = Union[str, Path]


# --------------------------------------------------------------------------------------------
# Decode: one query token per request
# --------------------------------------------------------------------------------------------


def paged_pool(case: GoldenCase, kv_dtype: torch.dtype, D: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(pool [N, 1, D] with every unattended row NaN, kv_indices [nnz] int64) on shuffled pages."""
    P = case.page_size
    lens = torch.tensor(case.seq_lens, dtype=torch.int64)  # [B]
    pages_per = (lens + P - 1) // P  # [B]
    n_pages = int(pages_per.sum()) + case.free_pages
    perm = shuffled(case.seed, "pages", n_pages)  # page ids in the order they are handed out
    values = grid_normal(case.seed, "kv", (int(lens.sum()), D), kv_dtype)  # [nnz, D] position-order rows
    pool = nan_filled((n_pages * P, 1, D), kv_dtype)  # [N, 1, D] unattended rows NaN
    slots, used = [], 0
    for L, npg in zip(lens.tolist(), pages_per.tolist()):
        pages = perm[used : used + npg]
        used += npg
        slots.append((pages[:, None] * P + torch.arange(P)[None, :]).reshape(-1)[:L])  # [L]
    kv_indices = torch.cat(slots) if slots else torch.zeros(0, dtype=torch.int64)  # [nnz]
    pool[kv_indices, 0] = values
    return pool, kv_indices


def build_inputs(
    case: GoldenCase, kv_lora_rank: int = KV_LORA_RANK, qk_rope_head_dim: int = QK_ROPE_HEAD_DIM
) -> Tensors:
    """q, the shuffled NaN-poisoned paged pool and SGLang's metadata for a decode ``case``."""
    D = kv_lora_rank + qk_rope_head_dim
    B, H = len(case.seq_lens), case.num_heads
    pool, kv_indices = paged_pool(case, DTYPES[case.kv_dtype or case.dtype], D)
    lens = torch.tensor(case.seq_lens, dtype=torch.int64)  # [B]
    kv_indptr = torch.zeros(B + 1, dtype=torch.int32)
    kv_indptr[1:] = torch.cumsum(lens, 0)
    return {
        "q": grid_normal(case.seed, "q", (B, H, D), DTYPES[case.dtype], case.q_scale_exp),  # [B, H, D]
        "kv_buffer": pool,
        "kv_indptr": kv_indptr,  # [B + 1] int32, as SGLang's Triton backend
        "kv_indices": kv_indices,  # [nnz] int64, as SGLang's Triton backend
        "seq_lens": lens.to(torch.int32),  # [B]
        "num_kv_splits": torch.tensor(case.splits, dtype=torch.int32),  # [B]
    }


def split_width(case: GoldenCase) -> int:
    """The most non-empty splits of any request under the Triton schedule (at least 1)."""
    return max([1] + [sum(e > s for s, e in split_bounds(L, n)) for L, n in zip(case.seq_lens, case.splits)])


def case_scales(case: GoldenCase, kv_lora_rank: int = KV_LORA_RANK) -> Scales:
    return Scales(kv_lora_rank, case.sm_scale, case.logit_cap, case.k_scale, case.v_scale)


def reference_tensors(t: Tensors, case: GoldenCase, kv_lora_rank: int = KV_LORA_RANK) -> Tensors:
    """out, lse and the per-split partials of ``case``'s schedule: fp64 reference, stored fp32."""
    att, sc = Attended.from_tensors(t), case_scales(case, kv_lora_rank)
    out, lse = ref.mla_decode_ref(t["q"], t["kv_buffer"], att, sc)  # [B, H, Dv], [B, H] fp64
    parts, lses, _ = ref.mla_decode_split_ref(
        t["q"], t["kv_buffer"], att, t["num_kv_splits"], sc.but(v_scale=1.0), max_kv_splits=split_width(case)
    )  # [B, H, S, Dv], [B, H, S]: as the kernel stores them, before v_scale
    f32 = torch.float32
    return {"out": out.to(f32), "lse": lse.to(f32), "attn_logits": parts.to(f32), "attn_lse": lses.to(f32)}


def decode_meta(case: GoldenCase, tol: Tolerance) -> dict[str, Any]:
    """The capture meta of a decode golden file (docs/contract.md section 1) plus meta["golden"]."""
    return {
        "mode": "decode", "backend": "unknown", "kv_lora_rank": KV_LORA_RANK, "qk_rope_head_dim": QK_ROPE_HEAD_DIM,
        "sm_scale": case.sm_scale, "logit_cap": case.logit_cap, "page_size": case.page_size,
        "k_scale": case.k_scale, "v_scale": case.v_scale, "max_kv_splits": case.max_kv_splits,
        "golden": golden_meta_block(case, tol, {
            "out": "fp64 reference (refmla.reference.mla_decode_ref) rounded to fp32; not a production output",
            "attn_logits": "fp64 reference per split of the Triton schedule for num_kv_splits, fp32, without "
                           "v_scale (as SGLang's stage 1 stores them); empty splits 0 and lse -inf",
        }),
    }  # fmt: skip


# --------------------------------------------------------------------------------------------
# Any mode: the builder of a case's mode, meta["golden"], files and the manifest
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Builder:
    """How the golden file of one mode is made."""

    inputs: Callable[[GoldenCase], Tensors]  # q, the pool and the kernel's metadata
    reference: Callable[[Tensors, GoldenCase], Tensors]  # the fp64 reference, in its stored fp32
    meta: Callable[[GoldenCase, Tolerance], dict[str, Any]]  # the capture meta, meta["golden"] included


# --------------------------------------------------------------------------------------------
# Verify: draft_token_num query tokens per request, causal bottom-right or a tree mask
# --------------------------------------------------------------------------------------------


def tree_mask(case: GoldenCase) -> tuple[torch.Tensor, torch.Tensor]:
    """SGLang's layout for a complete topk-ary draft tree (token i's parent (i - 1) // topk): request
    b's row-major [n, L_b] bool mask (prefix all True, a draft sees its ancestors and itself),
    flattened; mask_indptr [B + 1] int64."""
    n, parts = case.draft_token_num, []
    parents = [(j - 1) // case.topk if j > 0 else -1 for j in range(n)]
    for L in case.seq_lens:
        parts.append(tree_visibility(L, parents).reshape(-1))
    indptr = torch.zeros(len(parts) + 1, dtype=torch.int64)
    indptr[1:] = torch.cumsum(torch.tensor([n * L for L in case.seq_lens], dtype=torch.int64), 0)
    return torch.cat(parts), indptr


def verify_inputs(case: GoldenCase) -> Tensors:
    """The decode inputs with draft_token_num query rows per request, qo_indptr, and the tree mask."""
    t = build_inputs(case)
    B, H, n = len(case.seq_lens), case.num_heads, case.draft_token_num
    D = t["q"].shape[-1]
    t["q"] = grid_normal(case.seed, "q", (B * n, H, D), DTYPES[case.dtype], case.q_scale_exp)  # [T, H, D]
    t["qo_indptr"] = torch.arange(B + 1, dtype=torch.int32) * n  # [B + 1], SGLang's target_verify steps
    del t["num_kv_splits"]  # no split schedule in the verify kernels' file
    if case.topk > 1:
        t["custom_mask"], t["mask_indptr"] = tree_mask(case)
    return t


def verify_reference(t: Tensors, case: GoldenCase, kv_lora_rank: int = KV_LORA_RANK) -> Tensors:
    """out [T, H, Dv] and lse [T, H]: the fp64 verify reference, stored fp32."""
    out, lse = ref.mla_verify_ref(t["q"], t["kv_buffer"], Attended.from_tensors(t), case_scales(case, kv_lora_rank))
    return {"out": out.to(torch.float32), "lse": lse.to(torch.float32)}


def verify_meta(case: GoldenCase, tol: Tolerance) -> dict[str, Any]:
    """The capture meta of a verify golden file, meta["golden"] included."""
    meta = decode_meta(case, tol)
    meta.update(mode="verify", draft_token_num=case.draft_token_num, topk=case.topk)
    meta["golden"] = golden_meta_block(case, tol, {
        "out": "fp64 verify reference (refmla.reference.mla_verify_ref) rounded to fp32; not a production output",
    })  # fmt: skip
    return meta


BUILDERS: dict[str, Builder] = {  # by case.mode
    "decode": Builder(build_inputs, reference_tensors, decode_meta),
    "verify": Builder(verify_inputs, verify_reference, verify_meta),
}


def golden_meta_block(case: GoldenCase, tol: Tolerance, tensors: dict[str, str]) -> dict[str, Any]:
    """meta["golden"]: generator, case, its parameters, what the stored ``tensors`` are, tolerance inputs."""
    return {
        "generator": GENERATOR, "case": case.name, "why": case.why, "params": case.params(), **tensors,
        "out_dtype": case.dtype,
        "tolerance": {**tol.to_json(), "control": "refmla.control.mla_control, recomputed from the inputs",
                      "rule": "per (request, head): max abs err <= k * control's + ulps * ulp(out_dtype, "
                              "row max); cosine difference < max(cos, k * control's), whole and per row"},
        **({"pool_base_row": case.pool_base_row} if case.pool_base_row else {}),
    }  # fmt: skip


def build_tensors(case: GoldenCase) -> Tensors:
    """Every tensor of ``case``'s golden file: its inputs and its reference, by the case's mode."""
    builder = BUILDERS[case.mode]
    t = builder.inputs(case)
    t.update(builder.reference(t, case))
    return t


def case_meta(case: GoldenCase, tol: Tolerance = Tolerance()) -> dict[str, Any]:
    """The capture meta of ``case``'s golden file, meta["golden"] included, by the case's mode."""
    return BUILDERS[case.mode].meta(case, tol)


def write_case(case: GoldenCase, out_dir: PathLike) -> dict[str, Any]:
    """Write ``<out_dir>/<case.name>.safetensors``; returns its manifest entry."""
    path = Path(out_dir) / f"{case.name}.safetensors"
    write_capture(path, build_tensors(case), case_meta(case), compact=False)  # compact=False keeps the NaN poison
    data = path.read_bytes()
    return {"name": case.name, "file": path.name, "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data),
            "why": case.why, "params": case.params()}  # fmt: skip


def generate(out_dir: PathLike, suite: str = "quick") -> dict[str, Any]:
    """Write every case of ``suite`` ("quick" or "full") to ``out_dir`` plus ``manifest.json``.

    The same bytes on every run (see the module docstring). Returns the manifest.
    """
    if suite not in SUITES:
        raise KeyError(f"unknown suite {suite!r}; choose from {', '.join(SUITES)}")
    out = make_dir(out_dir)
    cases = list(SUITES[suite].values())

    def write() -> list[tuple[Path, dict[str, Any]]]:
        return [(out / MANIFEST, dense_manifest(suite, [write_case(case, out) for case in cases]))]

    return write_with_manifests(case_paths(cases, out), {out / MANIFEST: DENSE_FORMAT}, write)[0][1]


DENSE_FORMAT = "refmla.golden.manifest/1"


def case_paths(cases: list[GoldenCase], out: Path) -> list[Path]:
    return [out / f"{case.name}.safetensors" for case in cases]


def dense_manifest(suite: str, entries: list[dict[str, Any]]) -> dict[str, Any]:
    return {"format": DENSE_FORMAT, "generator": GENERATOR, "suite": suite, "capture_format": "refmla.capture/1",
            "cases": entries}  # fmt: skip


Manifests = list[tuple[Path, dict[str, Any]]]


def write_with_manifests(targets: list[Path], manifests: dict[Path, str], write: Callable[[], Manifests]) -> Manifests:
    """One suite write: every target and manifest (path -> its format) checked before anything is
    written (refmla.atomic: a file refmla did not write is refused, one WriteError line); the old
    manifests removed first; ``write`` writes the cases and returns the manifests, written last in
    its order. Interrupted or failed (SIGINT / SIGTERM included): every manifest as it was before."""
    for path in targets:
        check_replaceable(path)
    before = {path: _refuse_foreign_manifest(path, fmt) for path, fmt in manifests.items()}
    try:
        with signals_deferred():
            for path in before:
                _unlink(path)
        docs = write()
        for path, doc in docs:
            write_text(path, json.dumps(doc, indent=1) + "\n")
    except BaseException:  # interrupted (SIGINT / SIGTERM) or failed: the manifests as they were before
        with signals_deferred():
            for path, text in before.items():
                if text is None:
                    _unlink(path)
                else:
                    write_text(path, text)
        raise
    return docs


def _unlink(path: Path) -> None:
    try:
        path.unlink(missing_ok=True)
    except OSError as e:
        raise WriteError(path, e.strerror or type(e).__name__) from None


def _refuse_foreign_manifest(path: Path, fmt: str = DENSE_FORMAT) -> Optional[str]:
    """A manifest.json that is not a manifest of ``fmt`` is a user's file: never replaced. Returns
    the manifest's text (None: there is none)."""
    check_target(path)
    try:
        text = path.read_text(errors="replace") if path.is_file() else None
    except OSError as e:
        raise WriteError(path, e.strerror or type(e).__name__) from None
    if text is None:
        return None
    try:
        found = json.loads(text).get("format")
    except (ValueError, AttributeError, RecursionError):
        found = None
    if found != fmt:
        raise WriteError(path, f"exists and is not a golden manifest ({fmt}): not replaced; choose another --out")
    return text


def load_manifest(golden_dir: PathLike) -> dict[str, Any]:
    """The manifest of a golden directory; FileNotFoundError names what is missing. ``generate``
    writes the manifest last, so a directory without one is an incomplete (or interrupted) suite."""
    path = Path(golden_dir) / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no golden manifest: the suite is incomplete (an interrupted "
                                f"generate?); run refmla golden generate --out {golden_dir}")  # fmt: skip
    return json.loads(path.read_text())

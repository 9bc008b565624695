"""Which aiter MLA decode path production ran, read from the capture's meta, and which one to replay.

The capture hook records the path SGLang's ``AiterAttnBackend`` dispatched (docs/contract.md
section 1, "aiter path"); SGLang 0.5.23 has these for one-token decode:

    persistent       aiter.mla.mla_decode_fwd with work_meta_data / work_indptr / work_info_set /
                     reduce_* built by aiter's get_mla_metadata_info_v1 + get_mla_metadata_v1
    non_persistent   aiter.mla.mla_decode_fwd without them (aiter picks the splits: get_meta_param)
    gluon            aiter.ops.triton.gluon.mla_gluon.mla_gluon (12 heads, fp8 KV, zero padding)
    dcp_asm          decode context parallelism, persistent (captures skip DCP: never replayed)
    dcp_gluon        decode context parallelism, Gluon (likewise)

``REFMLA_AITER_PATH`` (``persistent`` | ``non_persistent`` | ``gluon`` | ``auto``) replays another
path than the recorded one. A capture that records no path (synthetic, golden, hooks before this
key) replays ``non_persistent``, as refmla always did, unless ``SGLANG_AITER_MLA_PERSIST`` is set
where refmla runs: then the path SGLang 0.5.23 would take for its heads and KV dtype
(:func:`sglang_path`; a kernel-regression run per path).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping, Optional

PERSISTENT, NON_PERSISTENT, GLUON = "persistent", "non_persistent", "gluon"
PATHS = (PERSISTENT, NON_PERSISTENT, GLUON, "dcp_asm", "dcp_gluon")
REPLAYABLE = (PERSISTENT, NON_PERSISTENT, GLUON)
ENV_PATH = "REFMLA_AITER_PATH"
ENV_PERSIST = "SGLANG_AITER_MLA_PERSIST"  # set where refmla runs: derive the path as SGLang would
NOT_RECORDED = "default: the capture does not record the aiter path"

# the meta keys the hook writes (docs/contract.md section 1), read back from CaptureMeta.extra
_META = {
    "head_pad_mode": "aiter_head_pad_mode",
    "kernel_heads": "aiter_kernel_heads",
    "fast_mode": "aiter_fast_mode",
    "intra_batch_mode": "aiter_intra_batch_mode",
    "max_split_per_batch": "aiter_max_split_per_batch",
    "num_kv_splits": "aiter_num_kv_splits",
    "kv_granularity": "aiter_kv_granularity",
    "q_dtype": "aiter_q_dtype",
    "q_scale": "aiter_q_scale",
    "auto_kv_splits": "aiter_auto_kv_splits",
}


@dataclass(frozen=True)
class AiterPath:
    """The path to replay and the knobs that shape it (None: not recorded, SGLang's default used)."""

    name: str  # the path replayed (one of PATHS, or an unknown name recorded by a newer hook)
    recorded: Optional[str]  # what the capture says production ran; None when it does not say
    source: str  # "capture", "REFMLA_AITER_PATH=<name>", or NOT_RECORDED
    head_pad_mode: Optional[str] = None  # "repeat" | "zero" | "none"
    kernel_heads: Optional[int] = None  # q heads the production kernel got (after padding)
    fast_mode: Optional[bool] = None
    intra_batch_mode: Optional[bool] = None
    max_split_per_batch: Optional[int] = None
    num_kv_splits: Optional[int] = None  # the split count SGLang passed the kernel; None: aiter picks
    kv_granularity: Optional[int] = None  # get_mla_metadata_v1's kv_granularity
    q_dtype: Optional[str] = None  # q's dtype at the kernel ("float8_e4m3fn" when production quantized q)
    q_scale: Optional[float] = None  # the q scale passed with an fp8 q
    auto_kv_splits: Optional[bool] = None  # SGLANG_AITER_MLA_AUTO_KV_SPLITS: num_kv_splits None to the kernel
    metadata_call: dict = field(default_factory=dict)  # get_mla_metadata_v1's scalar arguments, as recorded

    @property
    def replays_production(self) -> bool:
        return self.recorded is not None and self.name == self.recorded

    def unreplayable(self) -> str:
        """Why this path is not replayed (for BackendUnavailable)."""
        who = "production ran" if self.name == self.recorded else f"{self.source} asks for"
        if self.name.startswith("dcp_"):
            why = "decode context parallelism is not in refmla.capture/1"
        else:
            why = f"a path this refmla does not know (it replays {', '.join(REPLAYABLE)})"
        return f"{who} aiter's {self.name} kernel, not replayed here: {why}"

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v not in (None, {})}


def recorded_path(extra: Mapping[str, Any]) -> Optional[str]:
    """The path the capture's meta records (``aiter_path``), or None."""
    value = extra.get("aiter_path")
    return str(value) if value else None


def production_path(meta, env: Optional[Mapping[str, str]] = None, heads: Optional[int] = None,
                    kv_fp8: bool = False) -> AiterPath:  # fmt: skip
    """The path to replay for this capture's meta (a CaptureMeta), first of: ``REFMLA_AITER_PATH``;
    the recorded ``aiter_path``; with ``SGLANG_AITER_MLA_PERSIST`` set here, the path SGLang 0.5.23
    takes for ``heads`` query heads and this KV dtype (:func:`sglang_path`); ``non_persistent``."""
    env = os.environ if env is None else env
    extra = dict(getattr(meta, "extra", {}) or {})
    recorded = recorded_path(extra) if meta.backend == "aiter" else None
    forced = (env.get(ENV_PATH) or "").strip().lower()
    knobs = {}
    if forced and forced != "auto":
        name, source = forced, f"{ENV_PATH}={forced}"
    elif recorded is not None:
        name, source = recorded, "capture"
    elif env.get(ENV_PERSIST) is not None and heads:
        name, knobs = sglang_path(heads, kv_fp8, env)
        source = f"{ENV_PERSIST}={env.get(ENV_PERSIST)}: SGLang 0.5.23's choice for {heads} heads, {'fp8' if kv_fp8 else 'bf16'} KV"
    else:
        name, source = NON_PERSISTENT, NOT_RECORDED
    knobs.update({attr: extra[key] for attr, key in _META.items() if extra.get(key) is not None})
    call = extra.get("aiter_metadata_call")
    return AiterPath(name=name, recorded=recorded, source=source, metadata_call=dict(call or {}), **knobs)


def _env_bool(env: Mapping[str, str], name: str, default: bool) -> bool:
    v = env.get(name)
    return default if v is None else v.strip().lower() in ("1", "true", "yes", "on")


def sglang_path(heads: int, kv_fp8: bool, env: Mapping[str, str]) -> tuple[str, dict]:
    """(path, knobs) SGLang 0.5.23's AiterAttnBackend takes for one-token decode without DCP or
    speculative decoding, from its ``__init__`` and ``_forward_mla_decode`` (table in docs/aiter.md).
    Gluon is assumed importable when ``SGLANG_AITER_MLA_GLUON`` is on (SGLang falls back to the
    zero-padded ``mla_decode_fwd`` when it is not)."""
    kh = max(heads, 16)
    pad = "repeat" if heads in (4, 8) else ("zero" if heads == 12 else ("none" if heads >= 16 else "tile"))
    persist = _env_bool(env, ENV_PERSIST, True)
    fast, intra = (True, False) if kh in (32, 64, 128) else (False, persist)
    if ((kh == 16 and pad != "zero") or kh == 128) and not kv_fp8:
        persist, fast, intra = False, False, False
    gluon = pad == "zero" and kv_fp8 and _env_bool(env, "SGLANG_AITER_MLA_GLUON", True)
    asm = (env.get("SGLANG_AITER_MLA_DECODE_BACKEND") or "asm").strip().lower() == "asm"
    knobs: dict[str, Any] = {"head_pad_mode": pad, "kernel_heads": heads if gluon else kh}
    if gluon and not (persist and asm):
        return GLUON, knobs
    if not persist:
        return NON_PERSISTENT, knobs
    auto = _env_bool(env, "SGLANG_AITER_MLA_AUTO_KV_SPLITS", False)
    splits = -1 if auto else 64
    fast, intra = (True, False) if auto else (fast, intra)
    knobs.update(fast_mode=fast, intra_batch_mode=intra, max_split_per_batch=splits, auto_kv_splits=auto)
    return PERSISTENT, knobs


def sglang_modes(kernel_heads: int) -> tuple[bool, bool, int]:
    """(fast_mode, intra_batch_mode, max_split_per_batch) SGLang 0.5.23 uses for persistent decode
    without speculative decoding: ``AiterAttnBackend.__init__`` sets fast_mode for 32 / 64 / 128
    kernel heads and "fake non-persistent" (intra_batch_mode) otherwise; max_split_per_batch 64."""
    if kernel_heads in (32, 64, 128):
        return True, False, 64
    return False, True, 64


__all__ = [
    "ENV_PATH", "ENV_PERSIST", "GLUON", "NON_PERSISTENT", "NOT_RECORDED", "PATHS", "PERSISTENT", "REPLAYABLE",
    "AiterPath", "production_path", "recorded_path", "sglang_modes", "sglang_path",
]  # fmt: skip

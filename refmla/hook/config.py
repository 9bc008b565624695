"""What the capture hook captures, read from ``REFMLA_CAPTURE_*`` environment variables.

The hook is configured only by the environment, so that ``refmla capture run`` can hand the same
settings to every process SGLang spawns (scheduler and TP workers are fresh interpreters that
inherit the environment and nothing else).

| variable | default | meaning |
| --- | --- | --- |
| ``REFMLA_CAPTURE_DIR`` | unset | output folder; **setting it enables the hook**, unset = hook off, nothing patched |
| ``REFMLA_CAPTURE_LAYERS`` | ``all`` | layer ids to capture: ``all`` or a list such as ``0,3,10-12`` |
| ``REFMLA_CAPTURE_MODES`` | ``decode`` | any of ``decode``, ``extend``, ``verify``, comma-separated (extend = prefill / chunked prefill; verify = speculative target_verify / draft_extend) |
| ``REFMLA_CAPTURE_MIN_SEQ_LEN`` | ``64`` | capture a call only when its longest request attends at least this many tokens (skips SGLang's warm-up request and short probes); ``0`` captures everything |
| ``REFMLA_CAPTURE_RANKS`` | ``all`` | TP ranks that capture: ``all`` or a list such as ``0`` or ``0,4-7`` |
| ``REFMLA_CAPTURE_BACKENDS`` | ``triton,aiter`` | which SGLang attention backends to wrap (also ``dsv4``: DeepSeek-V4's sparse entrypoint; ``dsa``: DeepSeek-V3.2 DSA's aiter decode on ROCm; ``flashmla``, ``trtllm_mla``, ``flashinfer_mla``, ``fa3_mla``: the NVIDIA MLA decode backends; ``kvwrite``: the MLA KV cache writers, DeepSeek-V4's packed pool writers included; ``merge``: the state merges and SGLang's chunked-prefix MHA prefill, recorded whole) |
| ``REFMLA_CAPTURE_EVERY`` | ``1`` | capture every N-th forward pass of a layer (``step % N == 0``) |
| ``REFMLA_CAPTURE_MAX_FILES`` | ``128`` | stop capturing once the folder holds this many captures (all processes together) |
| ``REFMLA_CAPTURE_MAX_BYTES`` | ``4G`` | stop capturing before the folder's captures would exceed this size (suffixes K, M, G, T) |
| ``REFMLA_CAPTURE_PARTIALS`` | ``1`` | ``0`` leaves out the Triton stage-1 partials (``attn_logits`` / ``attn_lse``), which dominate the file size at large batch |

Budgets are shared by all processes writing into one folder: each process counts the captures
already in the folder before it writes, so with P processes writing at the same moment the folder
can end at most P - 1 files over ``MAX_FILES`` (never over ``MAX_BYTES`` by more than P - 1 files).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Mapping, Optional

ENV_PREFIX = "REFMLA_CAPTURE_"
ENV_DIR = ENV_PREFIX + "DIR"

MODES = ("decode", "extend", "verify")
# dsv4: DeepSeek-V4 sparse decode (refmla.hook.sparse_call); dsa: V3.2 DSA's aiter decode on ROCm
# (refmla.hook.dsa_call); flashmla, trtllm_mla, flashinfer_mla, fa3_mla: SGLang's NVIDIA MLA decode
# backends (issue 20, refmla.hook.nvidia); all opt-in
# kvwrite: the MLA KV cache writers (refmla.hook.kvwrite_call, v4write_call); merge: the state merges
# (merge_call) and the chunked-prefix MHA prefill (chunked_call)
BACKENDS = ("triton", "aiter", "dsv4", "flashmla", "trtllm_mla", "flashinfer_mla", "fa3_mla", "dsa", "kvwrite", "merge")
DEFAULT_BACKENDS = ("triton", "aiter")


class ConfigError(ValueError):
    """A REFMLA_CAPTURE_* variable that cannot be parsed; names the variable."""


@dataclass(frozen=True)
class IdSet:
    """A set of non-negative ids kept as sorted, disjoint, inclusive ranges: ``0-1000000000000`` is
    one pair, never a list of 10**12 ints (nor an environment too large for a child's exec)."""

    ranges: tuple[tuple[int, int], ...]

    def __contains__(self, i: object) -> bool:
        return isinstance(i, int) and any(lo <= i <= hi for lo, hi in self.ranges)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (set, frozenset)):
            return len(other) == len(self) and all(i in self for i in other)
        return isinstance(other, IdSet) and other.ranges == self.ranges

    __hash__ = None  # type: ignore[assignment]

    def __len__(self) -> int:
        return sum(hi - lo + 1 for lo, hi in self.ranges)

    def __str__(self) -> str:
        return ",".join(str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi in self.ranges)


def parse_int_set(text: str, name: str) -> Optional[IdSet]:
    """``all`` (or empty) -> None (no filter); ``0,3,10-12`` -> the ranges (0, 0), (3, 3), (10, 12)."""
    text = text.strip().lower()
    if text in ("", "all", "*"):
        return None
    pairs: list[tuple[int, int]] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        try:
            lo, hi = (int(x) for x in part.split("-", 1)) if "-" in part else (int(part),) * 2
            if hi < lo or lo < 0 or hi >= 2**63:
                raise ValueError
        except ValueError:
            raise ConfigError(f"{name}={text!r}: expected 'all' or ids like '0,3,10-12' (each in [0, 2**63))") from None
        pairs.append((lo, hi))
    merged: list[tuple[int, int]] = []
    for lo, hi in sorted(pairs):
        if merged and lo <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(hi, merged[-1][1]))
        else:
            merged.append((lo, hi))
    return IdSet(tuple(merged))


def id_text(ids: Optional[IdSet | frozenset[int]]) -> str:
    """The text parse_int_set reads back: "all", ranges for an IdSet, ids for a plain set."""
    if ids is None:
        return "all"
    return str(ids) if isinstance(ids, IdSet) else ",".join(map(str, sorted(ids)))


def parse_bytes(text: str, name: str) -> int:
    """``4G`` / ``512M`` / ``1000`` -> bytes (binary multiples)."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = 1
    if t and t[-1] in "KMGT":
        mult = 1024 ** ("KMGT".index(t[-1]) + 1)
        t = t[:-1]
    try:
        value = float(t)
    except ValueError:
        raise ConfigError(f"{name}={text!r}: expected a size such as 4G, 512M or 1000000") from None
    if value < 0:
        raise ConfigError(f"{name}={text!r}: must not be negative")
    return int(value * mult)


def _parse_names(text: str, allowed: tuple[str, ...], name: str) -> frozenset[str]:
    names = {p.strip().lower() for p in text.split(",") if p.strip()}
    if "all" in names:
        return frozenset(allowed)
    bad = names - set(allowed)
    if bad or not names:
        raise ConfigError(f"{name}={text!r}: expected a comma list of {', '.join(allowed)}")
    return frozenset(names)


def _parse_nonneg_int(text: str, name: str, minimum: int = 0) -> int:
    try:
        value = int(text.strip())
    except ValueError:
        raise ConfigError(f"{name}={text!r}: expected an integer") from None
    if value < minimum:
        raise ConfigError(f"{name}={text!r}: must be >= {minimum}")
    return value


@dataclass(frozen=True)
class HookConfig:
    out_dir: str  # REFMLA_CAPTURE_DIR: where the capture files go
    layers: Optional[IdSet | frozenset[int]] = None  # None = every layer
    modes: frozenset[str] = frozenset({"decode"})  # any of decode, extend, verify
    min_seq_len: int = 64  # longest request of the call must attend at least this many tokens
    ranks: Optional[IdSet | frozenset[int]] = None  # None = every TP rank
    backends: frozenset[str] = frozenset(DEFAULT_BACKENDS)  # SGLang backends to wrap (dsv4, flashmla when asked)
    every: int = 1  # capture forward passes whose step % every == 0
    max_files: int = 128  # captures in out_dir, all processes together
    max_bytes: int = 4 << 30  # bytes of captures in out_dir, all processes together
    partials: bool = True  # keep Triton's attn_logits / attn_lse
    env: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)  # the raw variables

    def wants_layer(self, layer_id: int) -> bool:
        return self.layers is None or layer_id in self.layers

    def wants_rank(self, rank: int) -> bool:
        return self.ranks is None or rank in self.ranks

    @classmethod
    def from_env(cls, environ: Optional[Mapping[str, str]] = None) -> Optional["HookConfig"]:
        """The configuration, or None when ``REFMLA_CAPTURE_DIR`` is unset (hook off).

        Raises ConfigError naming the variable when one cannot be parsed.
        """
        env = os.environ if environ is None else environ
        out_dir = env.get(ENV_DIR, "").strip()
        if not out_dir:
            return None

        def get(key: str, default: str) -> str:
            return env.get(ENV_PREFIX + key, default)

        return cls(
            out_dir=os.path.abspath(out_dir),
            layers=parse_int_set(get("LAYERS", "all"), ENV_PREFIX + "LAYERS"),
            modes=_parse_names(get("MODES", "decode"), MODES, ENV_PREFIX + "MODES"),
            min_seq_len=_parse_nonneg_int(get("MIN_SEQ_LEN", "64"), ENV_PREFIX + "MIN_SEQ_LEN"),
            ranks=parse_int_set(get("RANKS", "all"), ENV_PREFIX + "RANKS"),
            backends=_parse_names(get("BACKENDS", "triton,aiter"), BACKENDS, ENV_PREFIX + "BACKENDS"),
            every=_parse_nonneg_int(get("EVERY", "1"), ENV_PREFIX + "EVERY", minimum=1),
            max_files=_parse_nonneg_int(get("MAX_FILES", "128"), ENV_PREFIX + "MAX_FILES"),
            max_bytes=parse_bytes(get("MAX_BYTES", "4G"), ENV_PREFIX + "MAX_BYTES"),
            partials=get("PARTIALS", "1").strip().lower() not in ("0", "false", "no", "off"),
            env={k: v for k, v in env.items() if k.startswith(ENV_PREFIX)},
        )

    def to_env(self) -> dict[str, str]:
        """The variables that reproduce this configuration in a child process."""

        return {
            ENV_DIR: self.out_dir,
            ENV_PREFIX + "LAYERS": id_text(self.layers),
            ENV_PREFIX + "MODES": ",".join(sorted(self.modes)),
            ENV_PREFIX + "MIN_SEQ_LEN": str(self.min_seq_len),
            ENV_PREFIX + "RANKS": id_text(self.ranks),
            ENV_PREFIX + "BACKENDS": ",".join(sorted(self.backends)),
            ENV_PREFIX + "EVERY": str(self.every),
            ENV_PREFIX + "MAX_FILES": str(self.max_files),
            ENV_PREFIX + "MAX_BYTES": str(self.max_bytes),
            ENV_PREFIX + "PARTIALS": "1" if self.partials else "0",
        }

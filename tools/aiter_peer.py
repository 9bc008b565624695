"""aiter's own torch reference for MLA, loaded at run time from an aiter checkout the user points at.

aiter's ``op_tests/test_mla.py`` imports aiter (ROCm only) and pandas and sets torch's default
device to CUDA at module level, so it cannot be imported on a CPU machine. This loader reads the
file, parses it with ``ast`` and executes only ``torch_mla_extend`` and the module-level functions
it calls (today ``ref_masked_attention``), found by the global names their bodies use, together
with the file's own imports of those names (``torch``). No other statement of the file runs, aiter
is never imported, and none of aiter's code is copied into refmla. A global name the functions need
that the file binds only through an aiter import, or not at all, is refused with one line naming it
(:class:`AiterPeerError`), as is a missing file or function.

    peer = load_aiter_peer("/path/to/aiter")   # the checkout (or REFMLA_AITER_REPO)
    out, lse = peer.decode(q, kv_buffer, kv_indptr, kv_indices, kv_lora_rank=512, sm_scale=0.13)
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/peer_source.py
from peer_source import commit, load_function  # noqa: E402

ENV = "REFMLA_AITER_REPO"  # where the benchmark and the tests look for the checkout when not told
FILE = Path("op_tests") / "test_mla.py"
ENTRY = "torch_mla_extend"


class AiterPeerError(ValueError):
    """The checkout cannot give aiter's torch reference (one line: the file and what is missing)."""


@dataclass(frozen=True)
class AiterPeer:
    """aiter's torch_mla_extend as loaded, with where it came from."""

    fn: Callable  # torch_mla_extend(q, kvc_cache, qo_indptr, kv_indptr, kv_indices, sm_scale, Dv, rope, dtype)
    path: Path  # the test_mla.py it was read from
    functions: tuple[str, ...]  # the functions executed, in file order
    commit: str  # the checkout's HEAD ("" when not a git checkout)

    def decode(self, q, kv_buffer, kv_indptr, kv_indices, *, kv_lora_rank: int, sm_scale: float):
        """Decode (one query row per request) as aiter's own tests call it: qo_indptr = 0..B,
        the indices as stored, q's dtype as the output dtype. q [B, H, D] -> out [B, H, Dv], lse [B, H]."""
        qo_indptr = torch.arange(q.shape[0] + 1, dtype=kv_indptr.dtype)
        rope = kv_buffer.shape[-1] - kv_lora_rank
        return self.fn(q, kv_buffer, qo_indptr, kv_indptr, kv_indices, sm_scale, kv_lora_rank, rope, q.dtype)


def load_aiter_peer(repo: str | Path) -> AiterPeer:
    """aiter's torch_mla_extend from ``repo``/op_tests/test_mla.py (module docstring)."""
    path = Path(repo) / FILE
    if not path.is_file():
        raise AiterPeerError(f"{path}: no such file (--aiter-repo / {ENV} must name an aiter checkout)")
    fn, functions = load_function(path, ENTRY, frozenset({"aiter"}), AiterPeerError, "aiter_op_tests_test_mla")
    return AiterPeer(fn, path, functions, commit(Path(repo)))

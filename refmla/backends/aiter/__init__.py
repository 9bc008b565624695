"""The ``aiter`` backend: aiter's MLA decode kernel, called the way SGLang's aiter backend calls it.

    probe     finding ROCm aiter (not the unrelated PyPI package), its version, the test stand-in
    heads     head padding to aiter's 16 heads and reading the output back
    indices   the index arguments (token or page convention) and keyword calls by signature
    run       one mla_decode_fwd call on plain tensors
    backend   AiterBackend: capture in, BackendResult out

See docs/aiter.md.
"""

from __future__ import annotations

from refmla.backends.aiter.backend import AiterBackend
from refmla.backends.aiter.heads import AITER_HEADS, pad_heads
from refmla.backends.aiter.indices import aiter_decode_args, kernel_kwargs
from refmla.backends.aiter.probe import aiter_status, locate_aiter
from refmla.backends.aiter.run import run_aiter_decode

__all__ = [
    "AITER_HEADS",
    "AiterBackend",
    "aiter_decode_args",
    "aiter_status",
    "kernel_kwargs",
    "locate_aiter",
    "pad_heads",
    "run_aiter_decode",
]

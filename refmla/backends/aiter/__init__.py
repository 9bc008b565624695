"""The ``aiter`` backend: aiter's MLA decode kernel, called the way SGLang's aiter backend calls it.

    probe       finding ROCm aiter (not the unrelated PyPI package), its version, the test stand-in
    heads       head padding to aiter's 16 heads and reading the output back
    indices     the index arguments (token or page convention) and keyword calls by signature
    paths       which path production ran (the capture's meta), which one to replay, SGLang's table
    metadata    the persistent work buffers, rebuilt through aiter's functions, compared with production's
    run         one non-persistent mla_decode_fwd call on plain tensors
    persistent  one persistent mla_decode_fwd call (metadata built first)
    gluon       one Gluon mla_gluon call
    backend     AiterBackend: capture in, the production path's output and a BackendResult out
    verify      AiterVerifyBackend, the ``aiter`` backend by name: AiterBackend on decode, and a verify
                capture through mla_decode_fwd with max_seqlen_q > 1

See docs/aiter.md.
"""

from __future__ import annotations

from refmla.backends.aiter.backend import AiterBackend
from refmla.backends.aiter.heads import AITER_HEADS, pad_heads
from refmla.backends.aiter.indices import AiterCall, aiter_decode_args, kernel_kwargs
from refmla.backends.aiter.probe import aiter_status, locate_aiter
from refmla.backends.aiter.gluon import run_gluon_decode
from refmla.backends.aiter.paths import AiterPath, production_path
from refmla.backends.aiter.persistent import run_persistent_decode
from refmla.backends.aiter.run import run_aiter_decode

__all__ = [
    "AITER_HEADS",
    "AiterCall",
    "AiterBackend",
    "AiterPath",
    "aiter_decode_args",
    "aiter_status",
    "kernel_kwargs",
    "locate_aiter",
    "pad_heads",
    "production_path",
    "run_aiter_decode",
    "run_gluon_decode",
    "run_persistent_decode",
]

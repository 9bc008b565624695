"""Backends, picked by name everywhere (API, CLI, tests, benchmarks).

    reference  the truth: fp64 pure PyTorch (refmla.reference)
    observed   the capture's own `out`: what production computed
    triton     SGLang's Triton MLA decode kernel, imported from the installed SGLang
    aiter      aiter's MLA decode kernel (ROCm only)
    extend     the local-extend baseline: the same token computed the prefill/extend way
               (verify captures: SGLang's Triton extend kernel with the tree / causal custom_mask)
    triton_decode_per_query, aiter_decode_per_query
               verify captures only: each verify query as a one-token decode over the positions
               it sees (refmla.backends.per_query), the plain-decode path over the same KV
    flex       PyTorch's flex_attention compiled by Inductor: an independent kernel (opt-in, see below)
    vllm_triton  vLLM's TRITON_MLA decode kernel over a block table, its uniform split schedule (opt-in;
                 by default for a capture vLLM's TRITON_MLA wrote: refmla.pipeline.engine_default)
    flashmla, flashinfer_mla, cutlass_mla, fa3_mla
               the NVIDIA block-table MLA decode kernels (refmla.backends.paged; opt-in, CUDA; by
               default for a capture whose meta backend names one: refmla.pipeline.engine_default)

Kernels outside refmla (refmla.kernel's interface, docs/own-kernel.md) are backends too:
``get_backend("pkg.module:fn")``, ``"path/file.py:fn"``, a name registered in this process, or an
installed package's entry point (group ``refmla.backends``; those join the default sets:
:func:`plugin_defaults`). named.py resolves them, plugin.py runs them.

Support modules: base.py (Backend, BackendResult), calling.py (find a kernel, call it by keyword),
triton_interp.py / cpu_compat.py / vllm_compat.py (the kernels on a CPU-only machine), engines.py
(installed engines and which kernel each backend calls: ``refmla doctor``).

NAMES run by default; OPT_IN backends run only when named (``--backend flex``): flex compiles
for seconds per shape on first use, which a default replay (make demo, the tests) should not pay;
the other engines' kernels (vllm_triton) are asked for by the engineer who runs that engine.
ALL_NAMES is every name a user may ask for. Each backend declares its arithmetic on its result
(``BackendResult.arithmetic``, refmla.arithmetic): the control it is judged against follows it.

A backend module is imported only when its name is asked for, so a missing optional package
makes that one backend unavailable (with the reason), never the tool.

Modules:

    base.py           Backend, BackendResult, BackendUnavailable, BackendFinding: what every backend is
    calling.py        finding a kernel function and calling it by its parameter names
    cpu_compat.py     shims that let CUDA-built wheels import on a CPU-only machine
    triton_interp.py  the Triton interpreter on CPU (and its bf16 dot fix)
    vllm_compat.py    vLLM's Triton MLA decode module importable on a CPU-only machine
    engines.py        installed engines and the kernel each backend calls (``refmla doctor``)
    plugin.py         a kernel outside refmla (refmla.kernel) run and checked as a backend
    named.py          the names such a kernel goes by: module:fn, file.py:fn, registered, entry points
    reference.py      the ``reference`` and ``observed`` backends
    triton.py         the ``triton`` backend: SGLang's decode kernel
    per_query.py      the ``*_decode_per_query`` backends
    flex.py           the ``flex`` backend
    vllm_triton.py    the ``vllm_triton`` backend: vLLM's TRITON_MLA decode over a block table
    paged/            the NVIDIA block-table backends (flashmla, flashinfer_mla, cutlass_mla, fa3_mla)
    aiter/            the ``aiter`` backend (decode and verify)
    extend/           the ``extend`` backend
"""

from __future__ import annotations

import importlib
from typing import Optional

from refmla.backends.base import Backend, BackendResult, BackendUnavailable
from refmla.capture import Capture
from refmla.options import ReplayOptions

_FIRST = ("reference", "observed", "triton", "aiter", "extend")
VERIFY_ONLY = ("triton_decode_per_query", "aiter_decode_per_query")  # left out of other modes' default list
NAMES = _FIRST + VERIFY_ONLY
PAGED = ("flashmla", "flashinfer_mla", "cutlass_mla", "fa3_mla")  # refmla.backends.paged
OPT_IN = ("flex", "vllm_triton", *PAGED)
ALL_NAMES = _FIRST + ("flex",) + VERIFY_ONLY + ("vllm_triton", *PAGED)  # every name, in the order they were added

_WHERE = {
    "reference": "refmla.backends.reference:ReferenceBackend",
    "observed": "refmla.backends.reference:ObservedBackend",
    "triton": "refmla.backends.triton:TritonBackend",
    "aiter": "refmla.backends.aiter.verify:AiterVerifyBackend",  # AiterBackend, plus verify (max_seqlen_q > 1)
    "extend": "refmla.backends.extend.backend:ExtendBackend",
    "triton_decode_per_query": "refmla.backends.per_query:TritonDecodePerQueryBackend",
    "aiter_decode_per_query": "refmla.backends.per_query:AiterDecodePerQueryBackend",
    "flex": "refmla.backends.flex:FlexBackend",
    "vllm_triton": "refmla.backends.vllm_triton:VllmTritonBackend",
    "flashmla": "refmla.backends.paged.flashmla:FlashMLABackend",
    "flashinfer_mla": "refmla.backends.paged.flashinfer_mla:FlashInferMLABackend",
    "cutlass_mla": "refmla.backends.paged.cutlass_mla:CutlassMLABackend",
    "fa3_mla": "refmla.backends.paged.fa3_mla:FA3MLABackend",
}


class _Missing(Backend):
    """Stands for a backend whose module could not be imported."""

    def __init__(self, name: str, reason: str):
        self.name, self.reason = name, reason

    def availability(self) -> tuple[bool, str]:
        return False, self.reason

    def run(self, cap: Capture, opts: ReplayOptions) -> BackendResult:
        raise BackendUnavailable(self.reason)


_CACHE: dict[str, Backend] = {}


def get_backend(name: str) -> Backend:
    """The backend called ``name``. Raises KeyError for a name that is not a backend, and
    refmla.kernel.InterfaceError for a ``module:fn`` that cannot be loaded as a kernel."""
    if name not in _WHERE:
        return _outside(name)
    if name not in _CACHE:
        module, cls = _WHERE[name].split(":")
        try:
            _CACHE[name] = getattr(importlib.import_module(module), cls)()
        except Exception as e:  # an optional dependency broke on import
            _CACHE[name] = _Missing(name, f"cannot load {module}: {type(e).__name__}: {e}")
    return _CACHE[name]


def is_backend(name: str) -> bool:
    """Whether ``name`` names a dense backend: refmla's own, or a kernel outside it (refmla.backends.named)."""
    from refmla.backends import named

    return name in _WHERE or named.known(name)


def plugin_defaults(sparse: Optional[bool] = None) -> tuple[str, ...]:
    """The installed packages' kernels (entry points of ``refmla.backends``): in every default set.
    ``sparse`` True: only the sparse top-k kernels (layout ``sparse_topk``), False: only the others."""
    from refmla.backends import named

    names = tuple(n for n in named.entry_point_names() if n not in _WHERE)
    return names if sparse is None else tuple(n for n in names if is_sparse_kernel(n) == sparse)


def is_sparse_kernel(name: str) -> bool:
    """Whether ``name`` is a kernel outside refmla that declares the sparse top-k layout (an entry
    point that cannot be loaded is not: it stays with the dense ones, unavailable with its reason)."""
    from refmla.backends import named

    if name in _WHERE or not named.known(name):
        return False
    return bool(getattr(get_backend(name), "sparse", False))


def _outside(name: str) -> Backend:
    """A kernel outside refmla by name (refmla.backends.named); a registered one is looked up each
    time (the API may register another callable under the same name)."""
    from refmla.backends import named

    if name in _CACHE and not named.is_registered(name):
        return _CACHE[name]
    try:
        backend: Backend = named.load(name)
    except KeyError:
        raise KeyError(f"unknown backend {name!r}; choose from {', '.join(ALL_NAMES)}, or name your kernel "
                       "as module:function (docs/own-kernel.md)") from None
    except named.EntryPointBroken as e:
        backend = _Missing(name, str(e))
    if not named.is_registered(name):
        _CACHE[name] = backend
    return backend


__all__ = ["ALL_NAMES", "NAMES", "OPT_IN", "PAGED", "VERIFY_ONLY", "Backend", "BackendResult", "BackendUnavailable", "get_backend", "is_backend",
           "is_sparse_kernel", "plugin_defaults"]

"""Which backends sweep which layout: each layout's default kernels (``refmla sweep`` without
``--backend``) and why a backend takes none of a layout (the report's ``skipped_layouts``).

    decode, verify  triton aiter extend      replay's default kernels, as before the new layouts
    block_table     vllm_triton triton aiter flashmla flashinfer_mla cutlass_mla fa3_mla
                    the layout's engine kernel (vLLM's TRITON_MLA, as replay adds it for a vLLM
                    capture), the NVIDIA block-table kernels (CUDA; unavailable elsewhere, with the
                    reason), and the token-slot kernels, which read the table's token rows
    sparse          triton aiter_sparse tilelang flashmla_sparse
    indexer         the indexer backends (refmla.indexer.backends: SGLang's and vLLM's torch paths,
                    the DeepGEMM / tilelang / aiter adapters)

A name means that kernel of the layout it runs on: ``triton`` is SGLang's Triton decode kernel
on the dense layouts and its DeepSeek-V4 Triton sparse kernel on ``sparse``; ``reference`` is
the fp64 truth of either. ``aiter_sparse``, ``tilelang`` and ``flashmla_sparse`` read sparse
captures only; every other name reads dense ones only. Named with ``--backend``, a backend
sweeps every walked layout it reads. An installed package's kernels (entry points of
``refmla.backends``) join the defaults of the layouts they declare (:func:`layout_backends`): a
sparse top-k kernel (refmla.kernel layout ``sparse_topk``) the sparse layout, the others every
dense one; a function put in refmla.sparse.backends.BACKENDS under a name of its own sweeps the
sparse layout by that name.
"""

from __future__ import annotations

from typing import Optional, Sequence

from refmla.backends import ALL_NAMES, PAGED, get_backend, is_sparse_kernel, plugin_defaults
from refmla.sparse.backends import BACKENDS as SPARSE_BACKENDS
from refmla.indexer.backends import BACKENDS as INDEXER_BACKENDS
from refmla.indexer.backends import availability as indexer_availability
from refmla.sparse.backends import KERNELS as SPARSE_KERNELS
from refmla.sparse.backends import SparseBackend
from refmla.sparse.backends import availability as sparse_availability

SPARSE_NAMES = tuple(n for n in SPARSE_BACKENDS if n != "observed")  # what the sparse layout runs by name
SPARSE_ONLY = tuple(n for n in SPARSE_NAMES if n not in ALL_NAMES)  # aiter_sparse, tilelang, flashmla_sparse
INDEXER_NAMES = ("reference", *INDEXER_BACKENDS)  # what the indexer layout runs by name
NAMES = tuple(ALL_NAMES) + SPARSE_ONLY + tuple(INDEXER_BACKENDS)  # every name ``refmla sweep --backend`` takes
LAYOUT_BACKENDS: dict[str, tuple[str, ...]] = {
    "decode": ("triton", "aiter", "extend"),
    "verify": ("triton", "aiter", "extend"),
    "block_table": ("vllm_triton", "triton", "aiter", *PAGED),
    "sparse": ("triton", "aiter_sparse", "tilelang", "flashmla_sparse"),
    "indexer": tuple(INDEXER_BACKENDS),
}


def layout_backends() -> dict[str, tuple[str, ...]]:
    """LAYOUT_BACKENDS with the installed packages' kernels (entry points of ``refmla.backends``,
    refmla.backends.plugin_defaults) added: the sparse top-k ones to ``sparse``, the others to every
    dense layout."""
    dense, sparse = plugin_defaults(sparse=False), plugin_defaults(sparse=True)
    return {la: names + (sparse if la == "sparse" else () if la == "indexer" else dense)
            for la, names in LAYOUT_BACKENDS.items()}  # fmt: skip


def default_backends(layouts: Sequence[str]) -> list[str]:
    """The default kernels of ``layouts``, each once, in the order the layouts list them."""
    per = layout_backends()
    return list(dict.fromkeys(n for layout in layouts for n in per[layout]))


MODE = {"decode": "decode", "verify": "verify", "block_table": "decode"}  # a dense layout's capture mode


def sparse_only(name: str) -> bool:
    """A path of refmla.sparse.backends.BACKENDS that is no dense backend: the sparse-only kernels
    and a function put there under a name of its own (a sweep's ``setup`` registers one so)."""
    return name in SPARSE_ONLY or (name in SPARSE_BACKENDS and name not in ALL_NAMES and name != "observed")


def not_read(name: str, layout: str) -> Optional[str]:
    """Why ``name`` reads no capture of ``layout`` (a dense kernel on ``sparse``, a sparse one on a
    dense layout, a decode-only kernel on ``verify``: its ``Backend.modes``), or None when it does."""
    if layout == "indexer":
        if name not in INDEXER_NAMES:
            return f"not an indexer backend: it reads no indexer capture (indexer backends: {', '.join(INDEXER_NAMES[1:])})"
        return None
    if name in INDEXER_BACKENDS:
        return "an indexer backend (DeepSeek's lightning indexer): it reads the indexer layout only"
    mine = is_sparse_kernel(name)  # a sparse top-k kernel outside refmla
    if layout == "sparse":
        if name not in SPARSE_NAMES and not sparse_only(name) and not mine:
            return f"a dense kernel: it reads no sparse capture (sparse kernels: {', '.join(SPARSE_NAMES[1:])})"
        return None
    if sparse_only(name) or mine:
        return "a sparse decode kernel (DeepSeek V3.2 / V4): it reads the sparse layout only"
    modes = getattr(get_backend(name), "modes", ())
    if modes and MODE[layout] not in modes:
        return f"a {' / '.join(modes)} kernel: it reads no {MODE[layout]} capture"
    return None


def availability(name: str, layout: str) -> tuple[bool, str]:
    """(``name`` runs on ``layout`` here, its version line or why not); never raises for a known name."""
    why = not_read(name, layout)
    if why:
        return False, why
    if layout == "sparse":
        if name == "reference":
            return True, "fp64 sparse reference"
        if is_sparse_kernel(name):
            return get_backend(name).availability()
        return sparse_availability(name) if name in SPARSE_KERNELS else SparseBackend(name).availability()
    if layout == "indexer":
        return (True, "fp64 indexer reference") if name == "reference" else indexer_availability(name)
    return get_backend(name).availability()


__all__ = ["INDEXER_NAMES", "LAYOUT_BACKENDS", "NAMES", "SPARSE_NAMES", "SPARSE_ONLY", "availability", "default_backends",
           "layout_backends", "not_read", "sparse_only"]

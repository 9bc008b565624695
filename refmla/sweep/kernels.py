"""Which backends sweep which layout: each layout's default kernels (``refmla sweep`` without
``--backend``) and why a backend takes none of a layout (the report's ``skipped_layouts``).

    decode, verify  triton aiter extend      replay's default kernels, as before the new layouts
    block_table     vllm_triton triton aiter flashmla flashinfer_mla cutlass_mla fa3_mla
                    the layout's engine kernel (vLLM's TRITON_MLA, as replay adds it for a vLLM
                    capture), the NVIDIA block-table kernels (CUDA; unavailable elsewhere, with the
                    reason), and the token-slot kernels, which read the table's token rows
    sparse          triton aiter_sparse tilelang flashmla_sparse

A name means that kernel of the layout it runs on: ``triton`` is SGLang's Triton decode kernel
on the dense layouts and its DeepSeek-V4 Triton sparse kernel on ``sparse``; ``reference`` is
the fp64 truth of either. ``aiter_sparse``, ``tilelang`` and ``flashmla_sparse`` read sparse
captures only; every other name reads dense ones only. Named with ``--backend``, a backend
sweeps every walked layout it reads. An installed package's kernels (entry points of
``refmla.backends``) join the defaults of the layouts they declare (:func:`layout_backends`): a
sparse top-k kernel (refmla.kernel layout ``sparse_topk``) the sparse layout, the others every
dense one.
"""

from __future__ import annotations

from typing import Optional, Sequence

from refmla.backends import ALL_NAMES, PAGED, get_backend, is_sparse_kernel, plugin_defaults
from refmla.sparse.backends import BACKENDS as SPARSE_BACKENDS
from refmla.sparse.backends import availability as sparse_availability

SPARSE_NAMES = tuple(n for n in SPARSE_BACKENDS if n != "observed")  # what the sparse layout runs by name
SPARSE_ONLY = tuple(n for n in SPARSE_NAMES if n not in ALL_NAMES)  # aiter_sparse, tilelang, flashmla_sparse
NAMES = tuple(ALL_NAMES) + SPARSE_ONLY  # every name ``refmla sweep --backend`` takes
LAYOUT_BACKENDS: dict[str, tuple[str, ...]] = {
    "decode": ("triton", "aiter", "extend"),
    "verify": ("triton", "aiter", "extend"),
    "block_table": ("vllm_triton", "triton", "aiter", *PAGED),
    "sparse": ("triton", "aiter_sparse", "tilelang", "flashmla_sparse"),
}


def layout_backends() -> dict[str, tuple[str, ...]]:
    """LAYOUT_BACKENDS with the installed packages' kernels (entry points of ``refmla.backends``,
    refmla.backends.plugin_defaults) added: the sparse top-k ones to ``sparse``, the others to every
    dense layout."""
    dense, sparse = plugin_defaults(sparse=False), plugin_defaults(sparse=True)
    return {la: names + (sparse if la == "sparse" else dense) for la, names in LAYOUT_BACKENDS.items()}


def default_backends(layouts: Sequence[str]) -> list[str]:
    """The default kernels of ``layouts``, each once, in the order the layouts list them."""
    per = layout_backends()
    return list(dict.fromkeys(n for layout in layouts for n in per[layout]))


MODE = {"decode": "decode", "verify": "verify", "block_table": "decode"}  # a dense layout's capture mode


def not_read(name: str, layout: str) -> Optional[str]:
    """Why ``name`` reads no capture of ``layout`` (a dense kernel on ``sparse``, a sparse one on a
    dense layout, a decode-only kernel on ``verify``: its ``Backend.modes``), or None when it does."""
    mine = is_sparse_kernel(name)  # a sparse top-k kernel outside refmla
    if layout == "sparse":
        if name not in SPARSE_NAMES and not mine:
            return f"a dense kernel: it reads no sparse capture (sparse kernels: {', '.join(SPARSE_NAMES[1:])})"
        return None
    if name in SPARSE_ONLY or mine:
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
        if is_sparse_kernel(name):
            return get_backend(name).availability()
        return (True, "fp64 sparse reference") if name == "reference" else sparse_availability(name)
    return get_backend(name).availability()


__all__ = ["LAYOUT_BACKENDS", "NAMES", "SPARSE_NAMES", "SPARSE_ONLY", "availability", "default_backends",
           "layout_backends", "not_read"]

"""The production KV pool's geometry, for the MR region-size check (:mod:`refmla.region_check`).

With prefill/decode disaggregation, the transfer engine registers every KV buffer the pool
returns from ``get_contiguous_buf_infos()`` as one RDMA memory region; MORI's registration fails
with EINVAL once a region crosses a size limit (SGLang clamps ``max_total_num_tokens`` with
``SGLANG_MORI_MAX_MR_BYTES``, default 2 GiB). So the capture records what decides that size:

    kv_pool_rows               rows of one registered buffer (MLATokenToKVPool: size + page_size)
    kv_pool_row_bytes          bytes of one row of one layer (kv_cache_dim x element size)
    kv_pool_layers_per_buffer  layers one registered buffer holds (MLATokenToKVPool: one per layer)
    kv_pool_layers             the pool's layers on this rank (``layer_num``)
    kv_pool_size               the pool's token capacity (``size``, SGLang's max_total_num_tokens)
    disagg_mode, disagg_transfer_backend   from SGLang's server args (runtime_context.get_disagg)
    mori_max_mr_bytes          SGLANG_MORI_MAX_MR_BYTES, when it is set (an integer of bytes)
    kv_pool_region_bytes       every registered buffer's bytes, from the pool's own
    kv_pool_region_item_bytes  ``get_contiguous_buf_infos()`` (data_lens, item_lens): any pool class
    kv_pool_page_size          (MLA, DeepSeek-V4's C4 / indexer / C128 buffers, hybrid pools) gives
    kv_pool_class              the right region; the largest decides (refmla.region_check)

Every reader is defensive: a pool or server-args layout it does not know gives fewer keys, never
an error (the hook never raises into the server).
"""

from __future__ import annotations

import os
from typing import Any, Optional

MORI_ENV = "SGLANG_MORI_MAX_MR_BYTES"


def buffer_geometry(pool: Any, k_buf: Any) -> dict[str, int]:
    """Rows, row bytes and layers per registered buffer of the pool (``k_buf``: this layer's buffer).

    ``pool.kv_buffer`` is a list with one [rows, 1, D] tensor per layer (MLATokenToKVPool) or one
    tensor [layers, rows, ...] holding every layer; else the layer's own buffer stands for all.
    """
    bufs = getattr(pool, "kv_buffer", None)
    if isinstance(bufs, (list, tuple)) and bufs and hasattr(bufs[0], "shape"):
        buf, layers_per_buffer = bufs[0], 1
    elif hasattr(bufs, "shape") and len(bufs.shape) >= 3 and hasattr(k_buf, "shape") and len(bufs.shape) > len(k_buf.shape):
        buf, layers_per_buffer = bufs[0], int(bufs.shape[0])  # [layers, rows, ...] registered as one
    else:
        buf, layers_per_buffer = k_buf, 1
    rows = int(buf.shape[0])
    row_bytes = int(buf.element_size() * buf[0].numel()) if rows else 0
    out = {"kv_pool_rows": rows, "kv_pool_row_bytes": row_bytes, "kv_pool_layers_per_buffer": layers_per_buffer}
    return {k: v for k, v in out.items() if v >= 1}


def registered_regions(pool: Any) -> dict[str, Any]:
    """What the transfer engine registers: the pool's own ``get_contiguous_buf_infos()`` (data_ptrs,
    data_lens, item_lens), its page size and class. A pool without it, or one that raises, gives
    only the class (the hook never raises into the server)."""
    out: dict[str, Any] = {"kv_pool_class": type(pool).__name__}
    infos = getattr(pool, "get_contiguous_buf_infos", None)
    try:
        _, lens, items = infos()
        lens, items = [int(v) for v in lens], [int(v) for v in items]
    except Exception:
        return out
    if lens and len(lens) == len(items) and min(lens) >= 0 and min(items) >= 1:
        out.update(kv_pool_region_bytes=lens, kv_pool_region_item_bytes=items)
        page = getattr(pool, "page_size", None)
        if isinstance(page, int) and not isinstance(page, bool) and page >= 1:
            out["kv_pool_page_size"] = page
    return out


def pool_counts(pool: Any) -> dict[str, int]:
    """``kv_pool_layers`` (layer_num) and ``kv_pool_size`` (size) when the pool has them as ints."""
    out = {}
    for key, attr in (("kv_pool_layers", "layer_num"), ("kv_pool_size", "size")):
        value = getattr(pool, attr, None)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            out[key] = value
    return out


def _disagg_value(name: str) -> Optional[str]:
    """A disaggregation server arg as a string: the resolved bag first (0.5.2x), then the raw args."""
    getters = []
    try:
        from sglang.srt import runtime_context as rc

        getters += [lambda: getattr(rc.get_disagg(), name), lambda: getattr(rc.get_server_args(), name)]
    except Exception:
        pass
    for get in getters:
        try:
            value = get()
        except Exception:
            continue
        if value is not None:
            return str(getattr(value, "value", value))  # an enum: its value
    return None


def disagg_meta() -> dict[str, Any]:
    """``disagg_mode`` / ``disagg_transfer_backend`` from the server args, ``mori_max_mr_bytes`` from the env."""
    out: dict[str, Any] = {}
    for key, arg in (("disagg_mode", "disaggregation_mode"), ("disagg_transfer_backend", "disaggregation_transfer_backend")):
        value = _disagg_value(arg)
        if value is not None:
            out[key] = value
    raw = os.environ.get(MORI_ENV)
    if raw is not None and raw.strip():
        try:
            value = int(float(raw.strip()))
            if value >= 1:
                out["mori_max_mr_bytes"] = value
            else:
                out["mori_max_mr_bytes_raw"] = raw
        except ValueError:
            out["mori_max_mr_bytes_raw"] = raw  # kept as given; the check then uses the default
    return out

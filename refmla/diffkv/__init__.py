"""Transfer fidelity: the KV rows of one request, prefill side vs decode side (docs/contract.md section 3).

With prefill/decode disaggregation the prefill node writes a prompt's latent KV rows into its
pool and a transfer engine (MORI over RDMA on MI355X) copies them into the decode node's pool,
usually at other slots. Position ``j`` of a request is the row ``kv_indices[kv_indptr[b] + j]``
on either side, so the two captures can be compared position by position, bit for bit:

    pairing.py   pair requests by rid (meta ``rids``) when every capture has them, else by order;
                 the owner of position j: the prefill capture whose new tokens include j (chunked
                 prefill: each chunk's extend capture covers the whole sequence after its write),
                 else the last capture that covers j
    tokens.py    with ``kv_token_ids`` on every capture: pair by the token ids the rows hold, not by rid (a
                 prefix reused from a prefix cache, a host tier or an L3 store is compared with the capture
                 that wrote it); per request who wrote its rows and the tier its mismatched rows came from
    diff.py      every position both sides hold (the decode side may hold more), compared; per
                 request: positions compared, mismatched, first mismatch, mismatched pages
                 (decode page_size), max abs difference, row norms of both sides
    runs.py      with physical slots on both sides (``orig_kv_indices``): maximal runs of
                 positions contiguous in both pools -- what one RDMA write moves -- that hold
                 mismatches, with a detected position offset or not-landed (zero) rows
    provenance.py every prefill row hashed by its bytes: where each mismatched decode row's bytes
                 are (another request's page, the same request k pages off, a page written twice)
    result.py    the typed result (DiffResult > RequestDiff > Mismatches, TransferRuns) and its JSON
                 (rendered as text by refmla.render.diffkv)
    views.py     a sparse capture's cache (V4 window / compressed, V3.2 main; its KV map) as rows the
                 diff reads: each token's packed bytes one row, -1 positions not held
    sparse.py    files of either kind; a sparse pair: the diff per cache, merged, each entry with its ``cache``

``diff_kv_files`` reads the captures (dense or sparse); ``diff_kv`` compares captures already read (e.g. grouped by
layer and rank) and returns the same typed result: ``result.request(rid)`` is a RequestDiff with
``faithful``, ``first_mismatch``, ``first_page`` and ``first_run``.

Comparing reads each attended row of both pools once more (gathered in chunks as 64-bit words),
so it costs about as much as reading the two files (``tools/bench_diffkv.py``).
"""

from refmla.diffkv.diff import diff_kv
from refmla.diffkv.pairing import Pairing, PairedRequest, Source, pair_requests
from refmla.diffkv.result import (
    DiffResult,
    MismatchDetail,
    Mismatches,
    PrefillDisagreement,
    RequestDiff,
    TransferRun,
    TransferRuns,
)
from refmla.diffkv.sparse import diff_any, diff_kv_files, diff_sparse, read_kv
from refmla.diffkv.views import CacheRows

__all__ = [
    "CacheRows", "DiffResult", "MismatchDetail", "Mismatches", "Pairing", "PairedRequest", "PrefillDisagreement",
    "RequestDiff", "Source", "TransferRun", "TransferRuns", "diff_any", "diff_kv", "diff_kv_files", "diff_sparse",
    "pair_requests", "read_kv",
]  # fmt: skip

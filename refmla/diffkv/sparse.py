"""diff-kv of files of either kind, and over sparse pools (DeepSeek-V4 window + compressed caches,
V3.2's one cache): the one diff (refmla.diffkv.diff) per cache of the pair, each cache's rows as
:class:`refmla.diffkv.views.CacheRows`, merged into one :class:`DiffResult` whose requests carry their
``cache``.

    diff_kv_files  read the captures (dense or sparse, by meta ``mode``) and compare them
    diff_any     captures already read: dense ones by the one diff, sparse ones by diff_sparse
    diff_sparse  prefill sparse capture(s) against one decode sparse capture: per cache, every position
                 both sides hold compared as packed bytes (fp8 values, rope, scales), mismatched
                 positions and pages in that cache's page size, transfer runs in its physical slots
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Sequence, Union

from refmla.capture import Capture, CaptureError, read_capture
from refmla.diffkv.diff import diff_kv as diff_dense
from refmla.diffkv.result import DiffResult
from refmla.diffkv.views import CacheRows, views
from refmla.sparse.format import SparseCapture
from refmla.sparse.validation import is_sparse_file, read_sparse
from refmla.util import single_thread

AnyCapture = Union[Capture, SparseCapture]


def diff_kv_files(prefill_paths: Union[str, Path, Sequence[str]], decode_path: str) -> DiffResult:
    """Read the captures and compare their KV rows (see :mod:`refmla.diffkv`).

    Raises CaptureError for a file that cannot be read or captures that cannot be compared
    (different row widths or layouts, a dense one against a sparse one, no request in common).
    """
    if isinstance(prefill_paths, (str, Path)):
        prefill_paths = [prefill_paths]
    if not prefill_paths:
        raise CaptureError("<prefill>", "arguments", "at least one prefill capture is needed")
    with single_thread():
        prefill = [read_kv(p) for p in prefill_paths]
        return diff_any(prefill, read_kv(decode_path))


def read_kv(path: Any) -> AnyCapture:
    """A dense or a sparse capture, read and validated (CaptureError naming the file)."""
    return read_sparse(path) if is_sparse_file(path) else read_capture(path)


def diff_any(prefill: Sequence[AnyCapture], decode: AnyCapture,
             cache_views: Optional[dict] = None) -> DiffResult:  # fmt: skip
    """The diff of dense captures, or of sparse ones (one side of each kind is a CaptureError)."""
    sparse = [isinstance(c, SparseCapture) for c in [*prefill, decode]]
    if not any(sparse):
        return diff_dense(list(prefill), decode)
    if not all(sparse):
        odd = next(c for c, s in zip([*prefill, decode], sparse) if s != sparse[-1])
        raise CaptureError(odd.path, "meta key 'mode'",
                           f"{'a sparse' if sparse[-1] is False else 'a dense'} capture, but {decode.path} is "
                           f"{'dense' if sparse[-1] is False else 'sparse'}: a dense pool and a sparse one cannot "
                           "be compared")  # fmt: skip
    return diff_sparse(list(prefill), decode, cache_views)


def diff_sparse(prefill: list[SparseCapture], decode: SparseCapture, cache_views: Optional[dict] = None) -> DiffResult:
    """Each cache of the pair diffed (refmla.diffkv.diff on its CacheRows), merged (module docstring).
    ``cache_views``: refmla.diffkv.views.views(prefill, decode), when already built."""
    per = cache_views if cache_views is not None else views(prefill, decode)
    results = {name: (diff_dense(p, d), d) for name, (p, d) in per.items()}
    return merge(results, prefill, decode)


def merge(results: dict[str, tuple[DiffResult, CacheRows]], prefill: list[SparseCapture],
          decode: SparseCapture) -> DiffResult:  # fmt: skip
    """One result: each request's entry per cache (main cache first), the counts summed."""
    main = next(iter(results.values()))[0]
    entries = []
    for e in main.requests:
        for name, (res, _) in results.items():
            mine = next(x for x in res.requests if x.request == e.request)
            mine.cache = name
            entries.append(mine)
    total = sum(r.positions_compared for r, _ in results.values())
    mismatched = sum(r.mismatched_positions for r, _ in results.values())
    common = set(main.notes).intersection(*(set(r.notes) for r, _ in results.values()))  # the pairing's
    notes = [n for n in main.notes if n in common]
    for res, rows in results.values():
        notes += [f"{rows.label}: {n}" for n in res.notes if n not in common]
        if res.error is not None and total:
            notes.append(f"{rows.label}: {res.error}")
    return DiffResult(
        ok=mismatched == 0 and total > 0,
        error=None if total else main.error,
        requests=entries,
        prefill=[c.path for c in prefill],
        decode=decode.path,
        pairing=main.pairing,
        page_size=main.page_size,
        compared="bytes",
        physical_slots=all(r.physical_slots for r, _ in results.values()),
        positions_compared=total,
        mismatched_positions=mismatched,
        mismatched_requests=len({e.request for e in entries if e.mismatched_positions}),
        paired_requests=main.paired_requests,
        prefill_only=main.prefill_only,
        decode_only=main.decode_only,
        notes=notes,
        caches={name: {"label": rows.label, "layout": rows.layout.name, "page_size": rows.page,
                       "positions_compared": r.positions_compared, "mismatched_positions": r.mismatched_positions,
                       "physical_slots": r.physical_slots, "ratio": rows.ratio if name == "compressed" else 1}
                for name, (r, rows) in results.items()},
    )  # fmt: skip


__all__ = ["AnyCapture", "diff_any", "diff_kv_files", "diff_sparse", "merge", "read_kv"]

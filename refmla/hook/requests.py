"""What each captured row holds: the token ids of SGLang's requests and where their cached prefix came
from, read from the scheduler's ``Req`` objects as ``ForwardBatch.init_new(batch, ...)`` receives them.

The attention call sees only ``forward_batch.rids``; the token ids of a request's whole sequence and
its prefix-cache split live on ``batch.reqs`` (``origin_input_ids`` + ``output_ids``, and
``cached_tokens_device`` / ``cached_tokens_host`` / ``cached_tokens_storage``, SGLang's per-tier split of
the cached prefix, with ``storage_hit_start`` where the L3 span starts). The wrapper of ``init_new``
keeps, per rid, a weak reference to the request (a dict lookup per request and forward; nothing of the
server kept alive), in a bounded table; when a call is captured :func:`rows_of` reads the request's
lists and split then and turns them into the capture's ``kv_token_ids`` / ``kv_origin`` rows
(docs/contract.md, "row tokens").

Positions of a request in SGLang's order: its cached prefix first, device hit then host (HiCache L2)
then the L3 store's span, then the tokens it computed. The wrapper never raises into ``init_new`` and
returns its result as it is; a release without ``reqs`` or these fields leaves the tensors out
(said once). Torch-free: imported when the hook is installed.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Optional

from refmla.hook.call import dressed_as

MAX_REQUESTS = 4096  # rids remembered (the oldest forgotten first)
COMPUTED, DEVICE_HIT, HOST, STORAGE, UNKNOWN = 0, 1, 2, 3, -1  # refmla.capture.rows.ORIGINS codes


@dataclass(frozen=True)
class RequestRows:
    """One request as the scheduler knows it: references to its token lists, and its cache split."""

    prompt: Any  # origin_input_ids (a list / array, not copied)
    output: Any  # output_ids (appended to in place as it decodes; None: none known)
    device: int  # cached_tokens_device: positions [0, device) a device prefix-cache hit
    host: int  # cached_tokens_host: loaded back from the host tier
    storage: int  # cached_tokens_storage: fetched from the L3 store
    storage_start: Optional[int]  # storage_hit_start: where the L3 span starts (None: after the host span)


class RequestTable:
    """rid -> a weak reference to its ``Req`` (read when a call is captured), the newest MAX_REQUESTS.

    A weak reference keeps nothing of the server alive (a finished request's objects go when the
    scheduler drops them); a request already in the table is skipped, so a forward costs a dict lookup
    per request. An object that cannot be weakly referenced is kept as a :class:`RequestRows` snapshot."""

    def __init__(self, limit: int = MAX_REQUESTS):
        self._refs: "OrderedDict[str, Any]" = OrderedDict()
        self._lock, self.limit = threading.Lock(), limit

    def put(self, rid: str, req: Any) -> None:
        try:
            ref: Any = weakref.ref(req)
        except TypeError:
            ref = _snapshot(req)
        with self._lock:
            self._refs[rid] = ref
            while len(self._refs) > self.limit:
                self._refs.popitem(last=False)

    def known(self, rid: str, req: Any) -> bool:
        """``req`` is the one remembered under ``rid``."""
        ref = self._refs.get(rid)
        return isinstance(ref, weakref.ref) and ref() is req

    def get(self, rid: str) -> Optional[RequestRows]:
        """What the request under ``rid`` holds now (None: not seen, or gone)."""
        with self._lock:
            ref = self._refs.get(rid)
        if isinstance(ref, RequestRows) or ref is None:
            return ref
        req = ref()
        try:
            return _snapshot(req) if req is not None else None
        except Exception:  # a request object that cannot be read now: its rows are unknown
            return None

    def clear(self) -> None:
        with self._lock:
            self._refs.clear()


TABLE = RequestTable()


def _count(req: Any, name: str) -> int:
    v = getattr(req, name, 0)
    return int(v) if isinstance(v, int) and not isinstance(v, bool) and v > 0 else 0


def _snapshot(req: Any) -> RequestRows:
    """A request's token lists (references) and cache split, read now."""
    start = getattr(req, "storage_hit_start", None)
    return RequestRows(getattr(req, "origin_input_ids", None) or (), getattr(req, "output_ids", None),
                       _count(req, "cached_tokens_device"), _count(req, "cached_tokens_host"),
                       _count(req, "cached_tokens_storage"), start if isinstance(start, int) and start >= 0 else None)  # fmt: skip


def record(batch: Any, table: RequestTable = TABLE) -> int:
    """Remember every request of ``batch.reqs`` not remembered yet (reads attributes only); how many."""
    n = 0
    for req in list(getattr(batch, "reqs", None) or ()):
        rid = getattr(req, "rid", None)
        rid = rid if isinstance(rid, str) else str(rid) if rid is not None else None
        if rid is None or table.known(rid, req) or getattr(req, "origin_input_ids", None) is None:
            continue
        table.put(rid, req)
        n += 1
    return n


def rows_of(rows: Optional[RequestRows], L: int) -> tuple[list[int], list[int]]:
    """A request's first ``L`` positions: (token ids, origin codes); -1 where not known."""
    if rows is None:
        return [-1] * L, [UNKNOWN] * L
    prompt = list(rows.prompt[:L])
    output = list(rows.output[: max(L - len(prompt), 0)]) if rows.output is not None else []
    tokens = [int(t) for t in prompt + output][:L]
    tokens += [-1] * (L - len(tokens))
    origin = [COMPUTED] * L
    d, h, s = rows.device, rows.host, rows.storage
    s0 = rows.storage_start if rows.storage_start is not None else d + h  # the L3 span (SGLang: after the host's)
    for lo, hi, code in ((0, d, DEVICE_HIT), (d, d + h + s, HOST), (s0, s0 + s, STORAGE)):
        origin[max(lo, 0) : min(hi, L)] = [code] * max(min(hi, L) - max(lo, 0), 0)
    return tokens, origin


def wrap_init_new(original: Any, state_of: Callable[[], Any]) -> classmethod:
    """``ForwardBatch.init_new`` (a classmethod) wrapped: the batch's requests recorded, then the original
    called with the same arguments and its result returned as it is."""
    fn = original.__func__

    def init_new(cls, batch, *args, **kwargs):
        state = state_of()
        if state is not None and state.active:
            try:
                if getattr(batch, "reqs", None) is None:
                    state.once("noreqs", logging.INFO, "ForwardBatch.init_new got no reqs: captures carry no token ids (said once)")
                record(batch)
            except Exception as e:  # never into the server; the capture just lacks the tensors
                state.once("reqs-failed", logging.WARNING, "reading the batch's requests failed (%s: %s): captures carry "
                           "no token ids (said once)", type(e).__name__, e)  # fmt: skip
        return fn(cls, batch, *args, **kwargs)

    return classmethod(dressed_as(init_new, fn))


__all__ = ["MAX_REQUESTS", "RequestRows", "RequestTable", "TABLE", "record", "rows_of", "wrap_init_new"]

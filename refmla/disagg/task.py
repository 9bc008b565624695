"""What one worker does for one decode capture: replay it, then -- while its pages are still in the
page cache -- diff it against the prefill captures of its diff job. Runs in the replay's worker
processes (refmla.batch.replay_many with ``task``), so the diffs are spread over the ``--jobs``
workers and each decode capture is read from disk once instead of twice."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from refmla.batch import replay_one
from refmla.capture import CaptureError
from refmla.context import ReplayOptions
from refmla.diffkv import DiffResult, diff_any, read_kv
from refmla.diffkv.views import views
from refmla.disagg.foreign import foreign_source
from refmla.sparse.format import SparseCapture
from refmla.disagg.plan import DiffJob
from refmla.results import ReplayReport
from refmla.util import single_thread


@dataclass
class DecodeDone:
    report: ReplayReport
    diff: Optional[DiffResult] = None
    entries: dict = field(default_factory=dict)  # rid -> (RequestDiff, source rid or None, caches) | error text
    error: Optional[tuple[str, str]] = None  # (prefill capture, one line) when one could not be read


def decode_task(path: str, opts: ReplayOptions, jobs: Optional[dict] = None) -> DecodeDone:
    """Replay ``path``; then its diff job (``jobs[path]``), if it has one. Never raises."""
    done = DecodeDone(replay_one(path, opts))
    job = (jobs or {}).get(path)
    if job is not None:
        with single_thread():  # reading validates with many small index operations (see diff_kv)
            run_diff(job, done)
    return done


def run_diff(job: DiffJob, done: DecodeDone) -> None:
    per = None  # a sparse pair: cache name -> its rows on both sides (refmla.diffkv.views)
    try:
        prefill = [read_kv(p) for p in job.prefill]
        decode = read_kv(job.decode)
        if isinstance(decode, SparseCapture) and all(isinstance(c, SparseCapture) for c in prefill):
            per = views(prefill, decode)
        done.diff = diff_any(prefill, decode, per)
    except CaptureError as e:
        done.entries = {rid: str(e) for rid in job.rids}
        if e.path in job.prefill:
            done.error = (e.path, str(e))  # an unreadable prefill capture: exit 2
        return
    except Exception as e:  # refmla itself failed on this pair: the rows say so, the run goes on
        done.entries = {rid: f"diff-kv failed: {type(e).__name__}: {e}" for rid in job.rids}
        return
    for rid in job.rids:
        try:
            entry = done.diff.request(rid)
        except KeyError:
            done.entries[rid] = "not paired by diff-kv"
            continue
        source = None
        if not entry.faithful and entry.paired and (entry.first_run is None or entry.first_run.offset is None):
            pre, dec = per[entry.cache] if per is not None else (prefill, decode)
            source = foreign_source(entry, pre, dec)
        caches = None
        if done.diff.caches is not None:  # each cache's entry of this request, with its label and ratio
            caches = {e.cache: (done.diff.caches[e.cache], e) for e in done.diff.entries_of(rid)}
        done.entries[rid] = (entry, source, caches)

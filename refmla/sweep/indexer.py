"""The ``indexer`` layout: DeepSeek's lightning indexer (V3.2: every token an entry; V4 C4: one
entry per 4 tokens), a point made concrete by refmla.indexer.synth (fp8 keys with per-token
scales in DeepGEMM's paged layout, or bf16; shuffled pages of 64, one spare page past each
request's bound), run through the indexer backends by name (refmla.indexer.backends: SGLang's and
vLLM's indexer code, the DeepGEMM / tilelang / aiter adapters where they run) and judged by the
one set judge (refmla.indexer.reference), as ``refmla replay`` judges an indexer capture.

    point {"ratio": 4, "heads": 64, "topk": 512, "length": "topk+1", "keys": "fp8", ...}
          --indexer_case--> IndexerSweepCase --capture()--> IndexerCapture --IndexerChecks--> checks

``reference``: the produced set against the fp64 top-k within the noise; ``repeat``: N runs bit
for bit (the indices). ``nan_fill`` and ``splits`` are n/a: the indexer backends allocate their
logits and indices and take no split count. A point a backend cannot read is n/a with the reason
(the engines' torch paths and the adapters take fp8 keys only).

``length`` is request 0's entries (the tokens are entries x ratio + ratio - 1: the compressed
token not yet complete is not scored), relative to the 64-entry pages and the top-k width.
"""

from __future__ import annotations

import random
import time
from dataclasses import asdict, dataclass, replace
from typing import Any, Iterator, Mapping, Optional, Sequence

import torch

from refmla.backends.base import BackendUnavailable
from refmla.indexer.backends import BACKENDS, FP8_ONLY, Unavailable
from refmla.indexer.format import IndexerCapture, parse_indexer_meta
from refmla.indexer.io import write_indexer
from refmla.indexer.reference import Scores, judge_sets
from refmla.indexer.synth import Preset, indexer_call
from refmla.options import ReplayOptions
from refmla.sweep import budget
from refmla.sweep.bounds import CPU, Bounds
from refmla.sweep.budget import CutOff
from refmla.sweep.cases import case_seed
from refmla.sweep.checks import CHECKS, Evidence, Timing, repeat_check, run_checks
from refmla.sweep.report import CheckOutcome
from refmla.sweep.space import INDEX_HEADS, index_entries

NAMES = ("reference", *BACKENDS)  # what the indexer layout runs by name
OTHER_ENTRIES = ("0", "1", "63", "65", "200")  # the batch's other requests' entries
NO_BUFFERS = "the indexer backends allocate their own logits and indices"
NO_SPLITS = "no indexer backend takes a split count"


@dataclass
class IndexerSweepCase:
    name: str
    ratio: int
    entries: tuple  # entries per request (tokens = entries x ratio + ratio - 1)
    heads: int
    topk: int
    keys: str  # fp8 | bf16
    indices: str  # slots | positions
    seed: int

    def params(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items() if k != "name"}

    def tensors_and_meta(self, engine: str = "synth") -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        seq = tuple(n * self.ratio + self.ratio - 1 for n in self.entries)
        p = Preset(self.heads, 128, self.topk, self.ratio, seq, fp8=self.keys == "fp8", indices_kind=self.indices)
        t, meta = indexer_call(p, "none", self.seed, model=f"sweep-{self.name}")
        return t, {**meta, "engine": engine}

    def capture(self) -> IndexerCapture:
        t, meta = self.tensors_and_meta()
        return IndexerCapture(path=f"<{self.name}>", meta=parse_indexer_meta(meta, self.name), **t)


def indexer_case(point: Mapping[str, Any], seed: int, index: int, bounds: Bounds = CPU) -> IndexerSweepCase:
    """The concrete case of an indexer point: request 0's entries from the point, the others short
    (drawn from the case's seed)."""
    cs = case_seed(seed, "indexer", index)
    rng = random.Random(cs)
    topk = int(point["topk"])
    lens = [index_entries(str(point["length"]), topk)] + [int(rng.choice(OTHER_ENTRIES)) for _ in range(int(point["batch"]) - 1)]
    return IndexerSweepCase(f"sweep-indexer-{index}", int(point["ratio"]), tuple(lens), int(point["heads"]), topk,
                            str(point["keys"]), str(point["indices"]), cs)  # fmt: skip


def refuses(backend: str, case: IndexerSweepCase) -> Optional[str]:
    """Why ``backend`` cannot read this point (its checks are n/a), or None."""
    if backend in FP8_ONLY and case.keys != "fp8":
        return f"{backend} takes fp8 keys only (this point's are {case.keys})"
    return None


@dataclass
class IndexerRun:
    out: torch.Tensor  # [B, K] the indices produced


def reference_topk(cap: IndexerCapture, scores: Scores) -> torch.Tensor:
    """[B, K] the fp64 reference's top-k in the capture's numbering (the ``reference`` backend)."""
    K = cap.meta.topk
    out = torch.full((cap.q.shape[0], K), -1, dtype=torch.int64)
    ps = cap.meta.page_size
    for b in range(cap.q.shape[0]):
        s = scores[b].logits
        pos = torch.topk(s, min(K, s.numel())).indices
        if cap.meta.indices_kind == "slots":
            pos = cap.page_table[b].long()[pos // ps] * ps + pos % ps
        out[b, : pos.numel()] = pos
    return out


class IndexerChecks:
    """One indexer case, its reference computed once, checked against any number of backends."""

    def __init__(self, case: IndexerSweepCase, opts: ReplayOptions, repeat: int = 3, deadline: Optional[float] = None):
        self.case, self.opts, self.repeat = case, opts, repeat
        self.deadline = deadline  # a budget.now() time: past it, no kernel starts (refmla.sweep.budget)
        self.timing = Timing()
        self.cap = case.capture()
        self.scores = Scores(self.cap, opts.tol.k)

    def kernel(self, backend: str) -> IndexerRun:
        if self.deadline is not None and budget.now() >= self.deadline:
            raise CutOff()
        t0 = time.perf_counter()
        try:
            if backend == "reference":
                return IndexerRun(reference_topk(self.cap, self.scores.fill(range(self.cap.q.shape[0]))))
            return IndexerRun(BACKENDS[backend](self.cap).long())
        except Unavailable as e:
            raise BackendUnavailable(str(e)) from None
        finally:
            self.timing.kernel += time.perf_counter() - t0

    def judge(self, got: IndexerRun) -> tuple[bool, str, dict]:
        t0 = time.perf_counter()
        j = judge_sets(self.cap, got.out, self.scores)
        self.timing.reference += time.perf_counter() - t0
        return j.ok, j.text(), {"index_sets": j.to_json()}

    def run(self, backend: str, only: Sequence[str] = CHECKS) -> tuple[dict[str, CheckOutcome], dict[str, Evidence]]:
        why = refuses(backend, self.case)
        if why:
            return {c: CheckOutcome(c, "n/a", why) for c in only}, {}
        return run_checks(self, backend, only, lambda: self.kernel(backend))

    def _evidence(self, got: IndexerRun) -> Evidence:
        return Evidence(got.out, None, self.case)  # type: ignore[arg-type]

    def _reference(self, backend: str, first: IndexerRun):
        passed, text, data = self.judge(first)
        if passed:
            return CheckOutcome("reference", "pass", text), None
        return CheckOutcome("reference", "fail", text, data), self._evidence(first)

    def _nan_fill(self, backend: str, first: IndexerRun):
        return CheckOutcome("nan_fill", "n/a", NO_BUFFERS), None

    def again(self, backend: str) -> IndexerRun:
        return self.kernel(backend)

    def passes(self, backend: str, got: IndexerRun) -> bool:
        return self.judge(got)[0]

    def kept(self, got: IndexerRun) -> Evidence:
        return self._evidence(got)

    def _repeat(self, backend: str, first: IndexerRun):
        return repeat_check(self, backend, first)

    def _splits(self, backend: str, first: IndexerRun):
        return CheckOutcome("splits", "n/a", NO_SPLITS), None


def indexer_candidates(case: IndexerSweepCase) -> Iterator[tuple[str, IndexerSweepCase]]:
    """Smaller indexer cases, the biggest cuts first: fewer requests, fewer entries, fewer heads."""
    lens, B = tuple(case.entries), len(case.entries)
    if B > 1:
        yield f"requests {B} -> {B // 2}", replace(case, entries=lens[: B // 2])
        yield f"requests {B} -> {B - B // 2}", replace(case, entries=lens[B // 2 :])
        for i in range(B):
            yield f"requests {B} -> {B - 1} (request {i} dropped)", replace(case, entries=lens[:i] + lens[i + 1 :])
    for i, n in enumerate(lens):
        for shorter in dict.fromkeys((n // 2, n - 1)):
            if 0 <= shorter < n:
                yield f"request {i} length {n} -> {shorter}", replace(case, entries=lens[:i] + (shorter,) + lens[i + 1 :])
    for h in sorted(h for h in INDEX_HEADS if h < case.heads):
        yield f"heads {case.heads} -> {h}", replace(case, heads=h)


def write_indexer_capture(path: Any, ev: Evidence, sweep_meta: dict, backend: str) -> None:
    """A failing run of an indexer case as an indexer capture: its inputs and the indices the
    backend produced (the synth's where it raised: ``ev.out`` None; the replay reruns it)."""
    t, meta = ev.case.tensors_and_meta(backend)  # type: ignore[union-attr]
    if ev.out is not None:
        t["indices"] = ev.out.int()
    write_indexer(path, t, {**meta, **sweep_meta})


__all__ = ["NAMES", "IndexerChecks", "IndexerSweepCase", "indexer_candidates", "indexer_case", "refuses",
           "write_indexer_capture"]

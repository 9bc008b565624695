"""The ``sparse`` layout: DeepSeek's sparse MLA decode (V3.2 DSA; a V4 layer's window cache with its
C4 or C128 compressed cache, or alone), a point made concrete by refmla.sparse.synth (hostile:
shuffled pages, NaN bytes in every unwritten token and its scales, stale entries of other requests
past topk_length, then -1), run through the sparse kernels by name (refmla.sparse.backends:
``triton`` SGLang's Triton sparse kernel, ``aiter_sparse``, ``tilelang``, ``flashmla_sparse``;
``reference`` the fp64 truth) and judged by refmla.sparse.reference with the one comparator, as
``refmla replay`` judges a sparse capture.

    point {"cache": "v4-c4", "topk": 512, "length": "width-1", ...} --sparse_case--> SparseSweepCase
          --capture()--> SparseCapture --SparseChecks--> the four checks, each by name

``reference``: out and lse against the fp64 reference, the tolerance from the control at the
kernels' rounding points (a lonely row: out 0, lse +inf); ``repeat``: N runs bit for bit (out and
lse). ``nan_fill`` is n/a: every sparse kernel allocates its own output and split-K buffers;
``splits`` is n/a: no sparse kernel takes a split count (SGLang's picks its split-K from the
shape: the batch, heads and widths axes reach its paths). A point a kernel cannot read is n/a
with the reason (:func:`refuses`: SGLang's Triton kernel reads the V4 layout only).

Also the dispatch every later module uses: :func:`any_case` / :func:`any_checks` pick the dense
(refmla.sweep.cases, refmla.sweep.checks), the indexer (refmla.sweep.indexer) or the sparse kind of a layout.
"""

from __future__ import annotations

import functools
import random
from dataclasses import asdict, dataclass, replace
from typing import Any, Iterator, Mapping, Optional, Sequence, Union

import torch

from refmla.golden.cases import GoldenCase
from refmla.isolation import enabled
from refmla.options import ReplayOptions
from refmla.sparse.arithmetic import SGLANG_TRITON_SPARSE
from refmla.sparse.backends import BACKENDS, KERNELS, PathOutput, declared_arithmetic
from refmla.sparse.format import KERNEL_BACKENDS, SparseCapture, parse_sparse_meta
from refmla.sparse.kernel import arithmetic_of, sparse_path
from refmla.sparse.presets import PRESETS, SparsePreset
from refmla.sparse.reference import judge_lse, judge_out, rows_of, sparse_control, sparse_reference
from refmla.sparse.synth import build_case
from refmla.sparse.validation import write_sparse
from refmla.sweep import budget
from refmla.sweep.budget import CutOff
from refmla.sweep.cases import case_of, case_seed
from refmla.sweep.checks import CHECKS, CaseChecks, Evidence, Timing, repeat_check, run_checks
from refmla.sweep.indexer import IndexerChecks, IndexerSweepCase, indexer_case
from refmla.sweep.report import CheckOutcome
from refmla.sweep.bounds import CPU, Bounds
from refmla.sweep.space import HEADS, RATIO, sparse_context, sparse_units, sparse_valid

PRESET_OF = {"v4-c4": "deepseek-v4-flash-tp8", "v4-c128": "deepseek-v4-flash-tp8-c128",
             "v4-swa": "deepseek-v4-flash-tp8-swa", "v32": "deepseek-v3.2-tp8"}  # fmt: skip
OTHER_LENGTHS = ("0", "1", "2", "64", "65", "129")  # the batch's other requests' contexts
NO_BUFFERS = "every sparse kernel allocates its own output and split-K buffers"
NO_SPLITS = "no sparse kernel takes a split count (SGLang's Triton kernel picks its split-K from the shape)"


@dataclass
class SparseSweepCase:
    name: str
    cache: str  # v4-c4 | v4-c128 | v4-swa | v32 (refmla.sweep.space.CACHES)
    seq_lens: tuple  # context tokens per request
    num_heads: int
    topk: int  # the indexer's index width (V3.2: main; V4 C4 / C128: the compressed scope)
    page_size: int  # the main cache's page; a compressed cache's is page / ratio (at least 1)
    sink: str  # on | off | large
    topk_length: str  # given | none
    seed: int

    def params(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items() if k != "name"}

    def preset(self) -> SparsePreset:
        base, ratio = PRESETS[PRESET_OF[self.cache]], RATIO[self.cache]
        p = replace(base, heads=self.num_heads, page_size=self.page_size, seq_lens=tuple(self.seq_lens),
                    seed=self.seed, sink=self.sink != "off")  # fmt: skip
        if self.cache == "v32":
            return replace(p, topk=self.topk)
        return replace(p, extra_topk=self.topk, extra_page_size=max(1, self.page_size // ratio)) if ratio else p

    def tensors_and_meta(self, backend: str = "unknown") -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """The call's tensors (refmla.sparse.synth; the sink and topk_length as the point says) and meta."""
        case = build_case(self.preset())
        t = case.tensors()
        if self.sink == "large":
            g = torch.Generator().manual_seed(self.seed)
            t["attn_sink"] = (8.0 + torch.randn(self.num_heads, generator=g)).float()
        if self.topk_length == "none":  # no lengths: every entry is read up to -1, so the stale tail is -1
            for idx, length in (("indices", "topk_length"), ("extra_indices", "extra_topk_length")):
                if length in t:
                    past = torch.arange(t[idx].shape[-1])[None, None, :] >= t.pop(length).long()[:, None, None]
                    t[idx] = t[idx].masked_fill(past, -1)
        return t, case.meta(backend if backend in KERNEL_BACKENDS else "unknown")

    def capture(self) -> SparseCapture:
        t, meta = self.tensors_and_meta()
        return SparseCapture(path=f"<{self.name}>", meta=parse_sparse_meta(meta), **t)


def sparse_case(point: Mapping[str, Any], seed: int, index: int, bounds: Bounds = CPU) -> SparseSweepCase:
    """The concrete case of a sparse point: request 0's context from the point, the others short
    edges (drawn from the case's seed) while the case stays in the CPU's budget."""
    cs = case_seed(seed, "sparse", index)
    rng = random.Random(cs)
    cache, topk, H = str(point["cache"]), int(point["topk"]), int(point["heads"])
    lens = [sparse_context(str(point["length"]), cache, topk)]
    for _ in range(int(point["batch"]) - 1):
        L = int(rng.choice(OTHER_LENGTHS))
        fits = sparse_units(H, [sparse_valid(n, cache, topk) for n in lens + [L]]) <= bounds.sparse_units
        lens.append(L if fits else 0)
    return SparseSweepCase(name=f"sweep-sparse-{index}", cache=cache, seq_lens=tuple(lens), num_heads=H, topk=topk,
                           page_size=int(point["page"]), sink=str(point["sink"]),
                           topk_length=str(point["topk_length"]), seed=cs)  # fmt: skip


def refuses(backend: str, case: SparseSweepCase) -> Optional[str]:
    """Why ``backend`` cannot read this point (its checks are n/a), or None."""
    if backend == "triton" and case.cache == "v32":
        return "SGLang's Triton sparse kernel reads the V4 layout only (d_qk 512); this point is V3.2's (d_qk 576)"
    return None


class SparseChecks:
    """One sparse case, its reference and control computed once, checked against any number of backends."""

    def __init__(self, case: SparseSweepCase, opts: ReplayOptions, repeat: int = 3, deadline: Optional[float] = None):
        self.case, self.opts, self.repeat = case, opts, repeat
        self.deadline = deadline  # a budget.now() time: past it, what is left is not run (refmla.sweep.budget)
        self.timing = Timing()
        self.cap = case.capture()
        self._truth: Optional[tuple] = None
        self._controls: dict = {}  # SparseArithmetic -> its control (a kernel declaring other than SGLang's Triton)

    @property
    def truth(self) -> tuple:
        """(reference, control) of the case: computed once a kernel has run."""
        if self._truth is None:
            if self.deadline is not None and budget.now() >= self.deadline:
                raise CutOff()
            t0 = budget.now()
            rows = rows_of(self.cap)
            self._truth = (sparse_reference(self.cap, rows), sparse_control(self.cap, rows))
            self.timing.reference += budget.now() - t0
        return self._truth

    def kernel(self, backend: str) -> PathOutput:
        mine = backend not in BACKENDS  # a sparse top-k kernel outside refmla (refmla.sparse.kernel)
        run = functools.partial(sparse_path, backend) if mine else BACKENDS[backend]
        t0 = budget.now()
        try:
            isolated = (mine or backend in KERNELS) and enabled(self.opts.isolate)
            return budget.call(run, (self.cap,), self.opts.kernel_seconds, self.deadline, isolated)
        finally:
            self.timing.kernel += budget.now() - t0

    def judge(self, name: str, got: PathOutput) -> tuple[bool, str, dict]:
        """(passed, what it says, its numbers) of one run's out and lse against the reference, at the
        path's own declared arithmetic (refmla.sparse.arithmetic)."""
        ref, ctrl = self.truth
        t0 = budget.now()
        arith = arithmetic_of(name) if name not in BACKENDS else declared_arithmetic(name, self.cap)
        if arith != SGLANG_TRITON_SPARSE:  # the truth's control is that one's
            if arith not in self._controls:
                self._controls[arith] = sparse_control(self.cap, rows_of(self.cap), arith=arith)
            ctrl = self._controls[arith]
        cmp = judge_out(name, self.cap, got.out, ref, ctrl, self.opts.tol, arith)
        lse = judge_lse(got.lse, ref, ctrl, self.opts.tol) if got.lse is not None else None
        self.timing.reference += budget.now() - t0
        lse_bad = lse is not None and lse.status != "pass"
        reasons = list(cmp.reasons) + ([lse.reason or "lse fails"] if lse_bad else [])  # type: ignore[union-attr]
        data = {"comparison": cmp.to_json(), **({"lse": lse.to_json()} if lse is not None else {})}
        return not reasons, "; ".join(reasons) or cmp.summary(), data

    def run(self, backend: str, only: Sequence[str] = CHECKS) -> tuple[dict[str, CheckOutcome], dict[str, Evidence]]:
        """The checks ``only`` (default all) of ``backend`` on this case; the failing runs' evidence."""
        why = refuses(backend, self.case)
        if why:
            return {c: CheckOutcome(c, "n/a", why) for c in only}, {}
        return run_checks(self, backend, only, lambda: self.kernel(backend))

    def _evidence(self, got: PathOutput) -> Evidence:
        return Evidence(got.out, None, self.case, lse=got.lse)  # type: ignore[arg-type]

    def _reference(self, backend: str, first: PathOutput):
        passed, text, data = self.judge(backend, first)
        if passed:
            return CheckOutcome("reference", "pass", text), None
        return CheckOutcome("reference", "fail", text, data), self._evidence(first)

    def _nan_fill(self, backend: str, first: PathOutput):
        return CheckOutcome("nan_fill", "n/a", NO_BUFFERS), None

    def again(self, backend: str) -> PathOutput:
        """Another run on the same inputs (the repeat check's)."""
        return self.kernel(backend)

    def passes(self, backend: str, got: PathOutput) -> bool:
        return self.judge(backend, got)[0]

    def kept(self, got: PathOutput) -> Evidence:
        return self._evidence(got)

    def _repeat(self, backend: str, first: PathOutput):
        return repeat_check(self, backend, first)  # the one repeat check (refmla.sweep.checks), every case kind

    def _splits(self, backend: str, first: PathOutput):
        return CheckOutcome("splits", "n/a", NO_SPLITS), None


def sparse_candidates(case: SparseSweepCase) -> Iterator[tuple[str, SparseSweepCase]]:
    """Smaller sparse cases, the biggest cuts first: fewer requests, shorter contexts, fewer heads."""
    lens, B = tuple(case.seq_lens), len(case.seq_lens)
    if B > 1:
        yield f"requests {B} -> {B // 2}", replace(case, seq_lens=lens[: B // 2])
        yield f"requests {B} -> {B - B // 2}", replace(case, seq_lens=lens[B // 2 :])
        for i in range(B):
            yield f"requests {B} -> {B - 1} (request {i} dropped)", replace(case, seq_lens=lens[:i] + lens[i + 1 :])
    for i, L in enumerate(lens):
        for shorter in dict.fromkeys((L // 2, L - 1)):
            if 0 <= shorter < L:
                smaller = replace(case, seq_lens=lens[:i] + (shorter,) + lens[i + 1 :])
                yield f"request {i} context {L} -> {shorter}", smaller
    for h in sorted(h for h in HEADS if h < case.num_heads):
        yield f"heads {case.num_heads} -> {h}", replace(case, num_heads=h)


def write_sparse_capture(path: Any, ev: Evidence, sweep_meta: dict, backend: str) -> None:
    """A failing run of a sparse case as a sparse capture: its inputs, the kernel's out and lse
    (none where the kernel raised or crashed: ``ev.out`` None)."""
    t, meta = ev.case.tensors_and_meta(backend)  # type: ignore[union-attr]
    out = {} if ev.out is None else {"out": ev.out, **({"lse": ev.lse.float()} if ev.lse is not None else {})}
    write_sparse(path, {**t, **out}, {**meta, **sweep_meta})


AnyCase = Union[GoldenCase, SparseSweepCase, IndexerSweepCase]


def any_case(layout: str, point: Mapping[str, Any], seed: int, index: int, bounds: Bounds = CPU) -> AnyCase:
    """The case of a point of any layout, within ``bounds``."""
    if layout == "sparse":
        return sparse_case(point, seed, index, bounds)
    if layout == "indexer":
        return indexer_case(point, seed, index, bounds)
    return case_of(layout, point, seed, index, bounds)


def any_checks(case: AnyCase, opts: ReplayOptions, repeat: int = 3,
               deadline: Optional[float] = None) -> Union[CaseChecks, SparseChecks, IndexerChecks]:
    """The checks of a case of any layout (``deadline``: refmla.sweep.budget's, None: none)."""
    if isinstance(case, IndexerSweepCase):
        return IndexerChecks(case, opts, repeat, deadline)
    kind = SparseChecks if isinstance(case, SparseSweepCase) else CaseChecks
    return kind(case, opts, repeat, deadline)


__all__ = ["AnyCase", "SparseChecks", "SparseSweepCase", "any_case", "any_checks", "refuses", "sparse_candidates",
           "sparse_case", "write_sparse_capture"]

"""The shape space production runs, per layout, and the walk over it: every pair of axis values
first (a greedy pairwise covering, AETG-style, that takes a value no point has had before any
other, so every value of every axis comes within the first points), then random combinations,
reproducible from the seed.

Four layouts: ``decode`` (SGLang's token slots), ``verify`` (speculative verify over them),
``block_table`` (vLLM's paged decode: a block table, its null block, one batch-wide split count)
and ``sparse`` (DeepSeek V3.2 / V4 sparse decode over packed fp8 caches and top-k indices).

A point is one value per axis (``{"heads": 32, "page": 16, ...}``); refmla.sweep.cases (dense) and
refmla.sweep.sparse turn it into a case. Some values are relative to others: a length ``page+1``
is one past the point's page size, ``32k-1`` one short of a multiple of SGLang's 32-token block,
``past`` a split count past the length (at least one split is empty), ``rule`` vLLM's own split
count for the batch; a sparse ``width-1`` context leaves the indexer's scope one candidate short
of its index width. A point the CPU cannot afford (too many rows of heads x requests, too many
tokens x head tiles; for sparse, too many valid entries x head tiles, too long a context) is never
proposed: :func:`feasible`.
"""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, Optional, Sequence

from refmla.sweep.bounds import CPU, INT32_BASE_ROW, Bounds

HEADS = (128, 64, 32, 16, 8, 4)  # heads per rank: DeepSeek-V3 128 / Kimi-K2 64 at TP 1..16
PAGES = (1, 16, 64, 256)
LENGTHS = ("0", "1", "page-1", "page", "page+1", "32k-1", "32k", "32k+1", "2049", "4097", "edge", "edge+1", "edge-1")
BATCHES = (1, 2, 3, 8, 64)
SPLITS = ("1", "2", "4", "16", "past", "mixed")  # per request; "mixed": each its own 1..16
KV_DTYPES = ("bfloat16", "float8_e4m3fn", "float8_e4m3fnuz")
CAPS = (0.0, 30.0)
QLENS = (1, 2, 3, 4, 5, 6, 7, 8)  # verify: query tokens per request (non-powers of two included)
# block tables: vLLM's block sizes (1: ROCm AITER MLA; 16: the default, TRITON_MLA; 32 / 64: FlashInfer /
# TRT-LLM, FlashMLA 64; 128: CUTLASS MLA); lengths at block edges and at vLLM's split rule's edges
# (max_seq_len // 512: 1 split below 1024, 2 from 1024, 4 from 1536); a decode request attends >= 1 token
TABLE_PAGES = (1, 16, 32, 64, 128)
TABLE_LENGTHS = ("1", "page-1", "page", "page+1", "2page+1", "1023", "1024", "1536", "4097", "edge", "edge+1", "edge-1")
# "edge" +- 1: a length on an exact boundary of the point's split schedule, its page and its kernel's
# block at once (k x lcm(splits x block, page): every split exactly full, :func:`edge_unit`)
EDGES = ("edge", "edge+1", "edge-1")
KERNEL_BLOCK = {"decode": 32, "verify": 32, "block_table": 16}  # SGLang's 32-token split block; vLLM's BLOCK_N
TABLE_SPLITS = ("rule", "1", "2", "3", "8", "16")  # one count for the batch; "rule": vLLM's _compute_num_kv_splits
TABLES = ("shuffled", "ordered", "shared")  # pages handed out shuffled, in order, or a shared prefix (prefix caching)
NULLS = ("nan", "stale")  # what the null block (page 0, every padding entry) holds
# sparse (refmla.sparse): the caches of a DeepSeek-V4 layer (window + C4, window + C128, window only)
# and V3.2's one cache; the indexer's index width (V3.2's main, V4's compressed scope; V4's window
# index is 128 wide); request 0's context, relative to the kernels' 64-entry blocks, the window and
# the width; the main cache's page size (V4 256, V3.2 64, FlashMLA 64, and 1)
CACHES = ("v4-c4", "v4-c128", "v4-swa", "v32")
TOPKS = (64, 128, 512, 2048)
SPARSE_LENGTHS = ("0", "1", "2", "63", "64", "65", "128", "129", "width-1", "width", "width+1")
SPARSE_PAGES = (1, 64, 256)
SINKS = ("on", "off", "large")  # a per-head sink of N(0, 2); none; 8 + N(0, 1) (it dominates the denominator)
TOPK_LENGTHS = ("given", "none")  # topk_length passed (entries past it are stale), or not (every non -1 entry read)
RATIO = {"v4-c4": 4, "v4-c128": 128, "v4-swa": 0, "v32": 0}  # tokens per compressed token (0: no compressed scope)
WINDOW = 128  # DeepSeek-V4's sliding window: its main index width

# indexer (refmla.indexer): V3.2 (every token an entry) or V4 C4 (one a 4 tokens); index heads of 128;
# the top-k width; request 0's entries relative to the 64-entry pages and the width; fp8 or bf16
# keys; indices as positions or SGLang's page-translated slots
RATIOS = (1, 4)
INDEX_HEADS = (64, 32, 8)
INDEX_LENGTHS = ("0", "1", "63", "64", "65", "topk-1", "topk", "topk+1", "4097")
INDEX_BATCHES = (1, 2, 3, 8)
KEYS = ("fp8", "bf16")
INDICES = ("slots", "positions")

LAYOUTS: dict[str, dict[str, tuple]] = {
    "decode": {"heads": HEADS, "page": PAGES, "length": LENGTHS, "batch": BATCHES, "splits": SPLITS,
               "kv": KV_DTYPES, "cap": CAPS},
    "verify": {"heads": HEADS, "page": PAGES, "length": LENGTHS, "batch": BATCHES, "qlen": QLENS,
               "kv": KV_DTYPES, "cap": CAPS},
    "block_table": {"heads": HEADS, "page": TABLE_PAGES, "length": TABLE_LENGTHS, "batch": BATCHES,
                    "splits": TABLE_SPLITS, "kv": KV_DTYPES, "table": TABLES, "null": NULLS},
    "sparse": {"cache": CACHES, "heads": HEADS, "topk": TOPKS, "length": SPARSE_LENGTHS, "batch": BATCHES,
               "page": SPARSE_PAGES, "sink": SINKS, "topk_length": TOPK_LENGTHS},
    "indexer": {"ratio": RATIOS, "heads": INDEX_HEADS, "topk": TOPKS, "length": INDEX_LENGTHS, "batch": INDEX_BATCHES,
                "keys": KEYS, "indices": INDICES},
}  # fmt: skip
# past the interpreter's bounds (refmla.sweep.bounds): production's contexts (8k-128k, powers of two
# and one past them) and batches, on the axes where the bounds reach them
LONG_LENGTHS = ("8192", "8193", "32768", "32769", "65536", "131072", "131073")
LONG_SPARSE = ("8192", "65536", "131072")  # request 0's sparse context
LONG_BATCHES = (128, 256)
# a dense case's pool: as built (compact), or moved to rows past INT32_BASE_ROW of a NaN pool, where
# every element offset (row x 576) passes 2**31: the int32-offset class (bounds with pool_rows only)
POOLS = ("compact", "past-int32")
NOT_YET: tuple = ()  # layouts the sweep does not walk yet (the report's not_walked): none since all four are

MAX_ROWS = CPU.rows  # query rows x heads of one case: the interpreter's stage 2 runs one program per (row, head)
MAX_TILE_TOKENS = CPU.tile_tokens  # attended tokens x 16-head tiles of one case: stage 1's work
LONG = CPU.length  # the longest length the CPU's space names
# sparse: SGLang's Triton sparse kernel runs one program per (query row, 16-head tile), its loop over
# the row's valid entries in blocks; in the interpreter ~0.2-0.5 s per 128 entries of one program
MAX_SPARSE_UNITS = CPU.sparse_units  # 16-head tiles x each query row's 128-entry blocks (one at least) of one case
MAX_SPARSE_CONTEXT = CPU.sparse_context  # request 0's context tokens (the synthetic caches hold every one)


def length_of(value: str, page: int, k: int, unit: int = 32) -> int:
    """The token count a length value names for ``page`` and the multiple ``k`` of 32 (``edge``:
    of lcm(``unit``, ``page``), :func:`edge_unit`)."""
    base = {"2page": 2 * page, "page": page, "32k": 32 * k, "edge": math.lcm(int(unit), int(page)) * k}
    for name, n in base.items():
        if value.startswith(name):
            return max(0, n + int(value[len(name) :] or 0))
    return int(value)


def edge_unit(p: Mapping[str, Any], layout: str) -> int:
    """The length every split of the point's schedule fills exactly, in its kernel's blocks:
    splits x the block (SGLang's 32 tokens; vLLM's uniform splits of its BLOCK_N); a split count
    that is not a number (``past``, ``mixed``, ``rule``) or none (verify): one block."""
    splits = str(p.get("splits", "1"))
    return (int(splits) if splits.isdigit() else 1) * KERNEL_BLOCK.get(layout, 32)


def sparse_context(value: str, cache: str, topk: int) -> int:
    """Request 0's context tokens a sparse length value names: a number, or ``width`` +- 1: the
    indexer's scope holds width +- 1 candidates (the compressed tokens of a V4 C4 / C128 layer, the
    tokens of V3.2; a window-only layer's width is its window)."""
    if not value.startswith("width"):
        return int(value)
    ratio = RATIO[cache] or 1
    width = WINDOW if cache == "v4-swa" else int(topk)
    return max(0, (width + int(value[len("width") :] or 0)) * ratio)


def sparse_valid(context: int, cache: str, topk: int) -> int:
    """The valid entries of a request of ``context`` tokens: V4's window (the last 128) plus the
    indexer's top-k of its compressed tokens; V3.2's top-k of its tokens."""
    if cache == "v32":
        return min(context, int(topk))
    ratio = RATIO[cache]
    return min(context, WINDOW) + (min(context // ratio, int(topk)) if ratio else 0)


def sparse_units(heads: int, valid: list[int]) -> int:
    """A sparse case's cost in the interpreter: 16-head tiles x each query row's 128-entry blocks."""
    return -(-int(heads) // 16) * sum(max(1, -(-v // 128)) for v in valid)


def index_entries(value: str, topk: int) -> int:
    """Request 0's entries an indexer length value names: a number, or ``topk`` +- 1."""
    return max(0, topk + int(value[4:] or 0)) if value.startswith("topk") else int(value)


def feasible(p: Mapping[str, Any], layout: str = "decode", bounds: Bounds = CPU) -> bool:
    """Whether a (partial) point of ``layout`` fits ``bounds`` (default the CPU's), axes it lacks at their cheapest."""
    heads, batch, qlen = p.get("heads", 4), p.get("batch", 1), p.get("qlen", 1)
    if layout == "indexer":  # request 0's entries within the sparse context bound (the others are short)
        topks = [p["topk"]] if "topk" in p else TOPKS
        return min(index_entries(str(p.get("length", "0")), int(t)) for t in topks) <= bounds.sparse_context
    if layout == "sparse":
        caches = [p["cache"]] if "cache" in p else CACHES
        topks = [p["topk"]] if "topk" in p else TOPKS
        return any(_sparse_fits(heads, batch, str(p.get("length", "0")), c, t, bounds) for c in caches for t in topks)
    length = length_of(str(p.get("length", "0")), int(p.get("page", 1)), 1, edge_unit(p, layout))
    if p.get("pool") == "past-int32" and INT32_BASE_ROW + pool_span(length, batch, int(p.get("page", 1))) > bounds.pool_rows:
        return False
    return batch * qlen * heads <= bounds.rows and length * -(-heads // 16) <= bounds.tile_tokens and length <= bounds.length


def pool_span(length: int, batch: int, page: int) -> int:
    """Rows a dense case's pool may take, at most: request 0's length (up to 8 x it, its multiple)
    and the others' short ones, each with its pages, a page of padding and the free pages."""
    return 8 * length + batch * (3 * max(page, 64)) + 4 * page


def _sparse_fits(heads: int, batch: int, length: str, cache: str, topk: int, bounds: Bounds = CPU) -> bool:
    context = sparse_context(length, cache, topk)
    valid = [sparse_valid(context, cache, topk)] + [0] * (int(batch) - 1)
    return context <= bounds.sparse_context and sparse_units(heads, valid) <= bounds.sparse_units


def axes_of(layout: str, bounds: Bounds = CPU) -> dict[str, tuple]:
    """The axes of ``layout`` under ``bounds``: the long lengths (contexts) and large batches up to
    the bounds join their axes; a named length or batch past them leaves."""
    axes = dict(LAYOUTS[layout])
    long = LONG_SPARSE if layout in ("sparse", "indexer") else LONG_LENGTHS
    axes["length"] = tuple(v for v in axes["length"] + (long if bounds.long else ())
                           if not v.isdigit() or int(v) <= bounds.length)  # fmt: skip
    axes["batch"] = tuple(v for v in axes["batch"] + LONG_BATCHES if v <= bounds.batch)
    if layout != "sparse" and bounds.pool_rows > INT32_BASE_ROW:
        axes["pool"] = POOLS
    return axes


def parse_value(axis: str, text: str, axes: Mapping[str, tuple]) -> Any:
    """One ``--space`` value as the axis holds it; ValueError naming the axis and its values."""
    for v in axes[axis]:
        if str(v) == text or (isinstance(v, float) and _float(text) == v):
            return v
    raise ValueError(f"--space {axis}: {text!r} is not one of {', '.join(str(v) for v in axes[axis])}")


def _float(text: str) -> Optional[float]:
    try:
        return float(text)
    except ValueError:
        return None


def restrict(layout: str, space: Sequence[str] = (), bounds: Bounds = CPU) -> dict[str, tuple]:
    """The axes of ``layout`` under ``bounds`` (:func:`axes_of`) with each ``AXIS=V1,V2`` of
    ``space`` keeping only those values. A value of another layout's axis of that name
    (``splits=past`` for block_table, ``page=256``) is left out here; a restriction none of whose
    values this layout's axis has leaves it whole, as an axis this layout lacks does (``qlen`` for
    decode). ValueError for an unknown layout, axis or value: one no layout has (the CLI's exit 2)."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; choose from {', '.join(LAYOUTS)}")
    every = {name: axes_of(name, bounds) for name in LAYOUTS}
    axes = dict(every[layout])
    for item in space:
        name, sep, values = item.partition("=")
        if not sep or not values:
            raise ValueError(f"--space {item!r}: expected AXIS=V1,V2")
        owners = [a for a in every.values() if name in a]
        if not owners:
            raise ValueError(f"--space {name}: unknown axis; choose from {', '.join(sorted(set().union(*LAYOUTS.values())))}")
        kept = []
        for text in (v.strip() for v in values.split(",")):
            if name in axes and _has(name, text, every[layout]):
                kept.append(parse_value(name, text, every[layout]))
            elif not any(_has(name, text, a) for a in owners):
                raise ValueError(f"--space {name}: {text!r} is not one of "
                                 f"{', '.join(dict.fromkeys(str(v) for a in owners for v in a[name]))}")  # fmt: skip
        if kept:  # (an axis of another layout, qlen for decode, restricts nothing here)
            axes[name] = tuple(dict.fromkeys(kept))
    return axes


def _has(axis: str, text: str, axes: Mapping[str, tuple]) -> bool:
    try:
        parse_value(axis, text, axes)
    except ValueError:
        return False
    return True


@dataclass
class Walk:
    """The points of one layout: first its largest point (``bounds.largest_first``: the longest
    length, then the largest batch and heads that fit), its pool moved past int32 element
    offsets (``pool`` = ``past-int32``, where the bounds hold it), then a point on each schedule boundary
    (``edge``, ``edge+1``, ``edge-1``, each with another split count of several splits), then
    pairwise coverage (which pairs every boundary with every split count and page), then random:
    ``next(iter(walk))``."""

    layout: str
    axes: dict[str, tuple]
    seed: int
    bounds: Bounds = CPU
    pairs_total: int = 0
    pairs_covered: int = 0
    pairwise_points: int = 0  # points of the covering phase (the rest are random)
    _rng: random.Random = field(init=False, repr=False)
    _seen: set = field(init=False, repr=False)  # (axis, value)s some point of the walk has had

    def __post_init__(self) -> None:
        self._rng = random.Random(f"{self.seed}:{self.layout}")
        self._seen = set()

    def _pairs(self) -> set:
        names = list(self.axes)
        out = set()
        for a, b in itertools.combinations(names, 2):
            for va in self.axes[a]:
                for vb in self.axes[b]:
                    if feasible({a: va, b: vb}, self.layout, self.bounds):
                        out.add(((a, va), (b, vb)))
        return out

    def covered(self, points: Sequence[Mapping[str, Any]]) -> int:
        """The planned value pairs (of ``pairs_total``) that ``points`` hold: the walk's coverage
        counted over the points that ran (a point the budget did not start covers nothing)."""
        held = {pair for p in points for pair in itertools.permutations(p.items(), 2)}
        return len(self._pairs() & held)

    def _new_pairs(self, point: dict, axis: str, value: Any, todo: set) -> int:
        return sum((((a, v), (axis, value)) in todo) + (((axis, value), (a, v)) in todo) for a, v in point.items())

    def _covering_point(self, todo: set, fixed: Optional[dict] = None) -> dict:
        """A point of the most uncovered pairs, a value no point has had first: every value of
        every axis comes within the first points (as many as the widest axis has values, about).
        ``fixed``: axis values the point starts from instead of an uncovered pair."""
        if fixed:
            point = dict(fixed)
        else:
            pairs = sorted(todo, key=repr)
            fresh = [sum(av not in self._seen for av in pair) for pair in pairs]
            (a, va), (b, vb) = self._rng.choice([p for p, n in zip(pairs, fresh) if n == max(fresh)])
            point = {a: va, b: vb}
        rest = [n for n in self.axes if n not in point]
        self._rng.shuffle(rest)
        for axis in rest:
            options = [v for v in self.axes[axis] if feasible({**point, axis: v}, self.layout, self.bounds)]
            options = options or [self.axes[axis][-1]]
            score = {v: ((axis, v) not in self._seen, self._new_pairs(point, axis, v, todo)) for v in options}
            point[axis] = self._rng.choice([v for v in options if score[v] == max(score.values())])
        self._seen.update(point.items())
        return {n: point[n] for n in self.axes}

    def _random_point(self) -> dict:
        for _ in range(1000):
            point = {n: self._rng.choice(vals) for n, vals in self.axes.items()}
            if feasible(point, self.layout, self.bounds):
                return point
        return {n: vals[-1] for n, vals in self.axes.items()}

    def first_points(self) -> list[dict]:
        """The fixed axis values of the walk's first points: the largest (on a GPU's bounds), the
        pool past int32 offsets (where the bounds hold it), then one per schedule boundary, each
        with the next split count of several splits."""
        firsts = []
        if self.bounds.largest_first and "length" in self.axes:
            firsts.append(self._largest())
        if "past-int32" in self.axes.get("pool", ()):
            firsts.append({"pool": "past-int32"})
        edges = [v for v in EDGES if v in self.axes.get("length", ())]
        several = [v for v in self.axes.get("splits", ()) if str(v).isdigit() and int(v) > 1] or list(self.axes.get("splits", ()))
        for i, edge in enumerate(edges):
            fixed = {"length": edge, **({"splits": several[i % len(several)]} if several else {})}
            if feasible(fixed, self.layout, self.bounds):
                firsts.append(fixed)
        return firsts

    def _largest(self) -> dict:
        """The longest length, then the largest batch, then the most heads that fit with it."""
        page = max(self.axes.get("page", (1,)))
        named = (lambda v: int(v) if str(v).isdigit() else 0) if self.layout in ("sparse", "indexer") else (  # noqa: E731
            lambda v: length_of(str(v), page, 1))
        lengths = sorted(self.axes["length"], key=named)
        point: dict = {}
        for axis, values in (("length", lengths), ("batch", sorted(self.axes.get("batch", ())) or [])):
            fits = [v for v in values if feasible({**point, axis: v}, self.layout, self.bounds)]
            if fits:
                point[axis] = fits[-1]
        heads = [v for v in sorted(self.axes.get("heads", ())) if feasible({**point, "heads": v}, self.layout, self.bounds)]
        if heads:
            point["heads"] = heads[-1]
        return point

    def __iter__(self) -> Iterator[dict]:
        todo = self._pairs()
        self.pairs_total = len(todo)
        firsts = self.first_points()
        while todo or firsts:
            point = self._covering_point(todo, firsts.pop(0) if firsts else None)
            for (a, va), (b, vb) in itertools.combinations(point.items(), 2):
                todo.discard(((a, va), (b, vb)))
                todo.discard(((b, vb), (a, va)))
            self.pairs_covered = self.pairs_total - len(todo)
            self.pairwise_points += 1
            yield point
        while True:
            yield self._random_point()


def interleave(walks: Sequence[Walk]) -> Iterator[tuple[str, dict]]:
    """(layout, point) from each walk in turn."""
    its = [(w.layout, iter(w)) for w in walks]
    while its:
        for layout, it in its:
            yield layout, next(it)


__all__ = ["EDGES", "HEADS", "LAYOUTS", "LONG_LENGTHS", "NOT_YET", "POOLS", "pool_span", "Walk", "axes_of", "edge_unit",
           "feasible", "interleave", "index_entries", "length_of", "restrict", "sparse_context", "sparse_units", "sparse_valid"]

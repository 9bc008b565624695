"""The shape space production runs, per layout, and the walk over it: every pair of axis values
first (a greedy pairwise covering, AETG-style), then random combinations, reproducible from the seed.

A point is one value per axis (``{"heads": 32, "page": 16, ...}``); refmla.sweep.cases turns it
into a case. Some values are relative to others: a length ``page+1`` is one past the point's
page size, ``32k-1`` one short of a multiple of SGLang's 32-token block, ``past`` a split count
past the length (at least one split is empty). A point the CPU cannot afford (too many rows of
heads x requests, too many tokens x head tiles) is never proposed: :func:`feasible`.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, Optional, Sequence

HEADS = (128, 64, 32, 16, 8, 4)  # heads per rank: DeepSeek-V3 128 / Kimi-K2 64 at TP 1..16
PAGES = (1, 16, 64, 256)
LENGTHS = ("0", "1", "page-1", "page", "page+1", "32k-1", "32k", "32k+1", "2049", "4097")
BATCHES = (1, 2, 3, 8, 64)
SPLITS = ("1", "2", "4", "16", "past", "mixed")  # per request; "mixed": each its own 1..16
KV_DTYPES = ("bfloat16", "float8_e4m3fn", "float8_e4m3fnuz")
CAPS = (0.0, 30.0)
QLENS = (1, 2, 3, 4, 5, 6, 7, 8)  # verify: query tokens per request (non-powers of two included)

LAYOUTS: dict[str, dict[str, tuple]] = {
    "decode": {"heads": HEADS, "page": PAGES, "length": LENGTHS, "batch": BATCHES, "splits": SPLITS,
               "kv": KV_DTYPES, "cap": CAPS},
    "verify": {"heads": HEADS, "page": PAGES, "length": LENGTHS, "batch": BATCHES, "qlen": QLENS,
               "kv": KV_DTYPES, "cap": CAPS},
}  # fmt: skip
NOT_YET = ("block_table", "sparse")  # layouts the sweep does not walk yet (docs/contract.md, the sweep)

MAX_ROWS = 256  # query rows x heads of one case: the interpreter's stage 2 runs one program per (row, head)
MAX_TILE_TOKENS = 8192  # attended tokens x 16-head tiles of one case: stage 1's work
LONG = 4097  # the longest length the space names


def length_of(value: str, page: int, k: int) -> int:
    """The token count a length value names for ``page`` and the multiple ``k`` of 32."""
    base = {"page": page, "32k": 32 * k}
    for name, n in base.items():
        if value.startswith(name):
            return max(0, n + int(value[len(name) :] or 0))
    return int(value)


def feasible(p: Mapping[str, Any]) -> bool:
    """Whether a (partial) point fits the CPU's budget, axes it lacks at their cheapest."""
    heads, batch, qlen = p.get("heads", 4), p.get("batch", 1), p.get("qlen", 1)
    length = length_of(str(p.get("length", "0")), int(p.get("page", 1)), 1)
    return batch * qlen * heads <= MAX_ROWS and length * -(-heads // 16) <= MAX_TILE_TOKENS


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


def restrict(layout: str, space: Sequence[str] = ()) -> dict[str, tuple]:
    """The axes of ``layout`` with each ``AXIS=V1,V2`` of ``space`` keeping only those values.
    ValueError for an unknown layout, axis or value (the CLI's exit 2)."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; choose from {', '.join(LAYOUTS)} ({', '.join(NOT_YET)}: not yet)")
    axes = dict(LAYOUTS[layout])
    for item in space:
        name, sep, values = item.partition("=")
        if not sep or not values:
            raise ValueError(f"--space {item!r}: expected AXIS=V1,V2")
        if name not in axes:
            if any(name in a for a in LAYOUTS.values()):
                continue  # an axis of another layout (qlen for decode)
            raise ValueError(f"--space {name}: unknown axis; choose from {', '.join(sorted(set().union(*LAYOUTS.values())))}")
        axes[name] = tuple(dict.fromkeys(parse_value(name, v.strip(), LAYOUTS[layout]) for v in values.split(",")))
    return axes


@dataclass
class Walk:
    """The points of one layout, pairwise coverage first, then random: ``next(iter(walk))``."""

    layout: str
    axes: dict[str, tuple]
    seed: int
    pairs_total: int = 0
    pairs_covered: int = 0
    pairwise_points: int = 0  # points of the covering phase (the rest are random)
    _rng: random.Random = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._rng = random.Random(f"{self.seed}:{self.layout}")

    def _pairs(self) -> set:
        names = list(self.axes)
        out = set()
        for a, b in itertools.combinations(names, 2):
            for va in self.axes[a]:
                for vb in self.axes[b]:
                    if feasible({a: va, b: vb}):
                        out.add(((a, va), (b, vb)))
        return out

    def _new_pairs(self, point: dict, axis: str, value: Any, todo: set) -> int:
        return sum((((a, v), (axis, value)) in todo) + (((axis, value), (a, v)) in todo) for a, v in point.items())

    def _covering_point(self, todo: set) -> dict:
        (a, va), (b, vb) = self._rng.choice(sorted(todo, key=repr))
        point = {a: va, b: vb}
        rest = [n for n in self.axes if n not in point]
        self._rng.shuffle(rest)
        for axis in rest:
            options = [v for v in self.axes[axis] if feasible({**point, axis: v})] or [self.axes[axis][-1]]
            best = max(self._new_pairs(point, axis, v, todo) for v in options)
            point[axis] = self._rng.choice([v for v in options if self._new_pairs(point, axis, v, todo) == best])
        return {n: point[n] for n in self.axes}

    def _random_point(self) -> dict:
        for _ in range(1000):
            point = {n: self._rng.choice(vals) for n, vals in self.axes.items()}
            if feasible(point):
                return point
        return {n: vals[-1] for n, vals in self.axes.items()}

    def __iter__(self) -> Iterator[dict]:
        todo = self._pairs()
        self.pairs_total = len(todo)
        while todo:
            point = self._covering_point(todo)
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


__all__ = ["HEADS", "LAYOUTS", "NOT_YET", "Walk", "feasible", "interleave", "length_of", "restrict"]

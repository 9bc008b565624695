"""Deterministic numbers for the golden inputs: integer arithmetic only, the same on every machine.

* No RNG stream and no libm makes an input: every value is a splitmix64 hash of (seed, tensor,
  counter) in integer arithmetic, made approximately normal as a centred sum of four 16-bit
  uniforms, and rounded *in integers* to the precision of its dtype, so that the final cast is exact.
* The values sit on a grid of ``2**(scale - 15)`` with at most 18 bits, so every ``q . k`` dot is
  exact in fp64 whatever the summation order: the reference's logits do not depend on the BLAS.
* NaN poison is written as bits (how a cast spells NaN varies); page shuffles sort hashes.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import torch

DTYPES = {
    "bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
    "float8_e4m3fn": torch.float8_e4m3fn, "float8_e4m3fnuz": torch.float8_e4m3fnuz,
}  # fmt: skip
# dtype -> the quiet NaN's bits: poison is written as bits, since how a cast spells NaN varies
NAN_BITS = {
    torch.bfloat16: (0x7FC0, torch.int16), torch.float16: (0x7E00, torch.int16),
    torch.float32: (0x7FC00000, torch.int32), torch.float8_e4m3fn: (0x7F, torch.uint8),
    torch.float8_e4m3fnuz: (0x80, torch.uint8),
}  # fmt: skip
# dtype -> (significant bits, log2 of the smallest subnormal): what the integer rounding targets
PRECISION = {
    torch.bfloat16: (8, -133), torch.float16: (11, -24), torch.float32: (24, -149),
    torch.float8_e4m3fn: (4, -9), torch.float8_e4m3fnuz: (4, -10),
}  # fmt: skip

U64 = np.uint64


def splitmix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finalizer on uint64 (wrapping arithmetic, the same on every machine)."""
    z = x + U64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> U64(30))) * U64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> U64(27))) * U64(0x94D049BB133111EB)
    return z ^ (z >> U64(31))


def counter_hash(seed: int, stream: str, n: int) -> np.ndarray:
    """n uint64 hashes of (seed, stream name, counter 0..n-1)."""
    key = np.array([seed & (2**64 - 1)], dtype=U64)
    for byte in stream.encode():
        key = splitmix64(key ^ U64(byte))
    return splitmix64(splitmix64(np.arange(n, dtype=U64) + key[0]))


def round_to_bits(z: np.ndarray, bits: int, min_exp: int) -> np.ndarray:
    """Integers ``z`` (|z| < 2**18) rounded to ``bits`` significant bits, nearest even, in integers.

    Never finer than ``2**min_exp`` units (a dtype's smallest subnormal, in units of the value's grid).
    """
    a = np.abs(z)
    length = sum((a >= (1 << k)).astype(np.int64) for k in range(18))  # bit length of |z|
    shift = np.maximum(np.maximum(length - bits, min_exp), 0)  # bits to drop
    q = a >> shift
    rem = a - (q << shift)
    half = np.where(shift > 0, np.left_shift(1, np.maximum(shift - 1, 0)), 0)
    up = (shift > 0) & ((rem > half) | ((rem == half) & ((q & 1) == 1)))
    return np.sign(z) * ((q + up) << shift)  # int64, at most `bits` significant bits


def grid_normal(seed: int, stream: str, shape: Sequence[int], dtype: torch.dtype, scale_exp: int = 0) -> torch.Tensor:
    """Approximately N(0, 1.15**2 * 4**scale_exp) values, exactly representable in ``dtype``.

    z = (sum of the four 16-bit fields of a hash) - 131070, an integer with |z| < 2**17; it is
    rounded to the dtype's significant bits (nearest even, in integers, never finer than its
    smallest subnormal) and scaled by 2**(scale_exp - 15). Every step is exact.
    """
    n = math.prod(shape)
    h = counter_hash(seed, stream, n)
    mask = U64(0xFFFF)
    u = sum(((h >> U64(16 * i)) & mask).astype(np.int64) for i in range(4))
    z = u - 2 * 0xFFFF  # [n] int64, symmetric around 0
    bits, min_sub = PRECISION[dtype]
    exp = scale_exp - 15  # value = z * 2**exp
    r = round_to_bits(z, bits, min_sub - exp)
    vals = np.ldexp(r.astype(np.float64), exp)  # exact: |r| < 2**18, scaling by a power of two
    return torch.from_numpy(vals.reshape(shape)).to(dtype)


def nan_filled(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """A tensor of ``dtype``'s canonical quiet NaN, written as bits."""
    bits, as_int = NAN_BITS[dtype]
    return torch.full(tuple(shape), bits, dtype=as_int).view(dtype)


def shuffled(seed: int, stream: str, n: int) -> torch.Tensor:
    """A permutation of 0..n-1: the counter order of n hashes, sorted (stable)."""
    return torch.from_numpy(np.argsort(counter_hash(seed, stream, n), kind="stable").astype(np.int64))


def hashed_lengths(seed: int, n: int, high: int, zeros: Sequence[int] = ()) -> tuple[int, ...]:
    """n lengths in [1, high] from the counter hash, with 0 at the given positions."""
    h = counter_hash(seed, "seq_lens", n)
    lens = [1 + int(x % U64(high)) for x in h]
    for b in zeros:
        lens[b] = 0
    return tuple(lens)

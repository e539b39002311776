"""Stochastic quantisation of float vectors into Z_{2^32} for masked summation.

A client clips each coordinate to [-c, c] and maps it to the 2^b levels {0, ..., 2^b - 1}:
q = floor((x + c)(2^b - 1)/(2c)) + Bernoulli(frac), the Bernoulli rounding up with the
fractional part's probability, so E[q] is exactly (x + c)(2^b - 1)/(2c) (unbiased). The sum of
n such values fits in uint32 when n(2^b - 1) < 2^32; the server decodes the sum of |U3|
contributors as S_q 2c/(2^b - 1) - |U3| c (Bonawitz et al. CCS'17, Section 3; Flower's defaults
c = 8, 2^b = 2^22, at most 1,000 clients).
"""

from __future__ import annotations

import numpy as np

from fedloom.secure.base import SecureAggregationConfigError

MODULUS_BITS = 32
"""Masked arithmetic is in Z_R, R = 2^32: numpy's uint32 wraps for free."""


def levels(bits: int) -> int:
    """The largest quantised value, 2^b - 1."""
    return (1 << bits) - 1


def step(clip: float, bits: int) -> float:
    """The width 2c/(2^b - 1) of one quantisation level."""
    return 2.0 * clip / levels(bits)


def check_capacity(clip: float, bits: int, max_clients: int) -> None:
    """Raise ``SecureAggregationConfigError`` unless the sum of ``max_clients`` quantised
    vectors fits the modulus: max_clients (2^b - 1) < 2^32 (checked before any client works)."""
    if not (isinstance(clip, int | float) and np.isfinite(clip) and clip > 0):
        raise SecureAggregationConfigError(f"clip must be a positive number, got {clip!r}")
    if not isinstance(bits, int) or not 1 <= bits < MODULUS_BITS:
        raise SecureAggregationConfigError(
            f"bits must be an integer in [1, {MODULUS_BITS - 1}], got {bits!r}"
        )
    if not isinstance(max_clients, int) or max_clients < 1:
        raise SecureAggregationConfigError(
            f"max_clients must be a positive integer, got {max_clients!r}"
        )
    if max_clients * levels(bits) >= 1 << MODULUS_BITS:
        largest = ((1 << MODULUS_BITS) - 1) // levels(bits)
        raise SecureAggregationConfigError(
            f"a sum of {max_clients} vectors quantised to {bits} bits overflows 2^32: "
            f"need max_clients * (2^bits - 1) < 2^32, so at most {largest} clients at "
            f"{bits} bits (e.g. bits=22 for up to 1,024 clients)"
        )


def quantize(x: np.ndarray, clip: float, bits: int, rng: np.random.Generator) -> np.ndarray:
    """Clip ``x`` to [-clip, clip] and round it stochastically to uint32 levels in
    [0, 2^b - 1]. ``rng`` is the client's own generator (the caller seeds it per client and
    round); computed in float64 so that 2^b levels stay exact."""
    values = np.asarray(x, dtype=np.float64)
    if not np.all(np.isfinite(values)):
        raise ValueError("cannot quantise a vector with NaN or infinite coordinates")
    top = levels(bits)
    scaled = np.clip(values, -clip, clip)
    scaled += clip
    scaled *= top / (2.0 * clip)
    floor = np.floor(scaled)
    scaled -= floor  # the fractional part: probability of rounding up
    floor += rng.random(floor.shape) < scaled
    np.clip(floor, 0, top, out=floor)
    return floor.astype(np.uint32)


def dequantize_sum(total: np.ndarray, clip: float, bits: int, count: int) -> np.ndarray:
    """The float64 sum of ``count`` clients' vectors from the uint32 sum of their quantised
    ones: S_q 2c/(2^b - 1) - count c. Each coordinate is within count 2c/(2^b - 1) of the sum
    of the clipped vectors (one level per client at most)."""
    return np.asarray(total, dtype=np.float64) * step(clip, bits) - count * float(clip)

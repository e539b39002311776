"""Exact sampling of the discrete Gaussian N_Z(0, sigma^2) (Canonne, Kamath, Steinke, "The
Discrete Gaussian for Differential Privacy", NeurIPS 2020, Algorithms 1-3), vectorised.

Every step is integer arithmetic on uniform integers, so the output follows the distribution
exactly (no floating point touches a probability), for a rational variance sigma^2 = p/q:

- Algorithm 1, Bernoulli(exp(-g)) for rational g = num/den in [0, 1]: K = 1; while
  Bernoulli(g/K): K += 1; return K odd. For g > 1: floor(g) Bernoulli(exp(-1)) trials, then
  Bernoulli(exp(-(g - floor g))), all of which must succeed.
- Algorithm 2, the discrete Laplace of integer scale t: U uniform on {0, ..., t-1} kept with
  probability exp(-U/t); V ~ Geometric(1 - 1/e) (counted with Bernoulli(exp(-1))); X = U + tV;
  a fair sign, rejecting -0.
- Algorithm 3: t = floor(sigma) + 1; Y ~ DLap(t) kept with probability
  exp(-(|Y| - sigma^2/t)^2 / (2 sigma^2)).

Each algorithm runs on whole arrays: the slots that are still undecided draw again. The
arithmetic is int64 where it provably fits (numerators below 2^62, denominators times K below
2^63), and Python integers for the rare far-tail slots that do not (|Y| beyond about 32
sigma), so no slot is ever truncated.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np

_INT64 = 1 << 62
"""Below this, a product of two int64 factors is checked not to overflow."""


def _below(bound: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Uniform integers in [0, bound) per slot, exactly (``bound``: positive int64 array)."""
    return rng.integers(0, bound, dtype=np.int64)


def bernoulli_exp(num: np.ndarray, den: int, rng: np.random.Generator) -> np.ndarray:
    """Bernoulli(exp(-num/den)) per slot, exactly (Algorithm 1). ``num``: int64 array >= 0;
    ``den`` a positive int with den * 1024 < 2^63 (K never gets that far: P(K > k) =
    g^k / k!)."""
    num = np.asarray(num, dtype=np.int64)
    out = np.ones(num.shape, dtype=bool)
    whole = num // den
    rest = num - whole * den
    # floor(g) trials of Bernoulli(exp(-1)); a slot fails at its first failure
    pending = np.flatnonzero(whole > 0)
    left = whole[pending]
    while pending.size:
        ok = _bernoulli_exp_unit(np.ones(pending.size, dtype=np.int64), 1, rng)
        out[pending[~ok]] = False
        left = left - 1
        keep = ok & (left > 0)
        pending, left = pending[keep], left[keep]
    alive = np.flatnonzero(out)
    out[alive] = _bernoulli_exp_unit(rest[alive], den, rng)
    return out


def _bernoulli_exp_unit(num: np.ndarray, den: int, rng: np.random.Generator) -> np.ndarray:
    """Bernoulli(exp(-num/den)) for num <= den (Algorithm 1's loop)."""
    if den * 1024 >= 1 << 63:
        raise OverflowError(f"denominator {den} too large for exact int64 sampling")
    k = np.ones(num.shape, dtype=np.int64)
    active = np.arange(num.size)
    while active.size:
        success = _below(den * k[active], rng) < num[active]
        k[active[success]] += 1
        active = active[success]
    return (k % 2) == 1


def discrete_laplace(t: int, size: int, rng: np.random.Generator) -> np.ndarray:
    """``size`` draws of the discrete Laplace with P(x) proportional to exp(-|x|/t), exactly
    (Algorithm 2 with s = 1)."""
    out = np.zeros(size, dtype=np.int64)
    todo = np.arange(size)
    while todo.size:
        u = _below(np.full(todo.size, t, dtype=np.int64), rng)
        kept = bernoulli_exp(u, t, rng)
        todo_u, u = todo[kept], u[kept]
        v = np.zeros(u.size, dtype=np.int64)
        going = np.arange(u.size)
        while going.size:
            more = bernoulli_exp(np.ones(going.size, dtype=np.int64), 1, rng)
            v[going[more]] += 1
            going = going[more]
        x = u + t * v
        negative = rng.integers(0, 2, size=x.size).astype(bool)
        valid = ~(negative & (x == 0))
        out[todo_u[valid]] = np.where(negative[valid], -x[valid], x[valid])
        done = np.zeros(size, dtype=bool)
        done[todo_u[valid]] = True
        todo = todo[~done[todo]]
    return out


LARGEST_VARIANCE = float(1 << 24)
"""The largest variance the int64 arithmetic takes (sigma up to 4,096): 2 p q t^2 < 2^53."""


def as_variance(variance: float, precision_bits: int = 20) -> Fraction:
    """``variance`` (at most ``LARGEST_VARIANCE``) as the rational sigma^2 = p / 2^k the
    sampler takes, rounded up (never less noise) to a relative precision of
    2^-precision_bits (coarser below 2^-6, where k stops at 26)."""
    if not 0 < variance <= LARGEST_VARIANCE:
        raise ValueError(f"the discrete Gaussian's variance must be in (0, 2^24], got {variance}")
    shift = min(26, max(0, precision_bits - math.floor(math.log2(variance))))
    return Fraction(math.ceil(Fraction(variance) * (1 << shift)), 1 << shift)


def discrete_gaussian(variance: Fraction, size: int, rng: np.random.Generator) -> np.ndarray:
    """``size`` independent draws of N_Z(0, sigma^2), sigma^2 = ``variance`` (a Fraction),
    exactly (Algorithm 3): P(x) proportional to exp(-x^2 / (2 sigma^2)) over the integers."""
    p, q = variance.numerator, variance.denominator
    t = math.isqrt(p // q) + 1
    den = 2 * p * q * t * t
    out = np.zeros(size, dtype=np.int64)
    todo = np.arange(size)
    while todo.size:
        y = discrete_laplace(t, todo.size, rng)
        # exp(-(|y| - p/(q t))^2 / (2 p/q)) = exp(-(|y| q t - p)^2 / (2 p q t^2))
        a = np.abs(y)
        small = a < (_INT64 >> 31) // (q * t)  # |y| q t < 2^31: the square fits int64
        accept = np.zeros(todo.size, dtype=bool)
        idx = np.flatnonzero(small)
        centred = a[idx] * (q * t) - p
        accept[idx] = bernoulli_exp(centred * centred, den, rng)
        for i in np.flatnonzero(~small):  # the far tail: exact in Python integers
            accept[i] = _bernoulli_exp_exact((int(a[i]) * q * t - p) ** 2, den, rng)
        out[todo[accept]] = y[accept]
        todo = todo[~accept]
    return out


def _bernoulli_exp_exact(num: int, den: int, rng: np.random.Generator) -> bool:
    """Algorithm 1 on Python integers (one slot of any size)."""
    for _ in range(num // den):
        if not _bernoulli_exp_int(1, 1, rng):
            return False
    return _bernoulli_exp_int(num % den, den, rng)


def _bernoulli_exp_int(num: int, den: int, rng: np.random.Generator) -> bool:
    k = 1
    while _randbelow(den * k, rng) < num:
        k += 1
    return k % 2 == 1


def _randbelow(n: int, rng: np.random.Generator) -> int:
    """A uniform integer in [0, n) for any positive Python int n (rejection on whole bytes)."""
    bits = n.bit_length()
    while True:
        value = int.from_bytes(rng.bytes((bits + 7) // 8), "little") >> (-bits % 8)
        if value < n:
            return value

"""The distributed discrete Gaussian's client encoding and server decoding (Kairouz, Liu,
Steinke 2021, Algorithm 1 (client) and Algorithm 2 (server)).

Client, with its update x (flattened, d coordinates), clip c, grid scale gamma, the round's
rotation U (rotation.py), noise variance sigma^2 (grid units) and b bits:

    x <- x min(1, c / ||x||);  x <- U (x / gamma)             (clip, scale, flatten)
    z <- randomized rounding of x, redrawn until ||z|| <= Delta_2   (conditional rounding)
    z <- z + N_Z(0, sigma^2)^d;  z <- z mod 2^b               (noise share, modular clipping)

Server, with the sum s of the clients' z modulo 2^b (secure aggregation's, modulo 2^32,
reduced: 2^b divides 2^32): each coordinate mapped to [-2^(b-1), 2^(b-1)), then
gamma U^T s, cut to d coordinates: the sum of the clipped updates plus the summed noise, up to
the rounding and any wrap-around of the modular range.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from fedloom.privacy.ddg_accounting import Grid
from fedloom.privacy.discrete_gaussian import discrete_gaussian
from fedloom.privacy.rotation import rotate, unrotate

MAX_ROUNDINGS = 1000
"""Conditional rounding redraws at most this often (each draw passes with probability at
least 1 - beta; the paper's beta = exp(-1/2) passes within 3 draws on average)."""


def clip_vector(x: np.ndarray, bound: float) -> np.ndarray:
    """x min(1, bound / ||x||)."""
    norm = float(np.linalg.norm(x))
    return x if norm <= bound else x * (bound / norm)


def conditional_round(x: np.ndarray, bound: float, rng: np.random.Generator) -> np.ndarray:
    """Randomized rounding of every coordinate (up with the fractional part's probability,
    unbiased), redrawn until the rounded vector's L2 norm is at most ``bound``."""
    low = np.floor(x)
    frac = x - low
    for _ in range(MAX_ROUNDINGS):
        z = low + (rng.random(x.shape) < frac)
        if float(np.dot(z, z)) <= bound * bound:
            return z.astype(np.int64)
    raise RuntimeError(f"conditional rounding found no draw within norm {bound:g}")


def modular(z: np.ndarray, bits: int) -> np.ndarray:
    """z mod 2^bits as uint32 (what a client hands secure aggregation)."""
    return np.mod(z, 1 << bits).astype(np.uint32)


def centred(total: np.ndarray, bits: int) -> np.ndarray:
    """The sum modulo 2^bits mapped to [-2^(bits-1), 2^(bits-1)) (modular clipping)."""
    m = 1 << bits
    v = np.asarray(total, dtype=np.int64) % m
    return np.where(v >= m // 2, v - m, v)


@dataclass(frozen=True)
class DDGCodec:
    """One run's encoding: its ``grid``, each client's noise ``variance`` (grid units, exact;
    0: none), ``bits`` and the model's ``dim`` (before padding to the grid's)."""

    grid: Grid
    variance: Fraction
    bits: int
    dim: int

    def encode(
        self,
        update: np.ndarray,
        diagonal: np.ndarray,
        rounding: np.random.Generator,
        noise: np.random.Generator,
    ) -> np.ndarray:
        """Algorithm 1: the client's uint32 vector for secure aggregation."""
        grid = self.grid
        x = rotate(clip_vector(update, grid.clip) / grid.gamma, diagonal)
        z = conditional_round(x, grid.sensitivity, rounding)
        if self.variance > 0:
            z = z + discrete_gaussian(self.variance, z.size, noise)
        return modular(z, self.bits)

    def decode(self, total: np.ndarray, diagonal: np.ndarray) -> np.ndarray:
        """Algorithm 2: the float64 sum (real units, ``dim`` coordinates) from the sum of the
        clients' vectors modulo 2^32."""
        values = centred(total, self.bits).astype(np.float64)
        return unrotate(values, diagonal, self.dim) * self.grid.gamma

"""The randomized Hadamard rotation that flattens client vectors before rounding (Kairouz,
Liu, Steinke 2021, Section 4.2; Suresh et al. 2017): U x = H D x / sqrt(d), D a diagonal of
random signs, H the d x d Walsh-Hadamard matrix (d a power of two: vectors are zero-padded).

U is orthogonal (H H = d I, D D = I), so it keeps L2 norms (the sensitivity) and its inverse
is U^T y = D H y / sqrt(d). After it every coordinate of a vector of norm c is subgaussian with
scale about c / sqrt(d), which is what lets few bits carry the sum (the modular range).
"""

from __future__ import annotations

import numpy as np


def padded(dim: int) -> int:
    """The smallest power of two >= ``dim`` (the rotation's dimension)."""
    return 1 << max(0, (dim - 1).bit_length())


def walsh_hadamard(x: np.ndarray) -> np.ndarray:
    """H x for a vector (or the rows of a matrix) whose length is a power of two, unnormalised,
    in O(d log d): log2 d butterfly passes."""
    d = x.shape[-1]
    if d & (d - 1):
        raise ValueError(f"the Walsh-Hadamard transform needs a power-of-two length, got {d}")
    lead = x.shape[:-1]
    y = np.array(x, dtype=np.float64, copy=True).reshape(-1, d)
    h = 1
    while h < d:
        blocks = y.reshape(y.shape[0], -1, 2, h)
        top, bottom = blocks[:, :, 0, :].copy(), blocks[:, :, 1, :]
        blocks[:, :, 0, :] += bottom
        blocks[:, :, 1, :] = top - bottom
        h *= 2
    return y.reshape(*lead, d)


def signs(dim: int, rng: np.random.Generator) -> np.ndarray:
    """The diagonal D: ``dim`` independent fair signs (+1.0 / -1.0)."""
    return 1.0 - 2.0 * rng.integers(0, 2, size=dim)


def rotate(x: np.ndarray, diagonal: np.ndarray) -> np.ndarray:
    """U x = H D x / sqrt(d), ``x`` zero-padded to the length of ``diagonal``."""
    d = diagonal.size
    full = np.zeros((*x.shape[:-1], d), dtype=np.float64)
    full[..., : x.shape[-1]] = x
    return walsh_hadamard(full * diagonal) / np.sqrt(d)


def unrotate(y: np.ndarray, diagonal: np.ndarray, dim: int) -> np.ndarray:
    """U^T y = D H y / sqrt(d), cut back to the first ``dim`` coordinates."""
    return (walsh_hadamard(y) * diagonal / np.sqrt(diagonal.size))[..., :dim]

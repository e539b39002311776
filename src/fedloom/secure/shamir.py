"""t-of-n Shamir secret sharing of 32-byte secrets over GF(p), p = 2^521 - 1 (Shamir 1979).

SecAgg shares each client's mask key s_u^sk and self-mask seed b_u this way (Bonawitz et al.
CCS'17, Section 4, round ShareKeys). A share is the point (x, f(x)) of a random polynomial f of
degree t - 1 with f(0) = secret; x is the holder's client id + 1, so x is never 0. Any t shares
give f(0) by Lagrange interpolation; t - 1 shares are independent of the secret. On the wire a
share's y is a fixed-width 66-byte big-endian integer (its x is known from who holds it).
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

PRIME = (1 << 521) - 1
"""The Mersenne prime 2^521 - 1: any 32-byte secret is an integer below it."""
SECRET_BYTES = 32
SHARE_BYTES = 66
"""Bytes of one serialised share value: ceil(521 / 8)."""


class Share(NamedTuple):
    """One point (x, y) of the sharing polynomial; x = holder's client id + 1."""

    x: int
    y: int


def x_of(client: int) -> int:
    """The x-coordinate of the share held by ``client`` (client ids start at 0)."""
    if client < 0:
        raise ValueError(f"client ids must be >= 0, got {client}")
    return client + 1


def split(
    secret: bytes,
    xs: Sequence[int],
    threshold: int,
    rng: Callable[[int], int] | None = None,
) -> list[Share]:
    """Shares of ``secret`` (32 bytes) at the distinct non-zero points ``xs``; any
    ``threshold`` of them recover it. ``rng(p)`` draws the polynomial's coefficients below p:
    ``secrets.randbelow`` unless a seeded draw is passed (deterministic tests only)."""
    if len(secret) != SECRET_BYTES:
        raise ValueError(f"secret must be {SECRET_BYTES} bytes, got {len(secret)}")
    if not 1 <= threshold <= len(xs):
        raise ValueError(f"threshold must be in [1, {len(xs)}] (number of shares), got {threshold}")
    if len(set(xs)) != len(xs) or any(not 0 < x < PRIME for x in xs):
        raise ValueError("share x-coordinates must be distinct and in [1, p)")
    draw = rng if rng is not None else secrets.randbelow
    coefficients = [int.from_bytes(secret, "big")]
    coefficients += [draw(PRIME) for _ in range(threshold - 1)]
    shares = []
    for x in xs:
        y = 0
        for a in reversed(coefficients):  # Horner: f(x) = a0 + x(a1 + x(a2 + ...))
            y = (y * x + a) % PRIME
        shares.append(Share(x, y))
    return shares


def combine_int(shares: Iterable[Share]) -> int:
    """f(0) for the polynomial through ``shares`` (Lagrange interpolation at 0). With fewer
    than t shares the result is unrelated to the secret."""
    points = list(shares)
    xs = [s.x for s in points]
    if len(set(xs)) != len(xs):
        raise ValueError("shares must have distinct x-coordinates")
    secret = 0
    for i, (xi, yi) in enumerate(points):
        num, den = 1, 1
        for j, xj in enumerate(xs):
            if j != i:
                num = num * xj % PRIME
                den = den * (xj - xi) % PRIME
        secret = (secret + yi * num * pow(den, -1, PRIME)) % PRIME
    return secret


def combine(shares: Iterable[Share]) -> bytes:
    """The 32-byte secret from at least t shares (pass exactly t: each extra share costs time).
    Raises ``ValueError`` when the shares interpolate to no 32-byte value, as t - 1 shares
    almost surely do."""
    value = combine_int(shares)
    if value >> (8 * SECRET_BYTES):
        raise ValueError("shares do not reconstruct a 32-byte secret (too few or corrupt shares)")
    return value.to_bytes(SECRET_BYTES, "big")


def share_to_bytes(share: Share) -> bytes:
    """The share's y as 66 big-endian bytes (fixed width, no pickling)."""
    return share.y.to_bytes(SHARE_BYTES, "big")


def share_from_bytes(x: int, data: bytes) -> Share:
    """The share of holder x-coordinate ``x`` from its 66-byte serialisation."""
    if len(data) != SHARE_BYTES:
        raise ValueError(f"a serialised share is {SHARE_BYTES} bytes, got {len(data)}")
    y = int.from_bytes(data, "big")
    if y >= PRIME:
        raise ValueError("serialised share is not a field element")
    return Share(x, y)

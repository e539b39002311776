"""Accounting for the distributed discrete Gaussian (Kairouz, Liu, Steinke, "The Distributed
Discrete Gaussian Mechanism for Federated Learning with Secure Aggregation", ICML 2021).

All quantities are on the integer grid (the clients' vectors scaled by 1/gamma):

- sensitivity after conditional randomized rounding with bound beta (Section 4.1): a vector of
  L2 norm c/gamma rounds to norm at most
  Delta_2 = min(c/gamma + sqrt(d), sqrt(c^2/gamma^2 + d/4 + sqrt(2 ln(1/beta)) (c/gamma +
  sqrt(d)/2))) (the second bound enforced by re-rounding, the first always true), and
  Delta_1 = Delta_2 min(sqrt(d), Delta_2) (integer coordinates);
- the sum of n discrete Gaussians N_Z(0, sigma^2) each (Theorem 1) is close to one of variance
  n sigma^2, up to tau = 10 sum_{k=1}^{n-1} exp(-2 pi^2 sigma^2 k/(k+1)); its Renyi DP at order
  alpha (Proposition 14, Eq. 17), with s^2 = n sigma^2:
  min(alpha Delta_2^2/(2 s^2) + tau d, alpha/2 (Delta_2^2/s^2 + 2 Delta_1 tau/s + tau^2 d),
  alpha/2 (Delta_2/s + tau sqrt(d))^2);
- client sampling at rate q: the RDP of the Poisson-subsampled mechanism (Zhu and Wang,
  "Poisson Subsampled Renyi Differential Privacy", ICML 2019, Theorem 5, integer orders), as
  the paper does, never more than the unsampled one; rounds compose by adding RDP;
- epsilon at delta from the RDP curve with Opacus's conversion (``get_privacy_spent``).

The grid scale gamma follows the paper's choice (Section 4.4): k standard deviations of the
aggregate fit the 2^b values of the modular range, 2^b = 2k sqrt(c^2 n^2 / d + (gamma^2/4 +
sigma^2) n) / gamma (flatness rho = 1 for the randomized Hadamard rotation).
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
from scipy import special

from fedloom.errors import ConfigError

FRACTIONAL: tuple[float, ...] = tuple(1 + x / 10 for x in range(1, 100) if x % 10)
"""Fractional orders 1.1 ... 10.9 (Opacus's grid), used without client sampling only (Zhu and
Wang's Theorem 5 needs integer orders); they matter at large epsilon."""
ORDERS: tuple[float, ...] = (*FRACTIONAL, *range(2, 129), 256)
"""The Renyi orders."""


def rounded_l2_bound(norm: float, beta: float, dim: int) -> float:
    """Delta_2: the L2 norm bound after conditional randomized rounding of a vector of norm
    ``norm`` (grid units) in ``dim`` coordinates; beta = 0: unconditional rounding."""
    always = norm + math.sqrt(dim)
    if beta == 0:
        return always
    squared = norm**2 + dim / 4 + math.sqrt(2 * math.log(1 / beta)) * (norm + math.sqrt(dim) / 2)
    return min(always, math.sqrt(squared))


def rounded_l1_bound(l2: float, dim: int) -> float:
    """Delta_1 <= Delta_2 min(sqrt(d), Delta_2) for integer vectors of L2 norm Delta_2."""
    return l2 * min(math.sqrt(dim), l2)


def tau(variance: float, clients: int) -> float:
    """Theorem 1's tau for a sum of ``clients`` discrete Gaussians of ``variance`` each."""
    k = np.arange(1, clients, dtype=np.float64)
    return 10.0 * float(np.exp(-2 * math.pi**2 * variance * k / (k + 1)).sum())


def sum_rdp(l2: float, variance: float, clients: int, dim: int, orders: np.ndarray) -> np.ndarray:
    """Proposition 14's RDP at ``orders`` of adding the sum of ``clients`` discrete Gaussians of
    ``variance`` each to a query of L2 sensitivity ``l2`` in ``dim`` integer coordinates."""
    if clients <= 0:
        return np.zeros(len(orders))
    if variance <= 0:
        return np.full(len(orders), np.inf)
    s = math.sqrt(clients * variance)
    t = tau(variance, clients)
    l1 = rounded_l1_bound(l2, dim)
    a = np.asarray(orders, dtype=np.float64)
    first = a / 2 * (l2 / s) ** 2 + t * dim
    second = a / 2 * ((l2 / s) ** 2 + 2 * (l1 / s) * t + t**2 * dim)
    third = a / 2 * (l2 / s + math.sqrt(dim) * t) ** 2
    return np.minimum(np.minimum(first, second), third)


def subsampled_rdp(rdp: np.ndarray, q: float, order: int) -> float:
    """Zhu and Wang's Theorem 5 bound at integer ``order`` for Poisson sampling at rate ``q``,
    from ``rdp[l]`` = the mechanism's RDP at order l (index l, l = 2..order); never more than
    ``rdp[order]``."""
    plain = float(rdp[order])
    if q >= 1.0:
        return plain
    if q <= 0.0:
        return 0.0
    a = order
    ls = np.arange(3, a + 1)
    log_comb = special.gammaln(a + 1) - special.gammaln(ls + 1) - special.gammaln(a - ls + 1)
    first = (a - 1) * math.log1p(-q) + math.log(a * q - q + 1)
    second = float(rdp[2]) + math.log(a * (a - 1) / 2) + 2 * math.log(q) + (a - 2) * math.log1p(-q)
    rest = (
        math.log(3) + (ls - 1) * rdp[ls] + log_comb + (a - ls) * math.log1p(-q) + ls * math.log(q)
    )
    terms = np.concatenate(([first, second], rest))
    return min(plain, float(special.logsumexp(terms)) / (a - 1))


@dataclass(frozen=True)
class Grid:
    """One run's integer grid: L2 clip ``clip`` and scale ``gamma`` (real units), rounding
    bound ``beta``, rotated dimension ``dim``."""

    clip: float
    gamma: float
    beta: float
    dim: int

    @property
    def sensitivity(self) -> float:
        """Delta_2 on the grid (the norm conditional rounding enforces)."""
        return rounded_l2_bound(self.clip / self.gamma, self.beta, self.dim)


@dataclass(frozen=True)
class DDGAccount:
    """One run's distributed discrete Gaussian: its ``grid``, each client's noise ``variance``
    (grid units) and the client sampling rate ``q``."""

    grid: Grid
    variance: float
    q: float

    def round_rdp(self, clients: int) -> np.ndarray:
        """RDP at ``ORDERS`` of one round whose sum holds ``clients`` noise shares."""
        return _round_rdp(self, clients)

    def epsilon(self, rounds: Mapping[int, int], delta: float) -> float:
        """Epsilon at ``delta`` after ``rounds`` = {clients in the sum: rounds with that many}
        (RDP adds over rounds; Opacus converts it); infinity without noise."""
        total = np.zeros(len(ORDERS))
        for clients, count in rounds.items():
            if count:
                total += count * self.round_rdp(int(clients))
        if not total.any():
            return 0.0
        finite = np.isfinite(total)
        if not finite.any():
            return math.inf
        from opacus.accountants.analysis.rdp import get_privacy_spent

        orders = [a for a, ok in zip(ORDERS, finite, strict=True) if ok]
        with warnings.catch_warnings():  # "optimal order is the smallest": ours start at 1.1
            warnings.simplefilter("ignore", UserWarning)
            eps, _ = get_privacy_spent(orders=orders, rdp=list(total[finite]), delta=delta)
        return float(eps)


@functools.lru_cache(maxsize=256)
def _round_rdp(account: DDGAccount, clients: int) -> np.ndarray:
    if clients <= 0:
        return np.zeros(len(ORDERS))
    top = int(max(ORDERS))
    grid = account.grid
    every = sum_rdp(grid.sensitivity, account.variance, clients, grid.dim, np.arange(top + 1))
    below = sum_rdp(grid.sensitivity, account.variance, clients, grid.dim, np.array(FRACTIONAL))
    if account.q < 1.0:  # no bound for sampled fractional orders: leave them out
        below = np.full(len(FRACTIONAL), np.inf)
    integer = [subsampled_rdp(every, account.q, int(a)) for a in ORDERS[len(FRACTIONAL) :]]
    out = np.concatenate((below, integer))
    out.setflags(write=False)
    return out


def grid_scale(std: float, clip: float, bits: int, clients: int, dim: int, k: float) -> float:
    """gamma such that k standard deviations of the sum of ``clients`` rotated, rounded and
    noised vectors (clip ``clip``, local noise std ``std``, both real units) fit 2^bits values
    (Section 4.4, rho = 1)."""
    room = 2.0 ** (2 * bits) - clients * k**2
    if room <= 0:
        raise ConfigError(
            f"privacy.bits: {bits} bits cannot hold {k:g} standard deviations of the sum of "
            f"{clients} clients' rounding error alone; raise privacy.bits or lower "
            "privacy.k_stddevs"
        )
    spread = math.sqrt(clip**2 * clients**2 / dim + clients * std**2)
    return 2.0 * k * spread / math.sqrt(room)

"""Fairness and quality metrics of a payment scheme over a run (after FLI, Yu et al. 2020; low
confidence that these are exactly the papers' plots, docs/incentives.md): total pay, Spearman
correlation of pay with contribution, Jain's index and variance of the pay/cost ratio, mean
and variance of the regret Y and waiting Q queues at the end."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np


def ranks(values: Sequence[float]) -> np.ndarray:
    """Ranks 1..n, ties sharing their mean rank."""
    x = np.asarray(values, dtype=float)
    order = np.argsort(x, kind="stable")
    out = np.empty(len(x))
    i = 0
    while i < len(x):
        j = i
        while j + 1 < len(x) and x[order[j + 1]] == x[order[i]]:
            j += 1
        out[order[i : j + 1]] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(a: Sequence[float], b: Sequence[float]) -> float | None:
    """Spearman's rank correlation (Pearson's of the ranks); None when either side is
    constant or there are fewer than two values."""
    if len(a) < 2:
        return None
    ra, rb = ranks(a) - (len(a) + 1) / 2, ranks(b) - (len(b) + 1) / 2
    denominator = math.sqrt(float(ra @ ra) * float(rb @ rb))
    return float(ra @ rb) / denominator if denominator > 0 else None


def jain_index(values: Sequence[float]) -> float | None:
    """Jain's fairness index (sum x)^2 / (n sum x^2), in [1/n, 1]; 1 when all are equal
    (None for no values or all zero)."""
    x = np.asarray(values, dtype=float)
    square = float(x @ x)
    return float(x.sum() ** 2 / (len(x) * square)) if len(x) and square > 0 else None


def variance(values: Sequence[float]) -> float | None:
    """Population variance (None for no values)."""
    return float(np.var(np.asarray(values, dtype=float))) if len(values) else None


def mean(values: Sequence[float]) -> float | None:
    return float(np.mean(np.asarray(values, dtype=float))) if len(values) else None


def fairness(
    paid: Mapping[int, float],
    cost: Mapping[int, float],
    contribution: Mapping[int, float],
    regret: Mapping[int, float],
    waiting: Mapping[int, float],
) -> dict[str, Any]:
    """The metrics above over the clients that took part (those with a recorded cost)."""
    ids = sorted(cost)
    pay = [paid.get(i, 0.0) for i in ids]
    ratio = [paid.get(i, 0.0) / cost[i] for i in ids if cost[i] > 0]
    q = [contribution.get(i, 0.0) for i in ids]
    y = [regret.get(i, 0.0) for i in ids]
    w = [waiting.get(i, 0.0) for i in ids]
    return {
        "total_payoff": math.fsum(pay),
        "spearman_payoff_contribution": spearman(pay, q) if contribution else None,
        "jain_payoff_per_cost": jain_index(ratio),
        "variance_payoff_per_cost": variance(ratio),
        "regret_mean": mean(y),
        "regret_variance": variance(y),
        "waiting_mean": mean(w),
        "waiting_variance": variance(w),
    }

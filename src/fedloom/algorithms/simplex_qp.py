"""A small convex quadratic program over the probability simplex,

    min_a  a^T P a   subject to  a >= 0,  sum_j a_j = 1,      P symmetric positive semidefinite,

the classifier-combination step of FedPAC (Xu et al., ICLR 2023, arXiv:2306.11867, eq. 10-12;
:mod:`fedloom.algorithms.fedpac`), for a few dozen clients at most.

Solved exactly, in float64, by the primal active-set method for convex QPs (Nocedal and
Wright, Numerical Optimization, 2nd ed., 2006, Algorithm 16.3) with the bounds a_j >= 0 as the
inequalities and sum a = 1 always active. From the vertex e_j of the smallest P_jj, each
iteration solves the equality-constrained problem on the free set F (the coordinates not held
at 0), from its KKT system

    [2 P_FF  1] [a_F]   [0]
    [1^T     0] [-nu] = [1]        (least squares when singular: P only semidefinite)

and either moves toward its solution until a coordinate reaches 0 (which then leaves F), or,
when it stands still, frees the bound with the most negative multiplier (2 P a)_j - nu, or
stops when none is negative: the KKT conditions of the whole problem hold.
"""

from __future__ import annotations

import torch

TOLERANCE = 1e-12
"""Relative tolerance of the multipliers and of a step that stands still."""


def free_set_minimizer(p: torch.Tensor, free: torch.Tensor) -> tuple[torch.Tensor, float]:
    """(a, nu): the minimizer of a^T P a subject to sum a = 1 with a_j = 0 outside ``free``
    (a boolean mask), and the multiplier of the sum constraint."""
    m = p.shape[0]
    idx = torch.nonzero(free).flatten()
    k = int(idx.numel())
    system = torch.zeros(k + 1, k + 1, dtype=p.dtype)
    system[:k, :k] = 2.0 * p[idx][:, idx]
    system[:k, k] = 1.0
    system[k, :k] = 1.0
    rhs = torch.zeros(k + 1, 1, dtype=p.dtype)
    rhs[k] = 1.0
    solution = torch.linalg.lstsq(system, rhs, driver="gelsd").solution.flatten()
    a = torch.zeros(m, dtype=p.dtype)
    a[idx] = solution[:k]
    return a, -float(solution[k])


def simplex_qp(p: torch.Tensor) -> torch.Tensor:
    """argmin_a a^T P a over the probability simplex (see the module doc), in float64."""
    p = p.to(torch.float64)
    p = (p + p.T) / 2
    m = p.shape[0]
    scale = max(1.0, float(p.abs().max()))
    start = int(torch.argmin(torch.diagonal(p)))
    a = torch.zeros(m, dtype=torch.float64)
    a[start] = 1.0
    free = torch.zeros(m, dtype=torch.bool)
    free[start] = True
    for _ in range(10 * m + 10):  # the active-set method terminates; a bound for safety
        target, nu = free_set_minimizer(p, free)
        step = target - a
        if float(step.abs().max()) <= TOLERANCE * 10:
            multipliers = 2.0 * p @ a - nu
            multipliers[free] = 0.0
            j = int(torch.argmin(multipliers))
            if float(multipliers[j]) >= -TOLERANCE * scale:
                break
            free[j] = True
            continue
        shrinking = free & (step < 0)
        ratios = torch.full((m,), float("inf"), dtype=torch.float64)
        ratios[shrinking] = -a[shrinking] / step[shrinking]
        blocking = int(torch.argmin(ratios))
        length = min(1.0, float(ratios[blocking]))
        a = a + length * step
        if length < 1.0:
            a[blocking] = 0.0
            free[blocking] = False
        else:
            a = target
    a = a.clamp_min(0.0)
    return a / a.sum()

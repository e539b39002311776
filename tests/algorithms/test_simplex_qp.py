"""The simplex QP of FedPAC's classifier combination (algorithms/simplex_qp.py) against closed
forms and against enumerating every support's KKT solution."""

from __future__ import annotations

import itertools

import pytest
import torch

from fedloom.algorithms.simplex_qp import simplex_qp


def brute_force(p: torch.Tensor) -> torch.Tensor:
    """The minimizer over the simplex by enumeration: on every support S, the stationary point
    of a^T P a with sum a = 1 (its KKT system); the best of the feasible ones."""
    m = p.shape[0]
    best, best_value = None, float("inf")
    for k in range(1, m + 1):
        for support in itertools.combinations(range(m), k):
            idx = torch.tensor(support)
            system = torch.zeros(k + 1, k + 1, dtype=torch.float64)
            system[:k, :k] = 2 * p[idx][:, idx]
            system[:k, k] = 1.0
            system[k, :k] = 1.0
            rhs = torch.zeros(k + 1, dtype=torch.float64)
            rhs[k] = 1.0
            try:
                solution = torch.linalg.solve(system, rhs)
            except RuntimeError:
                continue
            if (solution[:k] < -1e-12).any():
                continue
            a = torch.zeros(m, dtype=torch.float64)
            a[idx] = solution[:k]
            value = float(a @ p @ a)
            if value < best_value - 1e-15:
                best, best_value = a, value
    assert best is not None
    return best


def test_two_independent_variances_give_inverse_variance_weights():
    # min a^2 x + (1 - a)^2 y: a = y / (x + y)
    a = simplex_qp(torch.diag(torch.tensor([1.0, 3.0], dtype=torch.float64)))
    assert torch.allclose(a, torch.tensor([0.75, 0.25], dtype=torch.float64), atol=1e-14)


def test_a_vertex_when_the_others_only_add_bias():
    # client 0 has bias 0 and variance 0.1; the others are far from it: almost e_0
    p = torch.tensor([[0.1, 0.0, 0.0], [0.0, 9.0, 8.0], [0.0, 8.0, 9.0]], dtype=torch.float64)
    p[1:, 1:] += 50.0
    a = simplex_qp(p)
    assert 0.99 < float(a[0]) < 1.0
    assert torch.allclose(a, brute_force(p), atol=1e-12)


@pytest.mark.parametrize("trial", range(40))
def test_random_fedpac_problems_match_the_enumeration_of_supports(trial):
    gen = torch.Generator().manual_seed(trial)
    m = 2 + trial % 5
    h = torch.randn(m, 4, generator=gen, dtype=torch.float64)
    diff = h[trial % m] - h  # the bias Gram matrix of client trial % m
    v = torch.rand(m, generator=gen, dtype=torch.float64) * (0.1 if trial % 2 else 2.0)
    p = torch.diag(v) + diff @ diff.T
    a = simplex_qp(p)
    expected = brute_force(p)
    assert torch.allclose(a, expected, atol=1e-10), (a, expected)
    assert float(a.sum()) == pytest.approx(1.0, abs=1e-14) and bool((a >= 0).all())


def test_semidefinite_problems_reach_the_optimal_value():
    # P = 11^T: every point of the simplex has value 1; P = 0: every point has value 0
    ones = torch.ones(4, 4, dtype=torch.float64)
    a = simplex_qp(ones)
    assert float(a @ ones @ a) == pytest.approx(1.0, abs=1e-12) and bool((a >= 0).all())
    zero = simplex_qp(torch.zeros(3, 3, dtype=torch.float64))
    assert float(zero.sum()) == pytest.approx(1.0) and bool((zero >= 0).all())
    # rank-deficient bias with no variance: two identical clients share the optimum 0
    h = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
    diff = h[0] - h
    a = simplex_qp(diff @ diff.T)
    assert float(a @ (diff @ diff.T) @ a) == pytest.approx(0.0, abs=1e-12)
    assert float(a[2]) == pytest.approx(0.0, abs=1e-12)

"""Centralized training (algorithms/centralized.py): one virtual client holding every training
client's data, so a round of full-batch steps is gradient descent on the pooled least-squares
objective sum_k n_k/n F_k, which converges to its closed-form minimiser; nothing is sent."""

from __future__ import annotations

import pytest
import torch

from tests.algorithms.oracle import (
    as_vector,
    max_curvature,
    optimum_vector,
    quadratic_data,
    run,
    weights,
)


@pytest.fixture(scope="module")
def data():
    """Unequal clients: the pooled objective weighs them n_k/n, not 1/K."""
    return quadratic_data(num_clients=5, seed=1, samples=[20, 40, 60, 90, 150])


@pytest.fixture(scope="module")
def lr(data) -> float:
    return 0.5 / max_curvature(data)


def pooled_hessian(data) -> torch.Tensor:
    """sum_k n_k/n H_k: the pooled mean squared error's Hessian in (w, b)."""
    p = weights(data)
    return sum(pk * h.double() for pk, h in zip(p, data.extras["hessians"], strict=True))


def test_local_steps_are_gradient_descent_on_the_pooled_objective(data, lr):
    """After S steps from the same start, S + 3 steps are 3 more GD steps on the pooled
    quadratic: w' - w* = (I - lr H)^3 (w - w*), with H and w* of the pooled objective."""
    short = as_vector(run(data, {"name": "centralized"}, 1, lr, local_steps=2).global_params)
    long = as_vector(run(data, {"name": "centralized"}, 1, lr, local_steps=5).global_params)
    target = optimum_vector(data.extras["global_optimum"])
    step = torch.eye(target.numel(), dtype=torch.float64) - lr * pooled_hessian(data)
    expected = target + torch.linalg.matrix_power(step, 3) @ (short - target)
    assert torch.allclose(long, expected, atol=1e-5), (long - expected).abs().max()


def test_rounds_continue_the_same_descent(data, lr):
    """Rounds of one step each are the steps of one round: the server keeps the one client's
    model as it is (no averaging with anyone)."""
    rounds = run(data, {"name": "centralized"}, 4, lr, local_steps=1)
    steps = run(data, {"name": "centralized"}, 1, lr, local_steps=4)
    assert torch.allclose(
        as_vector(rounds.global_params), as_vector(steps.global_params), atol=1e-6
    )


def test_converges_to_the_pooled_least_squares_solution(data, lr):
    result = run(data, {"name": "centralized"}, 200, lr, local_steps=10)
    target = optimum_vector(data.extras["global_optimum"])
    assert torch.allclose(as_vector(result.global_params), target, atol=1e-4)


def test_nothing_is_communicated(data, lr):
    result = run(data, {"name": "centralized"}, 2, lr, local_steps=1)
    assert result.summary["communication"]["bytes_up"] == 0
    assert result.summary["communication"]["bytes_down"] == 0

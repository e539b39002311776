"""FedSGD (McMahan et al., 2017, Section 2: one full-batch gradient step per round) on
heterogeneous least-squares clients: it is full-batch centralized gradient descent step for
step, and converges to the global optimum."""

from __future__ import annotations

import pytest
import torch

from tests.algorithms.oracle import (
    as_vector,
    max_curvature,
    optimum_vector,
    quadratic_data,
    run,
)


@pytest.fixture(scope="module")
def data():
    return quadratic_data(num_clients=5, seed=0)


@pytest.fixture(scope="module")
def lr(data) -> float:
    return 0.5 / max_curvature(data)


def test_fedsgd_equals_full_batch_centralized_gradient_descent(data, lr):
    fedsgd = run(data, {"name": "fedsgd"}, rounds=30, lr=lr)
    central = run(data, {"name": "centralized"}, rounds=30, lr=lr, local_steps=1)
    a, b = as_vector(fedsgd.global_params), as_vector(central.global_params)
    assert torch.allclose(a, b, atol=1e-5), (a - b).abs().max()
    # and the full trajectory, through the evaluated losses
    assert fedsgd.history[-1]["global"]["loss"] == pytest.approx(
        central.history[-1]["global"]["loss"], rel=1e-5
    )


def test_fedsgd_converges_to_the_global_optimum(data, lr):
    result = run(data, {"name": "fedsgd"}, rounds=3000, lr=lr)
    target = optimum_vector(data.extras["global_optimum"])
    assert torch.allclose(as_vector(result.global_params), target, atol=1e-3)

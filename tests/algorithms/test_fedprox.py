"""FedProx (Li et al., MLSys 2020, Algorithm 2) on heterogeneous least-squares clients: mu = 0 is
FedAvg, the proximal local problem has a closed-form fixed point, and a large mu approaches the
FedSGD trajectory. A missing or unsquared proximal term fails these."""

from __future__ import annotations

import pytest
import torch

from tests.algorithms.oracle import (
    as_vector,
    fedavg_fixed_point,
    max_curvature,
    quadratic_data,
    run,
)


@pytest.fixture(scope="module")
def data():
    return quadratic_data(num_clients=5, seed=0)


@pytest.fixture(scope="module")
def lr(data) -> float:
    return 0.5 / max_curvature(data)


def test_fedprox_with_mu_zero_is_fedavg(data, lr):
    fedavg = run(data, {"name": "fedavg"}, rounds=10, lr=lr, local_steps=5)
    fedprox = run(data, {"name": "fedprox", "mu": 0.0}, rounds=10, lr=lr, local_steps=5)
    assert torch.equal(as_vector(fedavg.global_params), as_vector(fedprox.global_params))


def test_fedprox_reaches_its_closed_form_fixed_point(data, lr):
    mu, steps = 1.0, 20
    result = run(data, {"name": "fedprox", "mu": mu}, rounds=600, lr=lr, local_steps=steps)
    fixed = fedavg_fixed_point(data, lr, steps, mu=mu)
    assert torch.allclose(as_vector(result.global_params), fixed, atol=1e-4)


def _trajectory_gap(data, lr: float, mu: float, steps: int = 100, rounds: int = 20) -> float:
    """Relative distance between FedProx(mu) iterates and FedSGD with server step 1/mu.

    For large mu each client's proximal subproblem is solved to w_t - g_k(w_t)/mu + O(1/mu^2),
    so one FedProx round is one FedSGD step of size 1/mu: the trajectories coincide as mu grows.
    """
    prox_lr = min(lr, 0.5 / mu)
    gaps = []
    for r in (rounds // 2, rounds):
        prox = run(data, {"name": "fedprox", "mu": mu}, rounds=r, lr=prox_lr, local_steps=steps)
        sgd = run(data, {"name": "fedsgd"}, rounds=r, lr=1.0 / mu)
        a, b = as_vector(prox.global_params), as_vector(sgd.global_params)
        init = as_vector(run(data, {"name": "fedsgd"}, rounds=1, lr=1e-12).global_params)
        gaps.append(float((a - b).norm() / (b - init).norm()))
    return max(gaps)


def test_fedprox_with_large_mu_approaches_the_fedsgd_trajectory(data, lr):
    curvature = max_curvature(data)
    small = _trajectory_gap(data, lr, mu=5 * curvature)
    large = _trajectory_gap(data, lr, mu=50 * curvature)
    assert large < small / 4, (small, large)
    assert large < 0.05, large

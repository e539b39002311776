"""Closed-form checks of the baselines on heterogeneous least-squares clients (McMahan et al. 2017;
Li et al. 2020; Karimireddy et al. 2020; Acar et al. 2021).

Every test here fails if the algorithm deviates from its paper: wrong weights, a missing or
unsquared proximal term, local steps that do not start from the server model, and so on.
"""

from __future__ import annotations

import pytest
import torch

from tests.algorithms.oracle import (
    as_vector,
    fedavg_fixed_point,
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


def test_fedavg_with_one_local_step_equals_fedsgd(data, lr):
    fedavg = run(data, {"name": "fedavg"}, rounds=25, lr=lr, local_steps=1)
    fedsgd = run(data, {"name": "fedsgd"}, rounds=25, lr=lr)
    assert torch.allclose(
        as_vector(fedavg.global_params), as_vector(fedsgd.global_params), atol=1e-6
    )


def test_fedavg_with_many_local_steps_drifts_to_its_own_fixed_point(data, lr):
    steps = 20
    result = run(data, {"name": "fedavg"}, rounds=400, lr=lr, local_steps=steps)
    w = as_vector(result.global_params)
    fixed = fedavg_fixed_point(data, lr, steps)
    global_opt = optimum_vector(data.extras["global_optimum"])
    # FedAvg converges to the closed-form fixed point of its local-GD map ...
    assert torch.allclose(w, fixed, atol=1e-4), (w - fixed).abs().max()
    # ... which is measurably away from the global optimum (client drift).
    drift = float((w - global_opt).norm())
    assert drift > 0.05, drift


def test_local_only_reaches_each_clients_own_optimum(data, lr):
    result = run(data, {"name": "local"}, rounds=300, lr=lr, local_steps=10)
    assert result.global_params is None
    assert result.summary["communication"]["bytes_up"] == 0
    assert result.summary["communication"]["bytes_down"] == 0
    for k, opt in enumerate(data.extras["local_optima"]):
        assert torch.allclose(as_vector(result.client_params[k]), optimum_vector(opt), atol=1e-3), k


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


def test_fedavg_weights_clients_by_sample_size():
    data = quadratic_data(num_clients=4, seed=1, samples=[10, 20, 40, 80])
    lr = 0.5 / max_curvature(data)
    result = run(data, {"name": "fedsgd"}, rounds=4000, lr=lr)
    # sample-size weights make the pooled least-squares solution the fixed point
    assert torch.allclose(
        as_vector(result.global_params), optimum_vector(data.extras["global_optimum"]), atol=1e-3
    )


def test_fedavg_ft_personalizes_towards_local_optima(data, lr):
    plain = run(data, {"name": "fedavg"}, rounds=50, lr=lr, local_steps=5)
    tuned = run(data, {"name": "fedavg_ft", "finetune_steps": 50}, rounds=50, lr=lr, local_steps=5)
    assert torch.equal(as_vector(plain.global_params), as_vector(tuned.global_params))
    for k, opt in enumerate(data.extras["local_optima"]):
        target = optimum_vector(opt)
        assert (as_vector(tuned.client_params[k]) - target).norm() < (
            as_vector(plain.client_params[k]) - target
        ).norm()
    assert (
        tuned.summary["final"]["personalized"]["loss_mean"]
        < plain.summary["final"]["personalized"]["loss_mean"]
    )

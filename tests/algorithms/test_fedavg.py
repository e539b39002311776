"""FedAvg (McMahan et al., 2017, Algorithm 1) on heterogeneous least-squares clients: one local
step is FedSGD, many local steps drift to the closed-form fixed point of the local-GD map (away
from the global optimum), and clients are weighted by their sample sizes."""

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


def test_fedavg_weights_clients_by_sample_size():
    data = quadratic_data(num_clients=4, seed=1, samples=[10, 20, 40, 80])
    lr = 0.5 / max_curvature(data)
    result = run(data, {"name": "fedsgd"}, rounds=4000, lr=lr)
    # sample-size weights make the pooled least-squares solution the fixed point
    assert torch.allclose(
        as_vector(result.global_params), optimum_vector(data.extras["global_optimum"]), atol=1e-3
    )

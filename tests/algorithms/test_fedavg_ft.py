"""FedAvg with local fine-tuning (FedAvg-FT) on heterogeneous least-squares clients: the global
model is FedAvg's, and each client's fine-tuned model is nearer its own optimum."""

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

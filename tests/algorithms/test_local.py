"""Local-only training (no federation) on heterogeneous least-squares clients: each client
reaches its own optimum, and nothing is communicated."""

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


def test_local_only_reaches_each_clients_own_optimum(data, lr):
    result = run(data, {"name": "local"}, rounds=300, lr=lr, local_steps=10)
    assert result.global_params is None
    assert result.summary["communication"]["bytes_up"] == 0
    assert result.summary["communication"]["bytes_down"] == 0
    for k, opt in enumerate(data.extras["local_optima"]):
        assert torch.allclose(as_vector(result.client_params[k]), optimum_vector(opt), atol=1e-3), k

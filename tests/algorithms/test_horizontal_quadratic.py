"""FedAvg's client drift on heterogeneous least-squares clients of unequal sizes (20..180
samples; tests/algorithms/pfl_quadratic_setup.py): with many local steps it misses both the
uniformly weighted optimum of the SCAFFOLD and FedDyn papers (1/K sum_k F_k) and the
sample-weighted one, which are 0.71 apart. The drift-corrected algorithms reach them exactly
(tests/algorithms/test_scaffold.py, test_feddyn.py, test_fednova.py). Measured distances are in
the comments."""

from __future__ import annotations

import pytest
import torch

from tests.algorithms.oracle import (
    max_curvature,
    optimum_vector,
    quadratic_data,
    run,
    weighted_optimum,
)
from tests.algorithms.pfl_quadratic_setup import LOCAL_STEPS, SIZES
from tests.algorithms.pfl_quadratic_setup import global_distance as distance


@pytest.fixture(scope="module")
def data():
    return quadratic_data(num_clients=len(SIZES), seed=0, samples=SIZES)


@pytest.fixture(scope="module")
def lr(data) -> float:
    return 0.5 / max_curvature(data)


@pytest.fixture(scope="module")
def uniform_optimum(data) -> torch.Tensor:
    return weighted_optimum(data, torch.full((len(SIZES),), 1.0 / len(SIZES)))


def test_fedavg_with_many_local_steps_misses_the_optimum(data, lr, uniform_optimum):
    result = run(data, {"name": "fedavg"}, rounds=150, lr=lr, local_steps=LOCAL_STEPS)
    assert distance(result, uniform_optimum) > 0.5  # measured 1.11
    pooled = optimum_vector(data.extras["global_optimum"])
    assert distance(result, pooled) > 0.1  # its own objective, missed too (client drift)

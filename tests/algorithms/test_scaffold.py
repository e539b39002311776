"""SCAFFOLD (Karimireddy et al., ICML 2020, Algorithm 1) on heterogeneous least-squares clients
of unequal sizes (tests/algorithms/pfl_quadratic_setup.py): it reaches the exact uniformly
weighted optimum with either control-variate option, partial participation and stragglers
(FedAvg misses it by 1.1: tests/algorithms/test_horizontal_quadratic.py), the sample-weighted
one with ``weighting: samples``, doubles FedAvg's traffic, and names the key of a bad
hyperparameter. Measured distances are in the comments."""

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


@pytest.mark.parametrize(
    "algorithm, extra",
    [
        ({"name": "scaffold"}, {}),
        ({"name": "scaffold", "option": "I"}, {}),
        ({"name": "scaffold"}, {"clients_per_round": 3}),
        ({"name": "scaffold"}, {"stragglers": 0.4}),
    ],
    ids=lambda v: str(v),
)
def test_drift_corrected_algorithms_reach_the_exact_optimum(
    data, lr, uniform_optimum, algorithm, extra
):
    """SCAFFOLD's fixed point has c_i = grad F_i(x*); FedDyn's has g_k = grad F_k(x*) and
    h = sum_k g_k / K = 0: both are exact with any number of local steps, with partial
    participation and with stragglers doing partial work (measured <= 1e-6 after 300 rounds)."""
    rounds = 600 if "clients_per_round" in extra else 300
    result = run(data, algorithm, rounds=rounds, lr=lr, local_steps=LOCAL_STEPS, **extra)
    assert distance(result, uniform_optimum) < 1e-5


@pytest.mark.parametrize(
    "name",
    [
        "scaffold",
    ],
)
def test_sample_weighting_targets_the_pooled_objective(data, lr, name):
    algorithm = {"name": name, "weighting": "samples", **({"mu": 1.0} if name == "feddyn" else {})}
    result = run(data, algorithm, rounds=300, lr=lr, local_steps=LOCAL_STEPS)
    assert distance(result, optimum_vector(data.extras["global_optimum"])) < 1e-5


def test_scaffold_doubles_the_traffic_of_fedavg(data, lr):
    fedavg = run(data, {"name": "fedavg"}, rounds=2, lr=lr, local_steps=2)
    scaffold = run(data, {"name": "scaffold"}, rounds=2, lr=lr, local_steps=2)
    for direction in ("bytes_up", "bytes_down"):
        assert scaffold.summary["communication"][direction] == (
            2 * fedavg.summary["communication"][direction]
        )


@pytest.mark.parametrize(
    "algorithm, message",
    [
        ({"name": "scaffold", "option": "III"}, "algorithm.option"),
        ({"name": "scaffold", "server_lr": 0}, "algorithm.server_lr"),
        ({"name": "scaffold", "weighting": "size"}, "algorithm.weighting"),
        ({"name": "scaffold", "mu": 0.1}, "algorithm.mu: unknown key"),
    ],
)
def test_hyperparameter_errors_name_the_key(data, algorithm, message):
    from fedloom.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        run(data, algorithm, rounds=1, lr=0.1)

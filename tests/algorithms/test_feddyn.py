"""FedDyn (Acar et al., ICLR 2021, Algorithm 1) on heterogeneous least-squares clients of unequal
sizes (tests/algorithms/pfl_quadratic_setup.py): it reaches the exact uniformly weighted
optimum with partial participation and stragglers, the sample-weighted one with
``weighting: samples``; alpha is an alias of mu; bad hyperparameters name their key."""

from __future__ import annotations

import pytest
import torch

from tests.algorithms.oracle import (
    as_vector,
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
        ({"name": "feddyn", "mu": 1.0}, {}),
        ({"name": "feddyn", "mu": 1.0}, {"clients_per_round": 3}),
        ({"name": "feddyn", "mu": 1.0}, {"stragglers": 0.4}),
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
        "feddyn",
    ],
)
def test_sample_weighting_targets_the_pooled_objective(data, lr, name):
    algorithm = {"name": name, "weighting": "samples", **({"mu": 1.0} if name == "feddyn" else {})}
    result = run(data, algorithm, rounds=300, lr=lr, local_steps=LOCAL_STEPS)
    assert distance(result, optimum_vector(data.extras["global_optimum"])) < 1e-5


def test_feddyn_alpha_is_an_alias_of_mu(data, lr):
    a = run(data, {"name": "feddyn", "mu": 0.3}, rounds=3, lr=lr, local_steps=5)
    b = run(data, {"name": "feddyn", "alpha": 0.3}, rounds=3, lr=lr, local_steps=5)
    assert torch.equal(as_vector(a.global_params), as_vector(b.global_params))


@pytest.mark.parametrize(
    "algorithm, message",
    [
        ({"name": "feddyn", "mu": 0}, "algorithm.mu"),
        ({"name": "feddyn", "alpha": -1}, "algorithm.alpha"),
    ],
)
def test_hyperparameter_errors_name_the_key(data, algorithm, message):
    from fedloom.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        run(data, algorithm, rounds=1, lr=0.1)

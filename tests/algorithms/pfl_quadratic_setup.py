"""Heterogeneous least-squares clients (sizes 20..180, so sample and uniform weights differ) and
the pieces shared by the tests of Ditto, APFL (tests/algorithms/test_ditto.py, test_apfl.py),
SCAFFOLD, FedDyn and FedNova (test_scaffold.py, test_feddyn.py, test_fednova.py): distances to
closed-form targets, the stochastic training setting, and the executor check."""

from __future__ import annotations

import torch

import fedloom
from tests.algorithms.oracle import (
    as_vector,
    optimum_vector,
)

SIZES = [20, 40, 60, 100, 180]
LOCAL_STEPS = 20


def distance(params: dict[str, torch.Tensor], target: torch.Tensor) -> float:
    return float((as_vector(params) - target).norm())


def local_optimum(data, k: int) -> torch.Tensor:
    return optimum_vector(data.extras["local_optima"][k])


MINIBATCH = {"local_steps": 5, "batch_size": 8, "clients_per_round": 3, "stragglers": 0.4}
"""Stochastic, partial participation, stragglers doing partial work."""


# -- the executor and resume setting ----------------------------------------------------
QUADRATIC = {
    "seed": 1,
    "data": {
        "name": "quadratic",
        "num_clients": 6,
        "options": {"samples": [20, 30, 40, 50, 60, 80]},
    },
    "model": {"name": "logreg"},
    "train": {**MINIBATCH, "rounds": 6, "clients_per_round": 4, "lr": 0.05},
    "eval": {"every": 2, "new_clients": 1},
    "checkpoint": {"every": 2},
}


def executors_match_sequential(algorithm):
    """The vectorized executor (chunks of 2) and 2 sequential workers give the sequential
    executor's personal and global models on QUADRATIC (within 1e-5)."""

    def result(executor):
        config = {**QUADRATIC, "algorithm": algorithm, "executor": executor}
        return fedloom.run(config, write=False, progress=False)

    seq = result({"kind": "sequential"})
    for other in (
        result({"kind": "vectorized", "chunk_size": 2}),
        result({"kind": "sequential", "workers": 2, "threads": 1}),
    ):
        for k, params in seq.client_params.items():
            assert torch.allclose(as_vector(params), as_vector(other.client_params[k]), atol=1e-5)
        assert torch.allclose(
            as_vector(seq.global_params), as_vector(other.global_params), atol=1e-5
        )


def global_distance(result, target: torch.Tensor) -> float:
    """Distance of a run's global model to ``target``."""
    return float((as_vector(result.global_params) - target).norm())

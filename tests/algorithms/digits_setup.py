"""The small digits setup the algorithm unit tests share: 6 clients of scikit-learn's 8x8
digits (no download), the 2NN, a few short rounds, one held-out new client, sequential."""

from __future__ import annotations

from typing import Any

import torch

import fedloom
from fedloom.algorithms import AlgorithmContext
from fedloom.core.functional import FunctionalModel
from fedloom.core.pytree import Tree, weighted_average
from fedloom.models import MLP
from fedloom.solvers.local import PlanMaker

SHARDS = {"kind": "shards", "shards_per_client": 2}
DIRICHLET = {"kind": "dirichlet", "alpha": 0.5}

BODY = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
"""The 2NN's body: its two hidden layers (FedPer, FedCR and FedRep share it, LG-FedAvg keeps it)."""
HEAD = ["fc3.weight", "fc3.bias"]
"""The 2NN's head: its output layer."""


def digits_config(
    algorithm: dict[str, Any], *, partition: dict[str, Any] = SHARDS, **train: Any
) -> dict[str, Any]:
    """3 rounds of 3 clients x 5 local steps of batch 16 at lr 0.05 (``train`` overrides),
    evaluated at the end."""
    train = {
        "rounds": 3,
        "clients_per_round": 3,
        "local_steps": 5,
        "batch_size": 16,
        "lr": 0.05,
        **train,
    }
    return {
        "seed": 3,
        "data": {"name": "digits", "num_clients": 6, "partition": dict(partition)},
        "model": {"name": "mlp"},
        "algorithm": algorithm,
        "train": train,
        "eval": {"every": train["rounds"], "new_clients": 1},
        "executor": {"kind": "sequential"},
    }


def run_digits(
    algorithm: dict[str, Any], *, partition: dict[str, Any] = SHARDS, **train: Any
) -> fedloom.RunResult:
    config = digits_config(algorithm, partition=partition, **train)
    return fedloom.run(config, write=False, progress=False)


def digits_ctx(hidden: int = 200, num_classes: int = 10) -> AlgorithmContext:
    """An AlgorithmContext for the 8x8 digits 2NN, four clients of 30/50/20/40 samples, for
    testing an algorithm's pieces without the engine."""
    model = FunctionalModel(MLP((1, 8, 8), num_classes, hidden=hidden), "classification")
    return AlgorithmContext(
        model=model,
        seed=0,
        num_clients=4,
        lr=0.1,
        batch_size=8,
        aggregate=weighted_average,
        make_plan=PlanMaker(0, 8),
        population={0: 30, 1: 50, 2: 20, 3: 40},
    )


def assert_same_global(a: fedloom.RunResult, b: fedloom.RunResult) -> None:
    """The same global model, bit for bit (a reduction to FedAvg)."""
    assert a.global_params is not None and b.global_params is not None
    assert a.global_params.keys() == b.global_params.keys()
    for key, value in a.global_params.items():
        assert torch.equal(value, b.global_params[key]), key


# -- the runs of digits_config: who trains, the initial model ---------------------------------
TRAINED = list(range(5))
NEW = 5  # digits_config holds out client 5 (eval.new_clients: 1)


def initial_params() -> Tree:
    """The initial model of digits_config's runs (seed 3)."""
    return FunctionalModel(MLP((1, 8, 8), 10), "classification").initial_state(3)[0]


def flat(params: Tree, keys: list[str]) -> torch.Tensor:
    return torch.cat([params[k].flatten() for k in keys])

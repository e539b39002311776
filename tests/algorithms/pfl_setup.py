"""The shared learning-test setup of the personalized algorithms (issue: weak-consensus PFL):
Fashion-MNIST, pathological label skew (2 label shards per client), 20 clients, the 2NN.

Every personalized algorithm's test compares its mean personalized accuracy with FedAvg's
global model evaluated on the same clients' held-out data, on this exact setup.
"""

from __future__ import annotations

import copy
from functools import lru_cache
from typing import Any

import fedloom

ROUNDS = 20
BASE: dict[str, Any] = {
    "seed": 0,
    "data": {
        "name": "fashion_mnist",
        "num_clients": 20,
        "partition": {"kind": "shards", "shards_per_client": 2},
    },
    "model": {"name": "mlp"},
    "train": {
        "rounds": ROUNDS,
        "clients_per_round": 10,
        "local_steps": 20,
        "batch_size": 32,
        "lr": 0.05,
    },
    "eval": {"every": ROUNDS},
    "executor": {"kind": "auto"},
}


def pfl_config(algorithm: dict[str, Any], **train: Any) -> dict[str, Any]:
    """BASE with ``algorithm`` and optional ``train`` overrides."""
    config = copy.deepcopy(BASE)
    config["algorithm"] = dict(algorithm)
    config["train"].update(train)
    return config


def run_pfl(algorithm: dict[str, Any], **train: Any) -> fedloom.RunResult:
    return fedloom.run(pfl_config(algorithm, **train), write=False, progress=False)


@lru_cache(maxsize=1)
def fedavg_accuracy_on_clients() -> float:
    """Mean accuracy of FedAvg's global model on each client's held-out data (BASE setup)."""
    result = run_pfl({"name": "fedavg"})
    return float(result.summary["final"]["personalized"]["accuracy_mean"])

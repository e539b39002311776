"""Run configurations with poisoning attacks and robust aggregation (docs/security.md): the
robustness setting on Fashion-MNIST and a small digits setting; shared by tests/attacks/ and
tests/robust/."""

from __future__ import annotations

from typing import Any

import fedloom


def fmnist(attack: dict[str, Any], aggregator: str, rounds: int = 10) -> dict[str, Any]:
    """The robustness setting of docs/security.md: Fashion-MNIST softmax regression, IID, 50
    clients of 1,200 samples, all in every round, 10 malicious, 1 local epoch of SGD at lr
    0.1, batch 50."""
    return {
        "seed": 0,
        "data": {"name": "fashion_mnist", "num_clients": 50, "partition": {"kind": "iid"}},
        "model": {"name": "logreg"},
        "algorithm": {"name": "fedavg"},
        "train": {"rounds": rounds, "local_epochs": 1, "batch_size": 50, "lr": 0.1},
        "eval": {"every": rounds},
        "monitor": {"enabled": False},
        "executor": {"kind": "vectorized"},
        "attack": attack,
        "aggregator": {
            "kind": aggregator,
            **({"beta": 0.2} if aggregator == "trimmed_mean" else {}),
        },
    }


def accuracy(config: dict[str, Any]) -> float:
    result = fedloom.run(config, write=False, progress=False)
    return result.summary["final"]["global"]["accuracy"]


def digits(attack: dict[str, Any], aggregator: dict[str, Any], **train: Any) -> dict[str, Any]:
    return {
        "seed": 1,
        "data": {"name": "digits", "num_clients": 12, "partition": {"kind": "iid"}},
        "model": {"name": "mlp"},
        "algorithm": {"name": "fedavg"},
        "train": {
            "rounds": 3,
            "clients_per_round": 11,
            "local_epochs": 1,
            "batch_size": 16,
            "lr": 0.05,
            **train,
        },
        "eval": {"every": 1},
        "executor": {"kind": "sequential"},
        "attack": attack,
        "aggregator": aggregator,
    }

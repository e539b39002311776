"""The rotated-images setup of the clustering tests (IFCA, CFL, FedEM): ``CLIENTS`` clients,
client c's images turned by the rotation partition's angle c % 4 (``PLANTED``), logistic
regression, all clients each round, 10 local steps of batch 32 at lr 0.1."""

from __future__ import annotations

import fedloom

CLIENTS = 20
PLANTED = [c % 4 for c in range(CLIENTS)]  # rotation: client c turned by angles[c % 4]


def rotated(name: str, algorithm: dict, rounds: int, **train) -> dict:
    """The config of ``rounds`` rounds of ``algorithm`` on the rotated dataset ``name``;
    ``train`` overrides the train section (``num_clients`` stays ``CLIENTS``)."""
    return {
        "seed": 0,
        "data": {"name": name, "num_clients": CLIENTS, "partition": {"kind": "rotation"}},
        "model": {"name": "logreg"},
        "algorithm": algorithm,
        "train": {
            "rounds": rounds,
            "clients_per_round": None,
            "local_steps": 10,
            "batch_size": 32,
            "lr": 0.1,
            **train,
        },
        "eval": {"every": rounds},
        "monitor": {"enabled": False},
    }


def personalized(result: fedloom.RunResult) -> float:
    """The final personalized mean accuracy."""
    return float(result.summary["final"]["personalized"]["accuracy_mean"])

"""Fixtures for the audit tests: the small-client Fashion-MNIST setting of docs/audit.md
("Measured") and finished runs on it, made once per session and shared by the acceptance tests."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import fedloom
from fedloom.audit.scenarios import small_clients
from fedloom.data import FederatedData

Holdout = tuple[torch.Tensor, torch.Tensor]


def mlp_config(seed: int, algorithm: dict[str, Any], rounds: int) -> dict[str, Any]:
    """That setting's training: the 2NN, SGD lr 0.05, batch 32, one local epoch a round."""
    return {
        "seed": seed,
        "model": {"name": "mlp"},
        "algorithm": algorithm,
        "train": {"rounds": rounds, "local_epochs": 1, "batch_size": 32, "lr": 0.05},
        "eval": {"every": rounds},
        "checkpoint": {"every": rounds},
        "monitor": {"enabled": False},
        "executor": {"kind": "sequential"},
    }


RUNS = {
    "local": ({"name": "local"}, 100),  # 100 local epochs: the overfit reference
    "fedavg": ({"name": "fedavg"}, 30),
    "ditto_1": ({"name": "ditto", "mu": 1.0}, 30),
}


class MiaRuns:
    """Runs of RUNS on ``small_clients`` data, one per (name, seed, clients), made on demand."""

    def __init__(self, root: Path, base: Path) -> None:
        self.root, self.base = root, base
        self._data: dict[tuple[int, int], tuple[FederatedData, Holdout]] = {}
        self._runs: dict[tuple[str, int, int], Path] = {}

    def data(self, seed: int, clients: int) -> tuple[FederatedData, Holdout]:
        key = (seed, clients)
        if key not in self._data:
            self._data[key] = small_clients(self.root, clients, 200, 100, seed)
        return self._data[key]

    def run(self, name: str, seed: int, clients: int) -> Path:
        key = (name, seed, clients)
        if key not in self._runs:
            algorithm, rounds = RUNS[name]
            out = self.base / f"{name}-{seed}-{clients}"
            data, _ = self.data(seed, clients)
            fedloom.run(mlp_config(seed, algorithm, rounds), data=data, out=out, progress=False)
            self._runs[key] = out
        return self._runs[key]


@pytest.fixture(scope="session")
def mia_runs(data_root: Path, tmp_path_factory: pytest.TempPathFactory) -> MiaRuns:
    return MiaRuns(data_root, tmp_path_factory.mktemp("mia-runs"))


AuditOf = Callable[..., dict[str, Any]]


@pytest.fixture(scope="session")
def audit_of(mia_runs: MiaRuns) -> AuditOf:
    """``audit_of(name, seed, clients, **options)``: fedloom.audit of that run on its data."""

    def audit(name: str, seed: int, clients: int, **options: Any) -> dict[str, Any]:
        data, holdout = mia_runs.data(seed, clients)
        path = mia_runs.run(name, seed, clients)
        return fedloom.audit(path, data=data, holdout=holdout, members=200, **options)

    return audit

"""Same config, same numbers; a run killed after a checkpoint and resumed equals the
uninterrupted run (README.md, "Executors"; docs/executors.md)."""

from __future__ import annotations

import pytest
import torch

import fedloom
from tests.conftest import metrics_without_time
from tests.resume import killed_and_resumed

CONFIG = {
    "seed": 3,
    "data": {"name": "digits", "num_clients": 8, "partition": {"kind": "dirichlet", "alpha": 0.5}},
    "model": {"name": "mlp"},
    "algorithm": {"name": "fedavg_ft", "finetune_steps": 3},
    "train": {
        "rounds": 6,
        "clients_per_round": 4,
        "local_steps": 5,
        "batch_size": 16,
        "lr": 0.05,
        "stragglers": 0.5,
    },
    "eval": {"every": 2},
    "checkpoint": {"every": 2},
    "executor": {"kind": "sequential"},
}


def test_same_config_gives_identical_metrics():
    a = fedloom.run(CONFIG, write=False, progress=False)
    b = fedloom.run(CONFIG, write=False, progress=False)
    assert metrics_without_time(a.history) == metrics_without_time(b.history)
    for key in a.global_params:
        assert torch.equal(a.global_params[key], b.global_params[key])


def test_different_seed_gives_different_metrics():
    a = fedloom.run(CONFIG, write=False, progress=False)
    b = fedloom.run({**CONFIG, "seed": 4}, write=False, progress=False)
    assert metrics_without_time(a.history) != metrics_without_time(b.history)


@pytest.mark.parametrize(
    "algorithm",
    [
        CONFIG["algorithm"],
        {"name": "scaffold"},  # client controls c_i and server control c
        {"name": "feddyn", "mu": 0.1},  # client gradients g_k and server h
        {"name": "fedyogi", "server_lr": 0.05},  # server moments m, v
        {"name": "l2sgd"},  # server init, client theta_k
        {"name": "pfedme"},  # client theta_k
    ],
    ids=lambda a: a["name"],
)
def test_killed_and_resumed_run_equals_uninterrupted(tmp_path, algorithm):
    _, _, saved = killed_and_resumed({**CONFIG, "algorithm": algorithm}, tmp_path, crash_round=5)
    assert saved["round"] == 4  # the last checkpoint before the crash

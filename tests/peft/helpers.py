"""Small PEFT runs on the tiny random BERT and BBC headlines (seconds each)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import fedloom
from tests.conftest import metrics_without_time
from tests.resume import Crash, CrashAt

TINY_CLIENTS = 4


def tiny_config(
    share: str = "a",
    kind: str = "lora",
    algorithm: str = "fedavg",
    executor: str = "sequential",
    rounds: int = 2,
    **peft: Any,
) -> dict[str, Any]:
    return {
        "seed": 0,
        "data": {
            "name": "bbc_news",
            "num_clients": TINY_CLIENTS,
            "partition": {"kind": "dirichlet", "alpha": 0.3},
            "max_length": 12,
        },
        "model": {"name": "tiny_bert"},
        "peft": {"kind": kind, "r": 4, "alpha": 8, "share": share, **peft},
        "algorithm": {"name": algorithm},
        "train": {"rounds": rounds, "local_steps": 3, "batch_size": 16, "lr": 0.5},
        "eval": {"every": 1},
        "checkpoint": {"every": 1},
        "monitor": {"enabled": False},
        "executor": {"kind": executor},
    }


def resume_matches(tmp_path, cfg: dict[str, Any]) -> None:
    """Killed in its last round, resumed from the checkpoint before: the same run."""
    full = fedloom.run(cfg, out=tmp_path / "full", progress=False)
    kill = [CrashAt(cfg["train"]["rounds"])]
    with pytest.raises(Crash):
        fedloom.run(cfg, out=tmp_path / "killed", progress=False, callbacks=kill)
    resumed = fedloom.run(resume=tmp_path / "killed", progress=False)
    assert metrics_without_time(resumed.history) == metrics_without_time(full.history)
    assert resumed.summary["extras"] == full.summary["extras"]
    for c, params in full.client_params.items():
        for k, v in params.items():
            assert torch.equal(v, resumed.client_params[c][k]), (c, k)

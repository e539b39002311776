"""Small PEFT runs on the tiny random BERT and BBC headlines (seconds each)."""

from __future__ import annotations

from typing import Any

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

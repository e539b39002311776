"""Tiny sweeps for the tests: digits with logistic regression, a few rounds."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

BASE: dict[str, Any] = {
    "data": {"name": "digits", "num_clients": 4, "partition": {"kind": "dirichlet", "alpha": 0.5}},
    "model": {"name": "logreg"},
    "algorithm": {"name": "fedavg"},
    "train": {"rounds": 2, "local_steps": 2, "batch_size": 16, "lr": 0.1},
    "eval": {"every": 1},
    "checkpoint": {"every": 1},
}


def write_spec(folder: Path, **spec: Any) -> Path:
    """SPEC.yaml in ``folder`` (default base BASE, seeds [0])."""
    path = folder / "spec.yaml"
    path.write_text(yaml.safe_dump({"base": BASE, "seeds": [0], **spec}, sort_keys=False))
    return path

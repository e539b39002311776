"""Shared fixtures: the real data root (FEDLOOM_DATA) and small helpers for running fedloom."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def data_root() -> Path:
    root = os.environ.get("FEDLOOM_DATA")
    if not root:
        pytest.skip("FEDLOOM_DATA is not set (CI sets it to ../shared/data)")
    path = Path(root).resolve()
    assert path.is_dir(), f"FEDLOOM_DATA={root} does not exist"
    return path


TIMINGS = {"wall_seconds", "seconds"}
"""Metrics-row keys that hold measured times (they differ between identical runs)."""


def metrics_without_time(history: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if k not in TIMINGS} for row in history]

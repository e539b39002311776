"""The ``executor`` and ``state`` sections of a run config: where clients train and where
their state is kept."""

from __future__ import annotations

import importlib.util
import re
from typing import Literal

from pydantic import Field, ValidationInfo, field_validator

from fedloom.core.settings import StrictModel

DEFAULT_BUDGET = 2 * 2**30
"""executor.memory_budget when none is given: 2 GiB."""


_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "kib": 2**10,
    "m": 10**6,
    "mb": 10**6,
    "mib": 2**20,
    "g": 10**9,
    "gb": 10**9,
    "gib": 2**30,
}


def parse_bytes(text: str | int | None) -> int:
    """'2GB', '512MiB', '1e9' or an int -> bytes (None: the 2 GiB default)."""
    if text is None:
        return DEFAULT_BUDGET
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = match.group(2).lower() if match else None
    if not match or unit not in _UNITS:
        raise ValueError(f"cannot read {text!r}; write e.g. '512MB' or '2GiB'")
    return int(float(match.group(1)) * _UNITS[unit])


class ExecutorConfig(StrictModel):
    """Where and how clients train (engine/factory.py). Every combination is checked here,
    once, when the config is parsed."""

    kind: Literal["auto", "sequential", "vectorized", "ray"] = "auto"
    device: Literal["cpu", "cuda"] = "cpu"
    workers: int | None = Field(default=None, ge=1)
    threads: int | None = Field(default=None, ge=1)
    chunk_size: int | None = Field(default=None, ge=1)
    memory_budget: str | None = None
    address: str | None = None

    @field_validator("kind")
    @classmethod
    def _ray_installed(cls, kind: str) -> str:
        if kind == "ray" and importlib.util.find_spec("ray") is None:
            raise ValueError(
                "'ray' needs Ray, an optional extra that is not installed: "
                "pip install 'fedloom[ray]' (or choose kind: auto, sequential or vectorized)"
            )
        return kind

    @field_validator("device")
    @classmethod
    def _device_runs_it(cls, device: str, info: ValidationInfo) -> str:
        kind = info.data.get("kind")
        if device == "cuda" and kind in ("sequential", "ray"):
            raise ValueError(
                f"'cuda' is not supported by the {kind} executor (it trains on the CPU); use "
                "device: cpu, or kind: vectorized (or auto) on a GPU"
            )
        if device == "cuda":
            import torch

            if not torch.cuda.is_available():
                raise ValueError("'cuda' was asked for but torch sees no CUDA device")
        return device

    @field_validator("workers")
    @classmethod
    def _workers_on_cpu(cls, workers: int | None, info: ValidationInfo) -> int | None:
        if workers and workers > 1 and info.data.get("device") == "cuda":
            raise ValueError("worker processes run on the CPU only")
        return workers

    @field_validator("memory_budget")
    @classmethod
    def _readable_budget(cls, value: str | None) -> str | None:
        parse_bytes(value)
        return value


class StateConfig(StrictModel):
    storage: Literal["memory", "mmap"] = "memory"
    """Per-client persistent state: stacked tensors in RAM, or memory-mapped files under the
    run directory's ``state/`` (for very many clients)."""

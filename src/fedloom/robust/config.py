"""The ``aggregator`` section of a run config (docs/security.md)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from fedloom.core.settings import StrictModel


class AggregatorConfig(StrictModel):
    """The server's aggregation rule (docs/security.md): FedAvg's weighted mean, or a
    Byzantine-robust rule in its place for every algorithm that aggregates."""

    kind: Literal[
        "mean",
        "median",
        "trimmed_mean",
        "krum",
        "multi_krum",
        "bulyan",
        "norm_clip",
        "feature_aware",
    ] = "mean"
    """feature_aware: the first layer's weight columns averaged over the clients that observed
    each input feature (docs/missing_features.md)."""
    f: int | None = Field(default=None, ge=0)
    """krum, multi_krum, bulyan: Byzantine clients tolerated per round (null: the attack's
    fraction of the clients per round, rounded up; 1 without an attack)."""
    beta: float = Field(default=0.1, ge=0.0, lt=0.5)
    """trimmed_mean: the fraction trimmed at each end."""
    m: int | None = Field(default=None, ge=1)
    """multi_krum: updates averaged (null: n - f)."""
    max_norm: float | None = Field(default=None, gt=0.0)
    """norm_clip: the bound M (null: the median update norm of the round)."""
    noise: float = Field(default=0.0, ge=0.0)
    """norm_clip: std of Gaussian noise added to the mean (Sun et al. 2019's weak DP)."""

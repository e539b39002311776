"""The ``monitor`` (with its alert thresholds) and ``tracking`` sections of a run config."""

from __future__ import annotations

from pydantic import Field

from fedloom.core.settings import StrictModel


class AlertConfig(StrictModel):
    """Thresholds of the report's and the dashboard's alert rules (docs/monitoring.md)."""

    loss_patience: int = Field(default=5, ge=2)
    """Evaluations in a row without a new lowest loss (global, else training loss)."""
    p10_min: float | None = Field(default=0.65, ge=0.0, le=1.0)
    """Personalized accuracy P10 below this (default 0.65); null: off."""
    update_norm_growth: float = Field(default=10.0, gt=1.0)
    """Median update norm above this multiple of its first value (exploding updates)."""
    update_norm_growth_client: float = Field(default=10.0, gt=1.0)
    """A client's update norm above this multiple of its own first recorded value, or not
    finite (that client diverging)."""
    client_accuracy_drop: float | None = Field(default=0.5, gt=0.0, lt=1.0)
    """A client's personalized accuracy below this fraction of its best earlier value
    (collapse: e.g. 0.95 -> 0.0 while the mean looks fine); null: off."""
    client_accuracy_min_samples: int = Field(default=20, ge=1)
    """... checked only on clients with at least this many test samples: below, one sample
    moves the accuracy by more than 5 points and a fine-tuned model's swings are no collapse
    (the default run: clients of 3-11 digits fell from 9/10 to 2/10 and back)."""
    update_norm_decay: float = Field(default=1e-3, gt=0.0, lt=1.0)
    """Median update norm below this fraction of its first value (vanishing updates)."""
    zeta_jump: float = Field(default=2.0, gt=0.0)
    """Gradient dissimilarity zeta^2 rising by more than this fraction between evaluations
    (2.0: a jump of more than 200%)."""
    communication_budget_mb: float | None = Field(default=None, gt=0.0)
    """Total MB up + down the run may use; null: no budget."""
    cold_start_steps: int = Field(default=20, ge=0)
    """New clients should reach ``cold_start_target`` within this many adaptation steps."""
    cold_start_target: float = Field(default=0.9, gt=0.0, le=1.0)
    """... of the trained clients' mean personalized accuracy."""
    epsilon_max: float = Field(default=10.0, gt=0.0)
    """Privacy budget epsilon above this (when a privacy mechanism reports one)."""


class MonitorConfig(StrictModel):
    """What the engine records for training health every evaluated round
    (engine/monitoring.py)."""

    enabled: bool = True
    clients: int = Field(default=10, ge=2)
    """At most this many clients enter the cosine matrix and zeta^2 (a fixed sample)."""
    gradient_dissimilarity: bool = True
    """Compute zeta^2 (gradients of the sampled clients at the global model)."""
    gradient_samples: int | None = Field(default=256, ge=1)
    """Training samples per client (a fixed random subset) of zeta^2's gradients; null: all."""
    alerts: AlertConfig = Field(default_factory=AlertConfig)


class TrackingConfig(StrictModel):
    """Optional exporters of the per-round metrics to other tools."""

    tensorboard: bool = False
    """Scalars under <run dir>/tensorboard (needs the ``tensorboard`` package)."""
    mlflow: str | None = None
    """An MLflow tracking URI (e.g. file:./mlruns or http://127.0.0.1:5000); needs ``mlflow``."""
    experiment: str = "fedloom"
    """MLflow experiment name."""

"""Optional exporters of the per-round metrics: TensorBoard scalars and MLflow runs, through
those libraries' own APIs (``tracking.tensorboard: true``, ``tracking.mlflow: URI``).

Every number of a metrics row becomes one scalar named by its path (``personalized/
accuracy_mean``, ``monitor/update_norm/p50``, ``communication/bytes_up``), logged at step =
round; per-client tables (client accuracy, update norms, the cosine matrix) stay in
metrics.jsonl. The libraries are imported only when asked for, with a clear error when missing.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any, Protocol

from fedloom.core.runpaths import under
from fedloom.errors import ConfigError
from fedloom.run_config.monitor import TrackingConfig

PER_CLIENT = {"client_accuracy", "client_update_norm", "cosine", "client_info"}


def scalars(row: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """The numbers of a (nested) metrics row by their '/'-joined paths (no per-client data)."""
    out: dict[str, float] = {}
    for key, value in row.items():
        if key in PER_CLIENT or key == "round":
            continue
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out |= scalars(value, name + "/")
        elif isinstance(value, int | float) and not isinstance(value, bool):
            out[name] = float(value)
    return out


def _require(module: str, key: str, package: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ConfigError(
            f"{key} needs the '{package}' package: pip install '{package}' "
            "(or pip install 'fedloom[tracking]')"
        ) from None


class TrackedConfig(Protocol):
    """A run family's config as the trackers read it: its ``tracking:`` section and the
    whole resolved config (MLflow's parameters)."""

    @property
    def tracking(self) -> TrackingConfig: ...

    def to_dict(self) -> dict[str, Any]: ...


class Tracker(Protocol):
    def log(self, row: dict[str, Any]) -> None: ...

    def close(self, summary: dict[str, Any] | None, failed: bool = False) -> None: ...


class TensorBoardTracker:
    """Scalars in TensorBoard's event files under ``<run dir>/tensorboard``."""

    def __init__(self, log_dir: Path) -> None:
        _require("tensorboard", "tracking.tensorboard", "tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(log_dir))

    def log(self, row: dict[str, Any]) -> None:
        for name, value in scalars(row).items():
            self.writer.add_scalar(name, value, global_step=int(row["round"]))
        self.writer.flush()

    def close(self, summary: dict[str, Any] | None, failed: bool = False) -> None:
        self.writer.close()


class MLflowTracker:
    """One MLflow run per fedloom run: the resolved config as parameters, every round's
    scalars as metrics, summary.json as an artifact."""

    def __init__(self, uri: str, experiment: str, run_name: str, config: TrackedConfig) -> None:
        self.mlflow = _require("mlflow", "tracking.mlflow", "mlflow-skinny")
        self.mlflow.set_tracking_uri(uri)
        self.mlflow.set_experiment(experiment)
        self.run = self.mlflow.start_run(run_name=run_name)
        params = {k: str(v)[:500] for k, v in _flat_config(config.to_dict()).items()}
        self.mlflow.log_params(params)

    def log(self, row: dict[str, Any]) -> None:
        metrics = {k.replace("/", "."): v for k, v in scalars(row).items()}
        self.mlflow.log_metrics(metrics, step=int(row["round"]))

    def close(self, summary: dict[str, Any] | None, failed: bool = False) -> None:
        if summary is not None:
            self.mlflow.log_dict(summary, "summary.json")
        self.mlflow.end_run(status="FAILED" if failed else "FINISHED")


def _flat_config(obj: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(obj, dict):
        out: dict[str, Any] = {}
        for k, v in obj.items():
            out |= _flat_config(v, f"{prefix}{k}.")
        return out
    return {prefix.rstrip("."): obj}


def make_trackers(config: TrackedConfig, run_dir: Path | None, run_name: str) -> list[Tracker]:
    """The exporters ``config.tracking`` asks for (none by default)."""
    tracking = config.tracking
    trackers: list[Tracker] = []
    if tracking.tensorboard:
        if run_dir is None:
            raise ConfigError(
                "tracking.tensorboard writes under the run directory: run with a run "
                "directory (fedloom run, or fedloom.run(..., write=True))"
            )
        trackers.append(TensorBoardTracker(under(run_dir, "tensorboard")))
    if tracking.mlflow:
        trackers.append(MLflowTracker(tracking.mlflow, tracking.experiment, run_name, config))
    return trackers

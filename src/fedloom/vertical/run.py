"""A vertical or transfer run from its config: data, estimator, metrics per iteration (or
tree), checkpoints, resume, and a normal run directory (``config.yaml``, ``metrics.jsonl``,
``summary.json``, ``checkpoints/``, ``report.html``), all kept by the run shell every run
family goes through (engine/shell.py, docs/vertical.md).

Each metrics row: ``round`` (iterations or trees done), ``train_loss`` (the protocol's loss;
SecureBoost: the training log loss or squared error), ``global`` (test accuracy, AUC and log
loss, or RMSE and MSE in the target's own units), cumulative ``communication`` and a
``vertical`` block: training bytes sent and received per party, and the seconds spent in
cryptography vs the rest. Training traffic excludes the prediction used for evaluation (its
bytes are reported apart). ``bytes_up`` counts what the passive parties (hosts, FTL's target)
sent, ``bytes_down`` what the active side (guest, coordinator, FTL's source, the dealer) sent.
"""

from __future__ import annotations

import inspect
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
from pydantic import BaseModel

from fedloom.engine.shell import (
    ConfigRunner,
    RunInputs,
    RunResult,
    RunShell,
    Timing,
    base_summary,
    resume_state,
    shell_payload,
)
from fedloom.errors import ConfigError
from fedloom.vertical.config import (
    FTLConfig,
    SecureBoostConfig,
    VerticalLinearConfig,
    VerticalLogisticConfig,
    VerticalRunConfig,
    parse_vertical_config,
)
from fedloom.vertical.data import VerticalData, load_sklearn, load_vertical, transfer_split
from fedloom.vertical.messages import Channel

DEFAULT_FTL_ROWS = ([0, 400], [200, 569])
DEFAULT_FTL_LABELLED = [200, 300]
PASSIVE = ("host:", "target")
T = TypeVar("T")


def binary_metrics(scores: np.ndarray, y: np.ndarray, prob: np.ndarray) -> dict[str, float]:
    """Accuracy (score > 0), ROC AUC and log loss of probabilities ``prob`` for 0/1 labels."""
    from sklearn.metrics import log_loss, roc_auc_score

    y01 = (np.asarray(y) > 0).astype(int)
    p = np.clip(prob, 1e-15, 1 - 1e-15)
    return {
        "accuracy": float(np.mean((scores > 0) == (y01 == 1))),
        "auc": float(roc_auc_score(y01, scores)),
        "loss": float(log_loss(y01, p, labels=[0, 1])),
    }


def multiclass_metrics(prob: np.ndarray, y: np.ndarray) -> dict[str, float]:
    """Accuracy (arg max), macro one-vs-rest ROC AUC and log loss of class probabilities."""
    from sklearn.metrics import log_loss, roc_auc_score

    labels = np.arange(prob.shape[1])
    yi = np.asarray(y).astype(np.int64)
    p = np.clip(prob, 1e-15, 1.0)
    p = p / p.sum(axis=1, keepdims=True)
    present = np.unique(yi)
    auc = (
        roc_auc_score(yi, p, multi_class="ovr", labels=labels)
        if len(present) == len(labels)
        else float("nan")
    )
    return {
        "accuracy": float(np.mean(np.argmax(prob, axis=1) == yi)),
        "auc": float(auc),
        "loss": float(log_loss(yi, p, labels=labels)),
    }


def regression_metrics(pred: np.ndarray, y: np.ndarray, scale: tuple[float, float] | None):
    """RMSE and MSE in the target's own units (``scale``: the standardisation undone)."""
    if scale is not None:
        pred, y = pred * scale[1] + scale[0], y * scale[1] + scale[0]
    mse = float(np.mean((pred - y) ** 2))
    return {"rmse": math.sqrt(mse), "loss": mse}


class _Recorder:
    """After an iteration (or tree): a metrics row when evaluation is due, and the model's
    checkpoint when one is due (engine/shell.py)."""

    def __init__(self, shell: RunShell) -> None:
        self.shell = shell
        self.eval_seconds = 0.0

    def __call__(self, t: int, model: Any, train_loss: float, evaluate) -> None:
        done, shell, channel = t + 1, self.shell, model.channel_
        row = None
        if shell.evaluates(done):
            started = time.perf_counter()
            crypto_before = channel.crypto_seconds
            metrics = evaluate()
            self.eval_seconds += time.perf_counter() - started
            channel.crypto_seconds = crypto_before  # evaluation is not training time
            row = {
                "round": done,
                "train_loss": train_loss,
                "global": metrics,
                **traffic(channel),
                "wall_seconds": shell.elapsed - self.eval_seconds,
            }
        shell.end_round(done, row, lambda: shell_payload(shell, done, self.state(model)))

    def state(self, model: Any) -> dict[str, Any]:
        """A checkpoint's state: the model's and the evaluation seconds so far."""
        return {"model": model.state_dict(), "eval_seconds": self.eval_seconds}


def traffic(channel: Channel) -> dict[str, Any]:
    """Cumulative training traffic and time split (see the module docstring)."""
    by_party = channel.bytes_by_party()
    up = sum(v["sent"] for k, v in by_party.items() if k.startswith(PASSIVE))
    down = sum(v["sent"] for k, v in by_party.items() if not k.startswith(PASSIVE))
    return {
        "communication": {"bytes_up": up, "bytes_down": down},
        "vertical": {"bytes_by_party": by_party, "seconds_encryption": channel.crypto_seconds},
    }


class VerticalFamily:
    """Vertical and transfer FL in ``fedloom.run``'s registry (api.py): a vertical config,
    and optionally the caller's :class:`~fedloom.vertical.data.VerticalData` (not for ftl)."""

    def check_inputs(self, inputs: RunInputs) -> None:
        inputs.refuse(("model", "executor", "callbacks"), "a vertical run", "docs/vertical.md")

    def parse(self, config: Any, inputs: RunInputs) -> VerticalRunConfig:
        return parse_vertical_config(config)

    def parse_saved(self, path: Path) -> VerticalRunConfig:
        return parse_vertical_config(path)

    def timing(self, cfg: VerticalRunConfig) -> Timing:
        algo = cfg.algorithm
        rounds = algo.n_trees if isinstance(algo, SecureBoostConfig) else algo.iterations
        return Timing(rounds, cfg.eval.every, cfg.checkpoint)

    def runner(self, cfg: VerticalRunConfig, inputs: RunInputs) -> VerticalRunner:
        return VerticalRunner(cfg, inputs.data)


class VerticalRunner(ConfigRunner):
    """The iterations (trees) of one vertical run, on ``data`` or the configured dataset."""

    cfg: VerticalRunConfig

    def __init__(self, cfg: VerticalRunConfig, data: VerticalData | None) -> None:
        super().__init__(cfg)
        self.data = data

    def run(self, shell: RunShell) -> RunResult:
        cfg, algo = self.cfg, self.cfg.algorithm
        recorder = _Recorder(shell)
        saved = resume_state(shell)
        if saved is not None:
            recorder.eval_seconds = float(saved["eval_seconds"])
        shell.begin()
        if isinstance(algo, FTLConfig):
            model, extra = _run_ftl(cfg, algo, recorder, saved and saved["model"])
        else:
            data = self.data if self.data is not None else _configured_data(cfg)
            model, extra = _run_vertical(cfg, algo, data, recorder, saved and saved["model"])
        summary = _summary(cfg, shell, model, recorder.eval_seconds, extra)
        return RunResult(summary, shell.history, None, {}, shell.run_dir, extras={"model": model})


def _configured_data(cfg: VerticalRunConfig) -> VerticalData:
    return load_vertical(
        cfg.data.name,
        cfg.data.partition.parties,
        cfg.data.test_fraction,
        cfg.seed,
        cfg.data.standardize_target,
        cfg.data.missing_fraction,
    )


def _summary(
    cfg: VerticalRunConfig, shell: RunShell, model: Any, eval_seconds: float, extra: dict
) -> dict[str, Any]:
    """summary.json: the common keys (engine/shell.py) and the ``vertical`` block."""
    algo, channel = cfg.algorithm, model.channel_
    last = shell.history[-1]
    rounds = shell.rounds
    crypto = last["vertical"]["seconds_encryption"]
    train_wall = last["wall_seconds"]
    summary = base_summary(
        algorithm=algo.name,
        dataset=cfg.data.name,
        num_clients=len(cfg.data.partition.parties),
        rounds=rounds,
        seed=cfg.seed,
        executor="in_process",
        final={"global": last["global"], "personalized": None},
        communication=last["communication"],
        wall_seconds=shell.elapsed,
        seconds_per_round=train_wall / rounds,
    )
    summary["vertical"] = {
        "kind": cfg.secure_aggregation.kind,
        "protocol": getattr(algo, "protocol", None),
        "key_bits": cfg.secure_aggregation.key_bits
        if cfg.secure_aggregation.kind == "paillier"
        else None,
        "train_loss": last["train_loss"],
        "bytes_by_party": last["vertical"]["bytes_by_party"],
        "prediction_bytes_by_party": channel.bytes_by_party(prediction=True),
        "seconds_encryption": crypto,
        "seconds_other": max(0.0, train_wall - crypto),
        "seconds_evaluation": eval_seconds,
        **extra,
    }
    return summary


def _run_vertical(
    cfg: VerticalRunConfig,
    algo: Any,
    data: VerticalData,
    recorder: _Recorder,
    saved: dict[str, Any] | None,
) -> tuple[Any, dict[str, Any]]:
    from fedloom.vertical import SecureBoost, VerticalLinear, VerticalLogistic

    binary = data.task == "binary"
    if isinstance(algo, SecureBoostConfig):
        model: Any = _estimator(SecureBoost, algo, cfg, **_boosting_task(algo, data))
    else:
        cls = VerticalLogistic if isinstance(algo, VerticalLogisticConfig) else VerticalLinear
        assert isinstance(algo, VerticalLinearConfig)
        model = _estimator(cls, algo, cfg)

    def evaluate() -> dict[str, float]:
        if isinstance(model, SecureBoost):
            margin = model.predict_margin(data.test_parts).astype(np.float64)
            if model.objective.is_multiclass:
                return multiclass_metrics(model.objective.transform(margin), data.y_test)
            if binary:
                return binary_metrics(margin, data.y_test, model.objective.transform(margin))
            return regression_metrics(margin, data.y_test, data.y_scale)
        scores = model.decision_function(data.test_parts)
        if binary:
            return binary_metrics(scores, data.y_test, 1 / (1 + np.exp(-scores)))
        return regression_metrics(scores, data.y_test, data.y_scale)

    def callback(t: int, m: Any) -> None:
        if isinstance(m, SecureBoost):
            loss = m.objective.loss(m.train_margin_, data.y_train)
        else:
            loss = m.loss_history_[-1]
        recorder(t, m, loss, evaluate)

    model.fit(data.train_parts, data.y_train, callback=callback, resume=saved)
    extra = {"task": data.task}
    if isinstance(model, SecureBoost):
        extra["leaves_per_tree"] = [t.n_leaves for t in model.trees_]
    return model, extra


def _estimator(
    cls: Callable[..., T], algo: BaseModel, cfg: VerticalRunConfig, **settings: Any
) -> T:
    """``cls`` built from the fields of the algorithm and secure-aggregation sections that its
    constructor takes (same names), ``encrypt`` (Paillier), the run's seed, and ``settings``
    over them."""
    accepted = inspect.signature(cls).parameters
    sec = cfg.secure_aggregation
    kwargs = {k: v for section in (algo, sec) for k, v in section if k in accepted}
    kwargs.update(encrypt=sec.kind == "paillier", seed=cfg.seed)
    kwargs.update(settings)
    return cls(**kwargs)


def _boosting_task(algo: SecureBoostConfig, data: VerticalData) -> dict[str, Any]:
    """SecureBoost's objective and num_class: the configured ones, else from the task."""
    default = {"binary": "binary:logistic", "regression": "reg:squarederror"}
    objective = algo.objective or default.get(data.task, "multi:softprob")
    if objective != "multi:softprob":
        return {"objective": objective, "num_class": None}
    if data.task == "regression":
        raise ConfigError("algorithm.objective multi:softprob needs class labels, not a regression")
    found = int(np.max(data.y_train)) + 1
    num_class = algo.num_class or found
    if num_class < found:
        raise ConfigError(f"algorithm.num_class = {num_class}, but the labels go up to {found - 1}")
    return {"objective": objective, "num_class": num_class}


def _run_ftl(
    cfg: VerticalRunConfig, algo: FTLConfig, recorder: _Recorder, saved: dict[str, Any] | None
) -> tuple[Any, dict[str, Any]]:
    from fedloom.vertical import FederatedTransfer

    part = cfg.data.partition
    rows = part.rows or DEFAULT_FTL_ROWS
    labelled = part.labelled_rows or DEFAULT_FTL_LABELLED
    x, y = load_sklearn(cfg.data.name)
    td = transfer_split(
        x,
        y,
        part.parties,
        rows[0],
        rows[1],
        labelled,
        cfg.seed,
        scale_on=cfg.data.scale_on,
    )
    protocol = "secret_sharing" if cfg.secure_aggregation.kind == "secret_sharing" else "ahe"
    model = _estimator(FederatedTransfer, algo, cfg, protocol=protocol)

    def evaluate() -> dict[str, float]:
        scores = model.decision_function(td.x_test)
        return binary_metrics(scores, td.y_test, 1 / (1 + np.exp(-scores)))

    model.fit(
        td.x_a,
        td.y_a,
        td.x_b,
        (td.overlap_a, td.overlap_b),
        td.labelled,
        callback=lambda t, m: recorder(t, m, m.loss_history_[-1], evaluate),
        resume=saved,
    )
    extra = {"task": "binary", "overlap": len(td.overlap_a), "labelled": len(td.labelled)}
    return model, extra

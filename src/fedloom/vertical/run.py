"""A vertical or transfer run from its config: data, estimator, metrics per iteration (or
tree), and a normal run directory (DESIGN.md 3.5: ``config.yaml``, ``metrics.jsonl``,
``summary.json``; the API adds ``report.html``).

Each metrics row: ``round`` (iterations or trees done), ``train_loss`` (the protocol's loss;
SecureBoost: the training log loss or squared error), ``global`` (test accuracy, AUC and log
loss, or RMSE and MSE in the target's own units), cumulative ``communication`` and a
``vertical`` block: training bytes sent and received per party, and the seconds spent in
cryptography vs the rest. Training traffic excludes the prediction used for evaluation (its
bytes are reported apart). ``bytes_up`` counts what the passive parties (hosts, FTL's target)
sent, ``bytes_down`` what the active side (guest, coordinator, FTL's source, the dealer) sent.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import numpy as np

from fedloom.engine.loop import RunResult
from fedloom.engine.rundir import RunDir, default_run_dir
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


def regression_metrics(pred: np.ndarray, y: np.ndarray, scale: tuple[float, float] | None):
    """RMSE and MSE in the target's own units (``scale``: the standardisation undone)."""
    if scale is not None:
        pred, y = pred * scale[1] + scale[0], y * scale[1] + scale[0]
    mse = float(np.mean((pred - y) ** 2))
    return {"rmse": math.sqrt(mse), "loss": mse}


class _Recorder:
    """Builds a metrics row after an iteration (or tree) and appends it to the run directory."""

    def __init__(self, cfg: VerticalRunConfig, run_dir: RunDir | None, total: int) -> None:
        self.cfg, self.run_dir, self.total = cfg, run_dir, total
        self.history: list[dict[str, Any]] = []
        self.start = time.perf_counter()
        self.eval_seconds = 0.0

    def __call__(self, t: int, channel: Channel, train_loss: float, evaluate) -> None:
        done = t + 1
        if done % self.cfg.eval.every and done != self.total:
            return
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
            "wall_seconds": time.perf_counter() - self.start - self.eval_seconds,
        }
        self.history.append(row)
        if self.run_dir is not None:
            self.run_dir.append_metrics(row)


def traffic(channel: Channel) -> dict[str, Any]:
    """Cumulative training traffic and time split (see the module docstring)."""
    by_party = channel.bytes_by_party()
    up = sum(v["sent"] for k, v in by_party.items() if k.startswith(PASSIVE))
    down = sum(v["sent"] for k, v in by_party.items() if not k.startswith(PASSIVE))
    return {
        "communication": {"bytes_up": up, "bytes_down": down},
        "vertical": {"bytes_by_party": by_party, "seconds_encryption": channel.crypto_seconds},
    }


def run_vertical(
    config: Any, *, out: str | Path | None = None, write: bool = True, data: Any = None
) -> RunResult:
    """Run a vertical config (mapping, path or :class:`VerticalRunConfig`). ``data``: a
    :class:`~fedloom.vertical.data.VerticalData` of the user's own arrays instead of the
    configured dataset (not for ftl)."""
    cfg = parse_vertical_config(config)
    algo = cfg.algorithm
    run_dir = None
    if write:
        run_dir = RunDir.create(out or default_run_dir(algo.name, cfg.data.name))
        run_dir.write_config(cfg.to_yaml())
    start = time.perf_counter()
    if isinstance(algo, FTLConfig):
        model, recorder, extra = _run_ftl(cfg, algo, run_dir)
    else:
        if data is None:
            data = load_vertical(
                cfg.data.name,
                cfg.data.partition.parties,
                cfg.data.test_fraction,
                cfg.seed,
                cfg.data.standardize_target,
            )
        model, recorder, extra = _run_vertical(cfg, algo, data, run_dir)
    wall = time.perf_counter() - start
    channel: Channel = model.channel_
    last = recorder.history[-1]
    rounds = algo.n_trees if isinstance(algo, SecureBoostConfig) else algo.iterations
    crypto = last["vertical"]["seconds_encryption"]
    train_wall = last["wall_seconds"]
    summary = {
        "algorithm": algo.name,
        "dataset": cfg.data.name,
        "num_clients": len(cfg.data.partition.parties),
        "rounds": rounds,
        "seed": cfg.seed,
        "executor": "in_process",
        "final": {"global": last["global"], "personalized": None},
        "communication": last["communication"],
        "wall_seconds": wall,
        "seconds_per_round": train_wall / rounds,
        "vertical": {
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
            "seconds_evaluation": recorder.eval_seconds,
            **extra,
        },
    }
    if run_dir is not None:
        run_dir.write_json("summary.json", summary)
    return RunResult(summary, recorder.history, None, {}, run_dir, extras={"model": model})


def _run_vertical(
    cfg: VerticalRunConfig, algo: Any, data: VerticalData, run_dir: RunDir | None
) -> tuple[Any, _Recorder, dict[str, Any]]:
    from fedloom.vertical import SecureBoost, VerticalLinear, VerticalLogistic

    sec = cfg.secure_aggregation
    encrypt = sec.kind == "paillier"
    binary = data.task == "binary"
    if isinstance(algo, SecureBoostConfig):
        model: Any = SecureBoost(
            algo.n_trees,
            algo.max_depth,
            algo.eta,
            algo.max_bin,
            algo.reg_lambda,
            algo.gamma,
            algo.min_child_weight,
            algo.base_score,
            objective="binary:logistic" if binary else "reg:squarederror",
            encrypt=encrypt,
            key_bits=sec.key_bits,
            packing=algo.packing,
            seed=cfg.seed,
        )
        total = algo.n_trees
    else:
        cls = VerticalLogistic if isinstance(algo, VerticalLogisticConfig) else VerticalLinear
        assert isinstance(algo, VerticalLinearConfig)
        model = cls(
            algo.lr,
            algo.reg_lambda,
            algo.iterations,
            batch_size=algo.batch_size,
            protocol=algo.protocol,
            encrypt=encrypt,
            key_bits=sec.key_bits,
            frac_bits=sec.frac_bits,
            fit_intercept=algo.fit_intercept,
            seed=cfg.seed,
        )
        total = algo.iterations
    recorder = _Recorder(cfg, run_dir, total)

    def evaluate() -> dict[str, float]:
        if isinstance(model, SecureBoost):
            margin = model.predict_margin(data.test_parts).astype(np.float64)
            if binary:
                return binary_metrics(margin, data.y_test, model.objective.transform(margin))
            return regression_metrics(margin, data.y_test, data.y_scale)
        scores = model.decision_function(data.test_parts)
        if binary:
            return binary_metrics(scores, data.y_test, 1 / (1 + np.exp(-scores)))
        return regression_metrics(scores, data.y_test, data.y_scale)

    def callback(t: int, m: Any) -> None:
        if isinstance(m, SecureBoost):
            loss = _train_loss(m.train_margin_, data.y_train, binary)
        else:
            loss = m.loss_history_[-1]
        recorder(t, m.channel_, loss, evaluate)

    model.fit(data.train_parts, data.y_train, callback=callback)
    extra = {"task": data.task}
    if isinstance(model, SecureBoost):
        extra["leaves_per_tree"] = [t.n_leaves for t in model.trees_]
    return model, recorder, extra


def _train_loss(margin: np.ndarray, y: np.ndarray, binary: bool) -> float:
    m = margin.astype(np.float64)
    if binary:
        return float(np.mean(np.logaddexp(0.0, m) - y * m))
    return float(0.5 * np.mean((m - y) ** 2))


def _run_ftl(
    cfg: VerticalRunConfig, algo: FTLConfig, run_dir: RunDir | None
) -> tuple[Any, _Recorder, dict[str, Any]]:
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
    sec = cfg.secure_aggregation
    model = FederatedTransfer(
        algo.hidden,
        algo.gamma,
        algo.reg_lambda,
        algo.lr,
        algo.iterations,
        protocol="secret_sharing" if sec.kind == "secret_sharing" else "ahe",
        encrypt=sec.kind == "paillier",
        key_bits=sec.key_bits,
        frac_bits=sec.frac_bits,
        leaky_fast=algo.leaky_fast,
        seed=cfg.seed,
    )
    recorder = _Recorder(cfg, run_dir, algo.iterations)

    def evaluate() -> dict[str, float]:
        scores = model.decision_function(td.x_test)
        return binary_metrics(scores, td.y_test, 1 / (1 + np.exp(-scores)))

    model.fit(
        td.x_a,
        td.y_a,
        td.x_b,
        (td.overlap_a, td.overlap_b),
        td.labelled,
        callback=lambda t, m: recorder(t, m.channel_, m.loss_history_[-1], evaluate),
    )
    extra = {"task": "binary", "overlap": len(td.overlap_a), "labelled": len(td.labelled)}
    return model, recorder, extra

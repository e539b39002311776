"""The quadratic federated problem with a known best learning rate: FedAvg with every client
each round and one full-batch local step is gradient descent on the pooled least-squares loss
(Hessian H = 2/N X^T X), so the model after R rounds, and its validation loss, follow in closed
form for every lr. Used by the tune tests and benchmarks/tune.py."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from fedloom.config import parse_config
from fedloom.core.functional import FunctionalModel
from fedloom.data import load_dataset
from fedloom.data.validation import hold_out_validation
from fedloom.models import build_model


def quadratic_config(rounds: int = 12, **train: Any) -> dict[str, Any]:
    """Ten least-squares clients, FedAvg as full-batch gradient descent, 20% validation."""
    return {
        "seed": 0,
        "data": {
            "name": "quadratic",
            "num_clients": 10,
            "quadratic": {"dim": 5, "samples": 60, "heterogeneity": 0.0, "noise": 0.01},
        },
        "model": {"name": "logreg"},
        "algorithm": {"name": "fedavg"},
        "train": {"rounds": rounds, "local_steps": 1, "batch_size": None, "lr": 0.1, **train},
        "eval": {"every": 1, "validation_fraction": 0.2},
        "checkpoint": {"every": None},
        "monitor": {"enabled": False},
        "executor": {"kind": "sequential"},
    }


def _augmented(x: torch.Tensor) -> np.ndarray:
    x = x.double().numpy()
    return np.hstack([x, np.ones((len(x), 1))])


def validation_loss(raw: dict[str, Any], lrs: np.ndarray) -> np.ndarray:
    """The validation loss (MSE on the pooled validation sets) after ``train.rounds`` rounds,
    for each learning rate in ``lrs`` (inf where it overflows)."""
    cfg = parse_config(raw)
    data = load_dataset(cfg.data, cfg.seed)
    train, val = hold_out_validation(data, cfg.eval.validation_fraction, cfg.seed)
    x = np.vstack([_augmented(c.x_train) for c in train.clients])
    y = np.concatenate([c.y_train.double().numpy() for c in train.clients])
    xv = np.vstack([_augmented(v.x_test) for v in val])
    yv = np.concatenate([v.y_test.double().numpy() for v in val])
    module = build_model("logreg", data.input_shape, data.num_outputs)
    params, _ = FunctionalModel(module, data.task).initial_state(cfg.seed)
    w0 = torch.cat([params["linear.weight"].reshape(-1), params["linear.bias"].reshape(-1)])
    w = np.tile(w0.double().numpy(), (len(lrs), 1))
    with np.errstate(over="ignore", invalid="ignore"):
        for _ in range(cfg.train.rounds):
            grad = 2.0 / len(y) * (w @ x.T - y) @ x
            w = w - lrs[:, None] * grad
        loss = ((w @ xv.T - yv) ** 2).mean(axis=1)
    return np.where(np.isfinite(loss), loss, np.inf)


def best_lr(raw: dict[str, Any], low: float = 1e-3, high: float = 1.0, points: int = 2001) -> float:
    """The learning rate with the lowest validation loss after R rounds (log grid)."""
    lrs = np.geomspace(low, high, points)
    return float(lrs[int(np.argmin(validation_loss(raw, lrs)))])

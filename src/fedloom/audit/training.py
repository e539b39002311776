"""The training routine of the audit's own models (shadow models, the defence study's personal
and distilled models): minibatch SGD by the engine's local solver (solvers/local.py), with the
engine's epoch plans, from the stream the caller names."""

from __future__ import annotations

import torch

from fedloom.core.functional import FunctionalModel, GradCorrection
from fedloom.core.pytree import Tree
from fedloom.solvers.local import batch_plan, local_sgd, steps_per_epoch

Model = tuple[Tree, Tree]


def train_sgd(
    model: FunctionalModel,
    start: Model,
    x: torch.Tensor,
    y: torch.Tensor,
    epochs: int,
    lr: float,
    batch_size: int | None,
    gen: torch.Generator,
    correction: GradCorrection | None = None,
) -> Model:
    """``epochs`` passes of SGD on (x, y) from ``start``; ``y`` may be class indices or soft
    labels (rows of probabilities: cross-entropy against them, for distillation);
    ``correction`` adds a term to every step's gradient (a proximal pull)."""
    steps = epochs * steps_per_epoch(int(x.shape[0]), batch_size)
    plan = batch_plan(int(x.shape[0]), batch_size, steps, gen)
    solved = local_sgd(model, start[0], start[1], x, y, plan, lr, correction=correction)
    return solved.params, solved.buffers


def accuracy(model: FunctionalModel, trained: Model, x: torch.Tensor, y: torch.Tensor) -> float:
    """Fraction of (x, y) the model classifies correctly."""
    _, correct, n = model.evaluate(trained[0], trained[1], x, y)
    return correct / n if n else float("nan")

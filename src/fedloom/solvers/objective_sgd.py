"""Local SGD on a custom minibatch objective, optionally on a subset of the parameters.

The shared solver (:func:`fedloom.solvers.local.local_sgd`) minimizes the plain loss plus a
parameter-space correction; the cold-start adaptation of a new client and FedPer's fine-tuning
of a subset of the parameters run here, on the same lean flat-buffer trainer, one client at a
time::

    for each minibatch B of the plan:
        out, h = model(x_B), head input on x_B
        loss   = objective(Batch(step, x_B, y_B, out, h))      # default: the model's loss
        w[k]  <- w[k] - lr * d loss / d w[k]    for k in ``trainable`` (default: all)

Training objectives of that kind (FedNTD, FedLC, FedGen, FedProto) are client programs instead,
which both backends run: algorithms/objective.py.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection
from dataclasses import dataclass

import torch
from torch import nn

from fedloom.core.functional import FunctionalModel, head_input
from fedloom.core.lean import LeanModule, backward
from fedloom.core.pytree import Tree
from fedloom.errors import ConfigError
from fedloom.solvers.local import LocalSolution, minibatches


@dataclass
class Batch:
    """One local step's minibatch, as the objective sees it."""

    step: int
    x: torch.Tensor
    y: torch.Tensor
    out: torch.Tensor
    """The model's output (logits for classification)."""
    features: torch.Tensor | None
    """The head's input h(x) (the representation), when the solver was given ``head``."""
    lean: LeanModule
    """The trainer's module (e.g. to apply the head to other features: FedGen)."""


BatchObjective = Callable[[Batch], torch.Tensor]
StepCallback = Callable[[int, LeanModule], None]
"""Called after each step with the number of steps done and the trainer (for snapshots)."""


def single_head(model: FunctionalModel, algorithm: str) -> str:
    """The name of the model's head module, which must be one ``nn.Linear`` (the final
    classifier whose input is the representation); a clear error otherwise."""
    module = model.module
    heads = tuple(getattr(module, "head_modules", ()))
    head = module.get_submodule(heads[0]) if len(heads) == 1 else None
    if not isinstance(head, nn.Linear):
        raise ConfigError(
            f"algorithm.name: {algorithm} needs a model whose head (FedModel.head_modules) is "
            f"one nn.Linear layer, and {type(module).__name__}'s is {heads}; use e.g. "
            "model.name: mlp or cnn"
        )
    return heads[0]


def objective_sgd(
    model: FunctionalModel,
    params: Tree,
    buffers: Tree,
    x: torch.Tensor,
    y: torch.Tensor,
    plan: list[torch.Tensor],
    lr: float,
    objective: BatchObjective | None = None,
    trainable: Collection[str] | None = None,
    head: str | None = None,
    on_step: StepCallback | None = None,
) -> LocalSolution:
    """SGD steps along ``plan`` on ``objective`` (default: the model's loss), updating only the
    ``trainable`` parameters (default: all). ``head`` names the module whose input is exposed
    as ``Batch.features``. The inputs are not modified; buffers (BatchNorm statistics) evolve
    in training mode as in :func:`local_sgd`."""
    lean = model.lean()
    lean.load(params, buffers)
    flat, flat_grad = lean.flat, lean.flat_grad
    grads = lean.grad_view()
    frozen = [] if trainable is None else [k for k in lean.keys if k not in set(trainable)]
    hooked = head_input(lean.module.get_submodule(head)) if head else contextlib.nullcontext({})
    total = 0.0
    with hooked as store:
        for step, (xb, yb) in enumerate(minibatches(x, y, plan)):
            flat_grad.zero_()
            with torch.enable_grad():
                out = lean.module(xb)
                if objective is None:
                    loss = model.loss_from_output(out, yb)
                else:
                    loss = objective(Batch(step, xb, yb, out, store.get("h"), lean))
                backward(loss)
            with torch.no_grad():
                for k in frozen:
                    grads[k].zero_()
                flat.sub_(flat_grad, alpha=lr)
            total += float(loss.detach())
            if on_step is not None:
                on_step(step + 1, lean)
    return LocalSolution(
        lean.params(), lean.buffers_copy(), total / max(1, len(plan)), params, lr, len(plan)
    )

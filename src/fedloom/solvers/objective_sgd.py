"""Local SGD on a custom minibatch objective, optionally on a subset of the parameters: the
one fast trainer (:func:`fedloom.solvers.local.local_sgd`) under the name the cold-start
adaptation of a new client and FedPer's fine-tuning of a subset of the parameters use, one
client at a time::

    for each minibatch B of the plan:
        out, h = model(x_B), head input on x_B
        loss   = objective(LeanBatch(step, x_B, y_B, out, h))  # default: the model's loss
        w[k]  <- w[k] - lr * d loss / d w[k]    for k in ``trainable`` (default: all)

Training objectives of that kind (FedNTD, FedLC, FedGen, FedProto) are client programs instead,
which both backends run: algorithms/objective.py.
"""

from __future__ import annotations

from torch import nn

from fedloom.core.functional import FunctionalModel
from fedloom.errors import ConfigError
from fedloom.solvers.local import BatchObjective, LeanBatch, StepCallback, local_sgd

__all__ = ["BatchObjective", "LeanBatch", "StepCallback", "objective_sgd", "single_head"]


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


objective_sgd = local_sgd
"""SGD on a minibatch objective, on a subset of the parameters: the one loop,
:func:`fedloom.solvers.local.local_sgd` (``objective``, ``trainable``, ``head``, ``on_step``)."""

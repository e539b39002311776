"""Confidence routing between a client's personal model and the global model (docs/serving.md,
"The router": at inference, route each input by confidence, the personal model when it is
confident, the global model as the fallback when it is not).

The rule, per input x, with p(x) and g(x) the two models' softmax outputs:

    personal   if max p(x) >= threshold            (the personal model is confident)
    personal   if max p(x) >= max g(x)             (not confident, but not less than the global)
    global     otherwise                           (the global model is more confident)

So the global model answers only where the personal model is unsure *and* the global model is
surer; with threshold 0 every input goes to the personal model, with threshold 1 each input goes
to the more confident of the two (max-confidence ensembling). Ties go to the personal model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fedloom.core.functional import FunctionalModel
from fedloom.core.pytree import Tree


@dataclass
class Routed:
    """Predictions of one routed batch and where each came from."""

    prediction: torch.Tensor
    personal: torch.Tensor
    """True where the personal model answered."""


def route(personal_logits: torch.Tensor, global_logits: torch.Tensor, threshold: float) -> Routed:
    """The module's rule on a batch of logits (N, classes) of each model."""
    p = personal_logits.softmax(-1)
    g = global_logits.softmax(-1)
    p_conf, p_label = p.max(-1)
    g_conf, g_label = g.max(-1)
    personal = (p_conf >= threshold) | (p_conf >= g_conf)
    return Routed(torch.where(personal, p_label, g_label), personal)


def split(model: FunctionalModel, tree: Tree) -> tuple[Tree, Tree]:
    """A merged state dict as the functional model's (params, buffers)."""
    keys = set(model.param_keys)
    return (
        {k: v for k, v in tree.items() if k in keys},
        {k: v for k, v in tree.items() if k not in keys},
    )


@torch.no_grad()
def logits(model: FunctionalModel, tree: Tree, x: torch.Tensor, batch_size: int) -> torch.Tensor:
    """The model's outputs on ``x`` in evaluation mode, ``batch_size`` inputs at a time."""
    params, buffers = split(model, tree)
    model.module.eval()
    try:
        parts = [
            model.forward(params, buffers, x[i : i + batch_size])
            for i in range(0, x.shape[0], batch_size)
        ]
    finally:
        model.module.train()
    return torch.cat(parts) if parts else torch.empty(0)


@dataclass
class ClientRouting:
    """One client's test set under its personal, the global and the routed model."""

    n: int
    personal_correct: int
    global_correct: int
    routed_correct: int
    to_personal: int

    def as_dict(self) -> dict[str, float | int]:
        n = max(self.n, 1)
        return {
            "n": self.n,
            "personal": self.personal_correct / n,
            "global": self.global_correct / n,
            "routed": self.routed_correct / n,
            "personal_share": self.to_personal / n,
        }


def route_client(
    model: FunctionalModel,
    personal: Tree,
    global_: Tree,
    x: torch.Tensor,
    y: torch.Tensor,
    threshold: float,
    batch_size: int = 1024,
) -> ClientRouting:
    """Correct predictions of each model and of the router on (x, y)."""
    p = logits(model, personal, x, batch_size)
    g = logits(model, global_, x, batch_size)
    routed = route(p, g, threshold)
    return ClientRouting(
        n=int(y.shape[0]),
        personal_correct=int((p.argmax(-1) == y).sum()),
        global_correct=int((g.argmax(-1) == y).sum()),
        routed_correct=int((routed.prediction == y).sum()),
        to_personal=int(routed.personal.sum()),
    )

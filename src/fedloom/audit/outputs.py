"""What an attacker sees of a model: its outputs on the queried samples, as logits (the model
as deployed) or as released probability vectors (after an output defence), and the scores
attacks read from them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F

from fedloom.core.functional import FunctionalModel
from fedloom.core.pytree import Tree

FLOOR = 1e-12


@torch.no_grad()
def model_logits(
    model: FunctionalModel, params: Tree, buffers: Tree, x: torch.Tensor, batch_size: int = 1024
) -> torch.Tensor:
    """The model's outputs on ``x`` in evaluation mode (float64, for exact small losses)."""
    model.module.eval()
    try:
        parts = [
            model.forward(params, buffers, x[i : i + batch_size]).to(torch.float64)
            for i in range(0, int(x.shape[0]), batch_size)
        ]
    finally:
        model.module.train()
    return torch.cat(parts)


@dataclass(frozen=True)
class Outputs:
    """A model's answers to queries: ``logits``, or released ``probabilities`` (possibly noisy,
    so not necessarily in [0, 1])."""

    values: torch.Tensor
    kind: Literal["logits", "probabilities"] = "logits"

    def true_class_score(self, y: torch.Tensor) -> torch.Tensor:
        """Confidence in the true label, higher for members: -loss(x, y) = log p_y from logits
        (Yeom et al. 2018, the loss-threshold attack), the released p_y otherwise (a noisy p_y
        has no logarithm; the order is what matters)."""
        if self.kind == "logits":
            return -F.cross_entropy(self.values, y, reduction="none")
        return self.values.gather(1, y.view(-1, 1)).squeeze(1)

    def loss(self, y: torch.Tensor) -> torch.Tensor:
        """Cross-entropy of the answers (probabilities floored at 1e-12)."""
        if self.kind == "logits":
            return F.cross_entropy(self.values, y, reduction="none")
        p = self.values.gather(1, y.view(-1, 1)).squeeze(1)
        return -torch.log(p.clamp_min(FLOOR))

    def predictions(self) -> torch.Tensor:
        return self.values.argmax(1)

    def probabilities(self) -> torch.Tensor:
        return self.values.softmax(1) if self.kind == "logits" else self.values

    def sorted_features(self) -> np.ndarray:
        """The answer vector sorted in decreasing order (class-independent), as log
        probabilities where they exist (Shokri et al. 2017's attack input; Salem et al. 2019
        sort it): the log keeps the differences between confidences near 1 that the raw
        probabilities round away."""
        feats = self.values.log_softmax(1) if self.kind == "logits" else self.values
        return feats.sort(dim=1, descending=True).values.numpy()

"""Missing-feature-aware aggregation (``aggregator.kind: feature_aware``;
docs/missing_features.md): the server keeps the feature mask matrix M (M_kj = 1 when client k
observed input feature j) and averages the first layer's weight column j only over the clients that
observed feature j:

    W^(j) = sum_k w_k M_kj W_k^(j) / sum_k w_k M_kj,

with w_k the weight the algorithm gives client k (n_k for FedAvg; with equal weights it is the
plain mean over the observing clients). A client that never sees feature j gets no gradient for
column j and uploads the column it was sent; the plain mean would pull the column back towards that
stale value every round. Every other parameter, and a column that no client of the round observed,
gets the plain weighted mean. The masks are read from the clients' training data (data/missing.py,
``observed``).

The engine's aggregation slot gets trees and weights, not client ids: ``begin`` records the
round's clients in the order of their results, which is the order in which the FedAvg-family
algorithms hand their uploads to ``ctx.aggregate``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from fedloom.core.mechanism import Aggregator, Mechanism, ServerStep, UpdateSum
from fedloom.core.pytree import weighted_average
from fedloom.errors import ConfigError

Tree = dict[str, torch.Tensor]


def first_layer_key(module: torch.nn.Module, input_shape: tuple[int, ...]) -> str:
    """The name of the model's first parameter when it is a linear layer's weight on the
    flattened input (out, prod(input_shape)); ConfigError otherwise."""
    d = math.prod(input_shape)
    for name, param in module.named_parameters():
        if param.dim() == 2 and param.shape[1] == d:
            return name
        break
    raise ConfigError(
        "aggregator.kind: feature_aware needs a model whose first layer is linear in the "
        f"flattened input ({d} features): e.g. model.name logreg or mlp"
    )


class FeatureAwareAggregation(Mechanism):
    """One run's missing-feature-aware mean (core/mechanism.py): ``begin`` with the round's
    clients (``before_aggregate``), then ``aggregate`` in place of the mean (the algorithm's
    ``ctx.aggregate``)."""

    key = "robust"
    section = "aggregator"

    def __init__(self, key: str, masks: torch.Tensor) -> None:
        self.weight_key = key
        """The first layer's weight: its columns are the input features."""
        self.masks = masks
        """(clients, features) bool: M."""
        self.clients: list[int] = []

    def start_round(self, round: int, message: Mapping[str, Any]) -> None:
        self.clients = []

    def begin(self, clients: Sequence[int]) -> None:
        self.clients = list(clients)

    def before_aggregate(self, step: ServerStep) -> None:
        self.begin([r.client_id for r in step.results])

    def wrap_aggregate(self, inner: Aggregator, update_sum: UpdateSum | None) -> Aggregator:
        return self.aggregate

    def aggregate(self, trees: Sequence[Tree], weights: Sequence[float]) -> Tree:
        out = weighted_average(trees, weights)
        if self.weight_key not in trees[0] or not self.clients:
            return out
        if len(trees) != len(self.clients):
            raise ValueError(
                f"feature_aware: {len(trees)} trees for the round's {len(self.clients)} clients"
            )
        key = self.weight_key
        out[key] = self.columns([t[key] for t in trees], weights, out[key])
        return out

    def columns(
        self, weights_k: Sequence[torch.Tensor], w: Sequence[float], plain: torch.Tensor
    ) -> torch.Tensor:
        """Column j: sum_k w_k M_kj W_k[:, j] / sum_k w_k M_kj; ``plain`` where the
        denominator is 0."""
        m = torch.stack([self._mask(c) for c in self.clients]).to(torch.float64)
        mw = m * torch.tensor(list(w), dtype=torch.float64)[:, None]  # (K, d)
        stacked = torch.stack([t.to(torch.float64) for t in weights_k])  # (K, out, d)
        total = mw.sum(dim=0)  # (d,)
        num = torch.einsum("kd,kod->od", mw, stacked)
        seen = total > 0
        mean = torch.where(seen, num / total.clamp(min=1e-300), plain.to(torch.float64))
        return mean.to(plain.dtype)

    def _mask(self, client: int) -> torch.Tensor:
        if 0 <= client < self.masks.shape[0]:
            return self.masks[client]
        return torch.ones(self.masks.shape[1], dtype=torch.bool)  # a pooled view: everything

    def summary(self) -> dict[str, Any]:
        m = self.masks
        return {
            "kind": "feature_aware",
            "layer": self.weight_key,
            "features": int(m.shape[1]),
            "observed_share_mean": float(m.float().mean()),
            "unobserved_by_all": int((~m.any(dim=0)).sum()),
        }

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, saved: Mapping[str, Any]) -> None:
        pass

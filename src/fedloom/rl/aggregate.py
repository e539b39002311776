"""The server step of QAvg and PAvg on stacked agent parameters (docs/rl.md): every E
local updates, theta <- aggregate(theta_1..theta_K), broadcast to every agent.

The rule is fedloom's: FedAvg's weighted mean (``fedloom.core.pytree.weighted_average``, the
weights being the agents' environment counts), or a Byzantine-robust rule of
``fedloom.robust`` (``aggregator.kind``) applied to the agents' updates against the last
broadcast. FedProx's proximal term is a local-update matter (``algorithm.mu``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from fedloom.config import AggregatorConfig
from fedloom.core.pytree import Tree, weighted_average
from fedloom.errors import RoundAborted
from fedloom.robust import rules
from fedloom.robust.aggregation import RobustAggregation


def unstack(stacked: Tree, keys: Sequence[str]) -> list[Tree]:
    """Agent k's tree (views into the stacked tensors) for every k."""
    agents = stacked[keys[0]].shape[0]
    return [{k: stacked[k][i] for k in keys} for i in range(agents)]


def broadcast(global_tree: Tree, stacked: Tree) -> None:
    """Write the global tree into every agent's slice (in place)."""
    with torch.no_grad():
        for k, v in global_tree.items():
            stacked[k].copy_(v.unsqueeze(0).expand_as(stacked[k]))


class PolicyAggregator:
    """Aggregates the averaged keys of the K agents' stacked trees into the global tree."""

    def __init__(
        self,
        config: AggregatorConfig,
        seed: int,
        weights: Sequence[float],
        per_round: int | None = None,
    ) -> None:
        """``per_round``: agents aggregated each round (train.clients_per_round; None: all)."""
        self.config = config
        self.weights = list(weights)
        f = config.f if config.f is not None else 1
        n = per_round or len(weights)  # the same number of agents takes part every round,
        if config.kind in ("krum", "multi_krum"):  # so check the rule's precondition
            rules.check_krum(n, f, config.kind)  # once, here (ConfigError), not every round
        elif config.kind == "bulyan":
            rules.check_bulyan(n, f)
        self.robust = RobustAggregation(config, seed, f) if config.kind != "mean" else None

    def __call__(
        self,
        stacked: Tree,
        keys: Sequence[str],
        previous: Tree,
        round: int,
        agents: Sequence[int] | None = None,
    ) -> Tree:
        """The new global tree from the ``agents`` (all when None); the previous one when a
        robust rule's precondition fails."""
        trees = unstack(stacked, keys)
        picked = range(len(trees)) if agents is None else agents
        trees, weights = [trees[i] for i in picked], [self.weights[i] for i in picked]
        if self.robust is None:
            return weighted_average(trees, weights)
        self.robust.start_round(round, {"params": previous})
        try:
            return self.robust.aggregate(trees, weights)
        except RoundAborted:
            return {k: v.clone() for k, v in previous.items()}

    def summary(self) -> dict[str, Any]:
        if self.robust is None:
            return {"kind": "mean"}
        return self.robust.summary()

    def state_dict(self) -> dict[str, Any]:
        return self.robust.state_dict() if self.robust is not None else {}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        if self.robust is not None:
            self.robust.load_state_dict(saved)

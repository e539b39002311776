"""The server step of QAvg and PAvg on stacked agent parameters (docs/rl.md): every E
local updates, theta <- aggregate(theta_1..theta_K), broadcast to every agent.

The step goes through the mechanism protocol (core/mechanism.py), its mechanisms built by the
engine's one builder in its declared order (engine/mechanism_builders.py), as a horizontal
round's server step does: each
sampled agent's shared tensors are its upload, encoded and decoded by upload compression
(``compression.kind``), clipped by client-level DP (``privacy.kind: client_dp``, DP-FedAvg on
the policy update, McMahan et al., ICLR 2018), and aggregated by FedAvg's weighted mean (the
weights being the agents' environment counts), a Byzantine-robust rule of ``fedloom.robust``
(``aggregator.kind``) on the updates against the last broadcast, or DP's noised estimator.
FedProx's proximal term is a local-update matter (``algorithm.mu``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from fedloom.core.mechanism import BuildFacts, MechanismChain, ServerStep
from fedloom.core.protocol import ClientResult
from fedloom.core.pytree import Tree, weighted_average
from fedloom.engine.mechanism_builders import build_mechanisms
from fedloom.errors import RoundAborted
from fedloom.privacy import ClientLevelDP
from fedloom.rl.config import RLRunConfig


def unstack(stacked: Tree, keys: Sequence[str]) -> list[Tree]:
    """Agent k's tree (views into the stacked tensors) for every k."""
    agents = stacked[keys[0]].shape[0]
    return [{k: stacked[k][i] for k in keys} for i in range(agents)]


def broadcast(global_tree: Tree, stacked: Tree) -> None:
    """Write the global tree into every agent's slice (in place)."""
    with torch.no_grad():
        for k, v in global_tree.items():
            stacked[k].copy_(v.unsqueeze(0).expand_as(stacked[k]))


def build_chain(cfg: RLRunConfig, agents: int) -> MechanismChain:
    """The run's server-side mechanisms in ``ORDER``, from the engine's builder (the config's
    rules, rl/rules.py, leave only combinations that compose)."""
    facts = BuildFacts(
        seed=cfg.seed,
        train_ids=tuple(range(agents)),
        clients_per_round=cfg.train.clients_per_round,
        rounds=cfg.train.rounds,
        byzantine_f=cfg.byzantine_f,
    )
    return MechanismChain(list(build_mechanisms(cfg, facts).built.values()))


class PolicyAggregator:
    """Aggregates the averaged keys of the K agents' stacked trees into the global tree,
    through the run's mechanisms (module docstring)."""

    def __init__(self, cfg: RLRunConfig, weights: Sequence[float]) -> None:
        self.weights = list(weights)
        self.mechanisms = build_chain(cfg, len(self.weights))
        self.rule = self.mechanisms.aggregator(weighted_average)

    def __call__(
        self,
        stacked: Tree,
        keys: Sequence[str],
        previous: Tree,
        round: int,
        agents: Sequence[int] | None = None,
    ) -> tuple[Tree, int]:
        """(the new global tree from the ``agents`` (all when None), the bytes they uploaded);
        the previous tree when a robust rule's precondition fails."""
        trees = unstack(stacked, keys)
        picked = list(range(len(trees))) if agents is None else list(agents)
        mechanisms = self.mechanisms
        message = mechanisms.start_round(round, {"params": previous})
        results = [
            ClientResult({"params": trees[i]}, self.weights[i], 0.0, client_id=i, round=round)
            for i in picked
        ]
        sent = sum(mechanisms.send(round, r) for r in results)
        for r in results:
            r.upload = mechanisms.on_upload(r.upload, r.client_id, round)
        mechanisms.before_aggregate(ServerStep(round, message, results, {}, message))
        try:
            new = self.rule([r.upload["params"] for r in results], [r.weight for r in results])
        except RoundAborted:
            new = {k: v.clone() for k, v in previous.items()}
        return new, sent

    def summary(self) -> dict[str, Any]:
        """summary.json's mechanism sections (``aggregator``, ``privacy``, ``compression``)."""
        return {"aggregator": {"kind": "mean"}, **self.mechanisms.summary()}

    def privacy_spent(self) -> dict[str, Any] | None:
        privacy = self.mechanisms.named("privacy")
        return privacy.privacy_spent() if isinstance(privacy, ClientLevelDP) else None

    def state_dict(self) -> dict[str, Any]:
        return self.mechanisms.state_dict()

    def load_state_dict(self, saved: Mapping[str, Any]) -> None:
        self.mechanisms.load_state_dict(dict(saved))

"""PAvg with PPO agents, its personalized variant and independent PPO agents (docs/rl.md):
K agents with their own CartPole physics run PPO (rl/ppo.py) as one stacked tensor program;
every E = ``train.local_steps`` PPO iterations the server aggregates the actors and critics
(PAvg, Jin et al., AISTATS 2022) through the run's mechanisms and broadcasts them. The
personalized variant concatenates a learned per-environment embedding to the state of actor
and critic; it is trained locally and never leaves the agent (unseen environments get the
mean embedding). Each agent keeps its own Adam moments, as in PAvg with REINFORCE and QAvg.
"""

from __future__ import annotations

from typing import Any

import torch

from fedloom.core.pytree import Tree
from fedloom.rl.config import PAvgPPOEmbeddingConfig, PPOKeys, RLRunConfig
from fedloom.rl.horizontal import PolicyLearners
from fedloom.rl.nets import Adam, init_orthogonal_mlp
from fedloom.rl.policy_gradient import EMBEDDING
from fedloom.rl.ppo import ACTOR, CRITIC, PPOTrainer


class PPOAgents(PolicyLearners):
    """``pavg_ppo``, ``pavg_ppo_embedding`` and ``local_ppo`` (module docstring)."""

    def __init__(self, cfg: RLRunConfig) -> None:
        super().__init__(cfg)
        algo = cfg.algorithm
        assert isinstance(algo, PPOKeys)
        self.algo = algo
        emb = algo.embedding_dim if isinstance(algo, PAvgPPOEmbeddingConfig) else 0
        d, hidden = self.env.obs_dim + emb, list(cfg.model.hidden)
        actions = self.env.num_actions

        def make(gen: torch.Generator) -> Tree:  # CleanRL's Agent: critic, then actor
            critic = init_orthogonal_mlp([d, *hidden, 1], gen, CRITIC, 1.0)
            return {**critic, **init_orthogonal_mlp([d, *hidden, actions], gen, ACTOR, 0.01)}

        self._params = self._init(make)
        if emb:
            self._params[EMBEDDING] = self._embedding(emb)
        self.opt = Adam(self._params, cfg.lr, eps=algo.adam_eps)
        shared = self.shared_keys()
        self.global_: Tree | None = (
            {k: self._params[k][0].clone() for k in shared} if cfg.averages else None
        )
        total = cfg.train.rounds * cfg.train.local_steps
        self.trainer = PPOTrainer(self.env, self.k, algo, cfg.seed, total, cfg.lr, cfg.activation)

    def shared_keys(self) -> list[str]:
        """Actor and critic; the personal embedding stays."""
        return [k for k in self._params if k != EMBEDDING]

    def train_round(self, round: int) -> dict[str, Any]:
        """E PPO iterations of every agent, then the server step."""
        mu = getattr(self.algo, "mu", 0.0)
        anchor = None
        if mu > 0 and self.global_ is not None:
            anchor = {k: v.expand_as(self._params[k]) for k, v in self.global_.items()}
        steps = self.cfg.train.local_steps
        for e in range(steps):
            self.trainer.iteration(round * steps + e, self._params, self.opt, anchor, mu)
        self.env_steps = self.trainer.env_steps
        if self.cfg.averages:
            self.server_step(round)
        return self.trainer.take_stats()

    def extra_state(self) -> dict[str, Any]:
        return {"trainer": self.trainer.state_dict()}

    def load_extra_state(self, saved: dict[str, Any]) -> None:
        self.trainer.load_state_dict(saved["trainer"])
        self.env_steps = self.trainer.env_steps

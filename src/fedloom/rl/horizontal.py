"""Horizontal FRL (Qi et al. 2021, arXiv 2108.11887; docs/rl.md): K agents, each with its own
environment physics, trained as one stacked tensor program; every E local updates the server
aggregates their policies (PAvg, personalized PAvg) or Q-networks (QAvg) and broadcasts the
result. ``local`` and ``local_dqn`` are the same agents without the server (the
single-agent baseline).

Communication per round: every agent uploads the averaged tensors and downloads the new global
ones (the personal embedding never leaves the agent).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from fedloom.core.pytree import Tree, num_bytes
from fedloom.core.rng import generator
from fedloom.engine.sampling import sample_clients
from fedloom.rl.aggregate import PolicyAggregator, broadcast
from fedloom.rl.config import PAvgEmbeddingConfig, RLRunConfig
from fedloom.rl.dqn import DQNTrainer, StackedQ
from fedloom.rl.envs import agent_variants, make_env
from fedloom.rl.evaluate import by_environment, greedy_returns
from fedloom.rl.nets import Adam, init_mlp
from fedloom.rl.policy_gradient import (
    EMBEDDING,
    policy_logits,
    reinforce_grads,
    rollout,
    with_mean_embedding,
)


class HorizontalAgents:
    """What both HFRL learners share: the agents' environments, the server step, traffic,
    evaluation groups and the deployed models."""

    prefix = "pi."

    def __init__(self, cfg: RLRunConfig) -> None:
        self.cfg = cfg
        self.k, self.n = cfg.data.num_clients, cfg.data.envs_per_client
        self.variants = agent_variants(cfg.data)
        self.env = make_env(cfg.data, self.variants, self.n)
        self.aggregator = PolicyAggregator(cfg, [float(self.n)] * self.k)
        self.bytes_up = self.bytes_down = 0
        self.env_steps = 0

    def _init(self, make: Callable[[torch.Generator], Tree]) -> Tree:
        """The K agents' stacked trees from ``make(gen)``, one agent's tree (leading axis 1):
        federated agents start from one broadcast initialisation; local ones from their own
        (stream (seed, "rl/init", client k))."""
        if self.cfg.averages:
            one = make(generator(self.cfg.seed, "rl/init"))
            return {k: v.expand(self.k, *v.shape[1:]).clone() for k, v in one.items()}
        trees = [make(generator(self.cfg.seed, "rl/init", client=c)) for c in range(self.k)]
        return {k: torch.cat([t[k] for t in trees]) for k in trees[0]}

    def _embedding(self, dim: int) -> torch.Tensor:
        """The personalized variant's embeddings [K, dim] (stream (seed, "rl/embedding"))."""
        return 0.1 * torch.randn(self.k, dim, generator=generator(self.cfg.seed, "rl/embedding"))

    @property
    def params(self) -> Tree:
        raise NotImplementedError

    def shared_keys(self) -> list[str]:
        return [k for k in self.params if k.startswith(self.prefix)]

    def sampled(self, round: int) -> list[int]:
        """The agents whose update round ``round`` aggregates: ``train.clients_per_round`` of
        them from the seeded stream horizontal runs sample with (engine/sampling.py)."""
        return sample_clients(
            self.cfg.seed, round, list(range(self.k)), self.cfg.train.clients_per_round
        )

    def server_step(self, round: int) -> None:
        """Aggregate the sampled agents' shared tensors through the run's mechanisms
        (rl/aggregate.py), broadcast the result, count the traffic (the sampled agents'
        uploads, as encoded with compression, and downloads). The batched environments step
        every agent; an agent left out of the round has its local work discarded by the
        broadcast, as a client that was not sampled never did it (docs/rl.md, Client
        sampling)."""
        keys, agents = self.shared_keys(), self.sampled(round)
        self.global_, sent = self.aggregator(self.params, keys, self.global_, round, agents)
        broadcast(self.global_, self.params)
        self.bytes_up += sent
        self.bytes_down += len(agents) * num_bytes(self.global_)

    def eval_groups(self) -> tuple[list[int], list[float]]:
        """(agent index, environment) per evaluation group: each agent in its own training
        environment; on an unseen one, the global policy (agent 0 after a broadcast) or, for
        local agents, every agent (averaged)."""
        _, unseen = self.cfg.data.variants
        agents, envs = list(range(self.k)), list(self.variants)
        for u in unseen:
            pick = self.unseen_agents()
            agents += pick
            envs += [u] * len(pick)
        return agents, envs

    def unseen_agents(self) -> list[int]:
        """Who plays an unseen environment: with embeddings a virtual agent K (the global
        network with the agents' mean embedding, :func:`with_mean_embedding`); else the
        global policy, or every local agent."""
        if EMBEDDING in self.params:
            return [self.k]
        return [0] if self.cfg.averages else list(range(self.k))

    def _evaluate_groups(self, logits_fn_for) -> dict[str, dict[str, float]]:
        """Greedy returns per environment; ``logits_fn_for(agent indices)`` gives the groups'
        logits function."""
        agents, envs = self.eval_groups()
        gen = generator(self.cfg.seed, "rl/eval")
        returns = greedy_returns(
            self.cfg.data, logits_fn_for(torch.tensor(agents)), envs, self.cfg.eval.episodes, gen
        )
        return by_environment(self.cfg.data, envs, returns)

    def server_state(self) -> dict[str, Any]:
        """The server's part of a checkpoint: the global model, the mechanisms' state and
        the bytes counted so far."""
        return {
            "global": self.global_,
            "aggregator": self.aggregator.state_dict(),
            "bytes": [self.bytes_up, self.bytes_down],
        }

    def load_server_state(self, saved: dict[str, Any]) -> None:
        self.global_ = saved["global"]
        self.aggregator.load_state_dict(saved["aggregator"])
        self.bytes_up, self.bytes_down = (int(b) for b in saved["bytes"])

    def deployed(self) -> tuple[Tree | None, dict[int, Tree]]:
        """(the global model or None, each agent's deployed model)."""
        clients = {c: {k: v[c].clone() for k, v in self.params.items()} for c in range(self.k)}
        glob = None if self.global_ is None else {k: v.clone() for k, v in self.global_.items()}
        return glob, clients


class PolicyLearners(HorizontalAgents):
    """Agents with stacked policies (``pi.*`` keys, and an embedding) and their own Adam:
    REINFORCE and PPO agents. Subclasses set ``_params`` and ``opt`` and say what else their
    checkpoint holds (:meth:`extra_state`)."""

    _params: Tree
    opt: Adam

    @property
    def params(self) -> Tree:
        return self._params

    def evaluate(self) -> dict[str, dict[str, float]]:
        """Greedy returns of the stacked policies (``pi.*`` keys, and an embedding)."""
        params = self._params
        if EMBEDDING in params:
            params = with_mean_embedding(params)
        act = self.cfg.activation

        def logits_for(idx: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
            picked = {k: v[idx] for k, v in params.items()}
            return lambda obs: policy_logits(picked, obs, act)

        return self._evaluate_groups(logits_for)

    def extra_state(self) -> dict[str, Any]:
        return {}

    def load_extra_state(self, saved: dict[str, Any]) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {
            "params": self._params,
            "opt": self.opt.state_dict(),
            **self.server_state(),
            **self.extra_state(),
        }

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        self._params = {k: v.clone() for k, v in saved["params"].items()}
        self.opt.load_state_dict(saved["opt"])
        self.load_server_state(saved)
        self.load_extra_state(saved)


class PolicyAgents(PolicyLearners):
    """PAvg, personalized PAvg and local REINFORCE agents (module docstring)."""

    def __init__(self, cfg: RLRunConfig) -> None:
        super().__init__(cfg)
        algo = cfg.algorithm
        emb = algo.embedding_dim if isinstance(algo, PAvgEmbeddingConfig) else 0
        sizes = [self.env.obs_dim + emb, *cfg.model.hidden, self.env.num_actions]
        self._params = self._init(lambda gen: init_mlp(sizes, 1, gen, self.prefix))
        if emb:
            self._params[EMBEDDING] = self._embedding(emb)
        self.opt = Adam(self._params, cfg.lr)
        self.global_: Tree | None = (
            {k: v[0].clone() for k, v in self._params.items() if k != EMBEDDING}
            if cfg.averages
            else None
        )

    def _logits(self, params: Tree):
        return lambda obs: policy_logits(params, obs, self.cfg.activation)

    def train_round(self, round: int) -> dict[str, Any]:
        """E REINFORCE iterations of every agent, then the server step."""
        cfg, algo = self.cfg, self.cfg.algorithm
        mu = getattr(algo, "mu", 0.0)
        for e in range(cfg.train.local_steps):
            it = round * cfg.train.local_steps + e
            ep = rollout(
                self.env,
                self._logits(self._params),
                self.k,
                generator(cfg.seed, "rl/rollout", round=it),
            )
            anchor = None
            if mu > 0 and self.global_ is not None:
                anchor = {k: v.expand_as(self._params[k]) for k, v in self.global_.items()}
            grads, loss = reinforce_grads(
                self._params, ep, algo.gamma, cfg.activation, anchor=anchor, mu=mu
            )
            self.opt.step(self._params, grads)
            self.env_steps += int(ep.live.sum())
        if cfg.averages:
            self.server_step(round)
        returns = ep.returns.mean(1)
        return {
            "train_return": float(returns.mean()),
            "train_loss": loss,
            "train_return_by_client": [_sig6(x) for x in returns.tolist()],
        }

    def extra_state(self) -> dict[str, Any]:
        return {"env_steps": self.env_steps}

    def load_extra_state(self, saved: dict[str, Any]) -> None:
        self.env_steps = int(saved["env_steps"])


class QAgents(HorizontalAgents):
    """QAvg and local DQN agents (module docstring)."""

    prefix = "q."

    def __init__(self, cfg: RLRunConfig) -> None:
        super().__init__(cfg)
        algo = cfg.algorithm
        sizes = [self.env.obs_dim, *cfg.model.hidden, self.env.num_actions]
        self.q = StackedQ(
            self.k,
            sizes,
            cfg.lr,
            algo.gamma,
            generator(cfg.seed, "rl/init"),
            cfg.activation,
            double=algo.double,
        )
        self.q.params = self._init(lambda gen: init_mlp(sizes, 1, gen, self.prefix))
        self.q.sync_target()
        self.q.mu = getattr(algo, "mu", 0.0)
        total = cfg.train.rounds * cfg.train.local_steps
        self.trainer = DQNTrainer(self.q, self.env, self.k, algo, cfg.seed, total)
        self.global_ = {k: v[0].clone() for k, v in self.q.params.items()} if cfg.averages else None

    @property
    def params(self) -> Tree:
        return self.q.params

    def train_round(self, round: int) -> dict[str, Any]:
        """E DQN iterations of every agent, then the server step; with ``global_target`` a
        target copy made during the round becomes the round's global Q-network."""
        cfg = self.cfg
        if self.q.mu > 0 and self.global_ is not None:
            self.q.anchor = {k: v.expand_as(self.q.params[k]) for k, v in self.global_.items()}
        algo, synced = cfg.algorithm, False
        for e in range(cfg.train.local_steps):
            it = round * cfg.train.local_steps + e
            self.trainer.iteration(it)
            synced |= (it + 1) % algo.target_every == 0
        self.env_steps = self.trainer.env_steps
        if cfg.averages:
            self.server_step(round)
            if synced and getattr(algo, "global_target", False):
                broadcast(self.global_, self.q.target)
        return self.trainer.take_stats()

    def evaluate(self) -> dict[str, dict[str, float]]:
        params = self.q.params
        return self._evaluate_groups(
            lambda idx: lambda obs: self.q.q(obs, {k: v[idx] for k, v in params.items()})
        )

    def state_dict(self) -> dict[str, Any]:
        return {
            "q": self.q.state_dict(),
            "trainer": self.trainer.state_dict(),
            **self.server_state(),
        }

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        self.q.load_state_dict(saved["q"])
        self.trainer.load_state_dict(saved["trainer"])
        self.env_steps = self.trainer.env_steps
        self.load_server_state(saved)


def _sig6(x: float) -> float:
    return float(f"{x:.6g}")

"""DQN (Mnih et al. 2015) for K agents at once, the local update of QAvg (docs/rl.md),
and the pieces the vertical federated DQN shares: a stacked replay buffer, the epsilon
schedule, epsilon-greedy acting and the TD target.

Per iteration every agent takes one epsilon-greedy step in each of its N environments
(auto-reset), stores the transitions, and takes ``grad_steps`` Adam steps on the TD loss

    l(theta) = (Q_theta(s, a) - (r + gamma (1 - terminated) max_a' Q_target(s', a')))^2,

with a target network copied every ``target_every`` iterations; with ``double`` (Double DQN,
van Hasselt, Guez and Silver, AAAI 2016, eq. (4)) the target is
r + gamma (1 - terminated) Q_target(s', argmax_a' Q_theta(s', a')): the online network selects,
the target network evaluates. ``terminated`` is the TD
``done`` flag; the 500-step truncation is not (Pardo et al., ICML 2018, "Time Limits in
Reinforcement Learning"): the next state still bootstraps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from fedloom.core.pytree import Tree
from fedloom.core.rng import generator
from fedloom.rl.nets import OnlineAndTarget, init_mlp, mlp
from fedloom.rl.stream import EnvStream
from fedloom.solvers.steps import proximal_gradient


@dataclass
class Batch:
    """Sampled transitions, tensors [K, B, ...]."""

    obs: torch.Tensor
    actions: torch.Tensor
    rewards: torch.Tensor
    next_obs: torch.Tensor
    terminated: torch.Tensor


class Replay:
    """K ring buffers of ``capacity`` transitions each, stored as stacked tensors; every agent
    adds N transitions per iteration, so all K share one write position."""

    def __init__(self, agents: int, capacity: int, obs_dim: int) -> None:
        self.capacity = capacity
        self.obs = torch.zeros(agents, capacity, obs_dim)
        self.next_obs = torch.zeros(agents, capacity, obs_dim)
        self.actions = torch.zeros(agents, capacity, dtype=torch.long)
        self.rewards = torch.zeros(agents, capacity)
        self.terminated = torch.zeros(agents, capacity)
        self.pos = 0
        self.size = 0

    def add(self, obs, actions, rewards, next_obs, terminated) -> None:
        """Add [K, N] transitions."""
        n = obs.shape[1]
        idx = (self.pos + torch.arange(n)) % self.capacity
        self.obs[:, idx] = obs
        self.next_obs[:, idx] = next_obs
        self.actions[:, idx] = actions
        self.rewards[:, idx] = rewards
        self.terminated[:, idx] = terminated.float()
        self.pos = (self.pos + n) % self.capacity
        self.size = min(self.size + n, self.capacity)

    def sample(self, batch: int, gen: torch.Generator) -> Batch:
        k = self.obs.shape[0]
        idx = torch.randint(0, self.size, (k, batch), generator=gen)

        def take(x: torch.Tensor) -> torch.Tensor:
            if x.dim() == 2:
                return x.gather(1, idx)
            return x.gather(1, idx[..., None].expand(-1, -1, x.shape[-1]))

        return Batch(
            take(self.obs),
            take(self.actions),
            take(self.rewards),
            take(self.next_obs),
            take(self.terminated),
        )

    def state_dict(self) -> dict[str, object]:
        return {
            "obs": self.obs,
            "next_obs": self.next_obs,
            "actions": self.actions,
            "rewards": self.rewards,
            "terminated": self.terminated,
            "pos": self.pos,
            "size": self.size,
        }

    def load_state_dict(self, saved: dict) -> None:
        for key in ("obs", "next_obs", "actions", "rewards", "terminated"):
            setattr(self, key, saved[key].clone())
        self.pos, self.size = int(saved["pos"]), int(saved["size"])


def epsilon(iteration: int, total: int, start: float, end: float, fraction: float) -> float:
    """Linear decay from ``start`` to ``end`` over the first ``fraction`` of the iterations."""
    span = max(1.0, fraction * total)
    return end + (start - end) * max(0.0, 1.0 - iteration / span)


def epsilon_greedy(q: torch.Tensor, eps: float, gen: torch.Generator) -> torch.Tensor:
    """argmax_a q, replaced by a uniform action with probability ``eps`` (q: [..., A])."""
    greedy = q.argmax(-1)
    random = torch.randint(0, q.shape[-1], greedy.shape, generator=gen)
    explore = torch.rand(greedy.shape, generator=gen) < eps
    return torch.where(explore, random, greedy)


def td_target(
    next_q_target: torch.Tensor,
    rewards: torch.Tensor,
    terminated: torch.Tensor,
    gamma: float,
    next_q_online: torch.Tensor | None = None,
) -> torch.Tensor:
    """r + gamma (1 - terminated) max_a' Q_target(s', a'); with ``next_q_online`` (Double
    DQN) r + gamma (1 - terminated) Q_target(s', argmax_a' Q_online(s', a'))."""
    if next_q_online is None:
        value = next_q_target.max(-1).values
    else:
        value = next_q_target.gather(-1, next_q_online.argmax(-1, keepdim=True)).squeeze(-1)
    return rewards + gamma * (1.0 - terminated) * value


def td_loss(q: torch.Tensor, actions: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The sum over agents of each agent's mean squared TD error (q: [K, B, A]; CleanRL's
    dqn.py; the Huber loss learned CartPole markedly slower here)."""
    chosen = q.gather(-1, actions[..., None]).squeeze(-1)
    return F.mse_loss(chosen, target, reduction="none").mean(-1).sum()


class StackedQ(OnlineAndTarget):
    """K Q-networks (``q.*`` keys), their target copies and one Adam: QAvg's agents, and the
    vertical DQN's baselines (one agent on a subset of the features)."""

    def __init__(
        self,
        agents: int,
        sizes: list[int],
        lr: float,
        gamma: float,
        gen: torch.Generator,
        activation: str = "relu",
        features: list[int] | None = None,
        double: bool = False,
    ) -> None:
        super().__init__(init_mlp(sizes, agents, gen, prefix="q."), lr)
        self.gamma, self.activation, self.features = gamma, activation, features
        self.double = double
        self.anchor: Tree | None = None
        """QAvg with FedProx: the last broadcast Q-network, stacked (set by the server)."""
        self.mu = 0.0

    def _x(self, obs: torch.Tensor) -> torch.Tensor:
        return obs if self.features is None else obs[..., self.features]

    def q(self, obs: torch.Tensor, params: Tree | None = None) -> torch.Tensor:
        """Q-values [K, ..., A] of ``obs`` [K, ..., d]."""
        return mlp(self.params if params is None else params, self._x(obs), self.activation, "q.")

    def act_q(self, obs: torch.Tensor, gen: torch.Generator | None = None) -> torch.Tensor:
        with torch.no_grad():
            return self.q(obs)

    def update(self, batch: Batch, gen: torch.Generator | None = None) -> float:
        """One Adam step on the TD loss (+ FedProx's proximal term towards ``anchor``)."""
        with torch.no_grad():
            online = self.q(batch.next_obs) if self.double else None
            target = td_target(
                self.q(batch.next_obs, self.target),
                batch.rewards,
                batch.terminated,
                self.gamma,
                online,
            )
        leaves = {k: v.detach().requires_grad_(True) for k, v in self.params.items()}
        loss = td_loss(self.q(batch.obs, leaves), batch.actions, target)
        grads = dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values())), strict=True))
        if self.anchor is not None:
            for k, v in (proximal_gradient(self.params, self.anchor, self.mu) or {}).items():
                grads[k] = grads[k] + v
        self.opt.step(self.params, grads)
        return float(loss.detach())


class QLearner(Protocol):
    """What :class:`DQNTrainer` needs of a Q-function: stacked agents, or the vertical split."""

    def act_q(self, obs: torch.Tensor, gen: torch.Generator) -> torch.Tensor: ...

    def update(self, batch: Batch, gen: torch.Generator) -> float: ...

    def sync_target(self) -> None: ...


class DQNTrainer:
    """The DQN loop of K agents in K x N auto-resetting environments (module docstring)."""

    def __init__(
        self, learner: QLearner, env: Any, agents: int, cfg: Any, seed: int, total: int
    ) -> None:
        self.learner, self.env, self.agents, self.cfg = learner, env, agents, cfg
        self.seed, self.total = seed, total
        self.replay = Replay(agents, cfg.buffer, env.obs_dim)
        self.stream = EnvStream(env, agents, seed, "rl/dqn_reset")
        self.losses: list[float] = []

    @property
    def env_steps(self) -> int:
        return self.stream.env_steps

    def iteration(self, it: int) -> None:
        """One environment step of every environment, then ``grad_steps`` TD steps."""
        cfg = self.cfg
        gen = generator(self.seed, "rl/dqn", round=it)
        eps = epsilon(it, self.total, cfg.epsilon_start, cfg.epsilon_end, cfg.explore_fraction)
        obs = self.stream.obs
        with torch.no_grad():
            action = epsilon_greedy(self.learner.act_q(obs, gen), eps, gen)
        nxt, reward, terminated, _ = self.stream.step(action, gen)
        self.replay.add(obs, action, reward, nxt, terminated)
        if self.replay.size >= min(cfg.learning_starts, cfg.buffer):
            for _ in range(cfg.grad_steps):
                self.losses.append(
                    self.learner.update(self.replay.sample(cfg.batch_size, gen), gen)
                )
        if (it + 1) % cfg.target_every == 0:
            self.learner.sync_target()

    def take_stats(self) -> dict[str, float | None]:
        """Mean return of the training episodes that ended and mean TD loss since the last
        call."""
        loss = sum(self.losses) / len(self.losses) if self.losses else None
        self.losses = []
        return {"train_return": self.stream.take_returns(), "train_loss": loss}

    def state_dict(self) -> dict[str, Any]:
        return {"replay": self.replay.state_dict(), **self.stream.state_dict()}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        self.replay.load_state_dict(saved["replay"])
        self.stream.load_state_dict(saved)

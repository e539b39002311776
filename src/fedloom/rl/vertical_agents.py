"""The vertical federated DQN run (docs/rl.md) and its baselines, driven by the
shared DQN loop: ``mode: vertical`` (:class:`~fedloom.rl.vertical_dqn.VerticalQ`),
``party_a`` (the Q-party alone on its own features) and ``centralized`` (one DQN on the full
state, the same depth and widths with a dense first layer). One environment stream of
``data.envs_per_client`` batched CartPoles, the training lengths cycled over them."""

from __future__ import annotations

from typing import Any

from fedloom.core.pytree import Tree
from fedloom.core.rng import generator
from fedloom.rl.config import RLRunConfig, VerticalDQNConfig
from fedloom.rl.dqn import DQNTrainer, StackedQ
from fedloom.rl.envs import make_env
from fedloom.rl.evaluate import by_environment, greedy_returns
from fedloom.rl.vertical_dqn import VerticalQ


class VerticalAgents:
    def __init__(self, cfg: RLRunConfig) -> None:
        algo = cfg.algorithm
        assert isinstance(algo, VerticalDQNConfig)
        self.cfg, self.algo = cfg, algo
        train, _ = cfg.data.variants
        n = cfg.data.envs_per_client
        self.env = make_env(cfg.data, [train[i % len(train)] for i in range(n)], 1)
        gen = generator(cfg.seed, "rl/init")
        hidden, actions = list(cfg.model.hidden), self.env.num_actions
        self.learner: VerticalQ | StackedQ
        if algo.mode == "vertical":
            self.learner = VerticalQ(
                algo.party_a,
                algo.party_b,
                algo.bottom,
                hidden,
                actions,
                cfg.lr,
                algo.gamma,
                gen,
                algo.noise_std,
            )
        elif algo.mode == "party_a":
            sizes = [len(algo.party_a), algo.bottom, *hidden, actions]
            self.learner = StackedQ(
                1, sizes, cfg.lr, algo.gamma, gen, cfg.activation, features=list(algo.party_a)
            )
        else:
            sizes = [self.env.obs_dim, 2 * algo.bottom, *hidden, actions]
            self.learner = StackedQ(1, sizes, cfg.lr, algo.gamma, gen, cfg.activation)
        total = cfg.train.rounds * cfg.train.local_steps
        self.trainer = DQNTrainer(self.learner, self.env, 1, algo, cfg.seed, total)
        self.env_steps = 0

    @property
    def bytes_up(self) -> int:
        return self.learner.wire.bytes_up if isinstance(self.learner, VerticalQ) else 0

    @property
    def bytes_down(self) -> int:
        return self.learner.wire.bytes_down if isinstance(self.learner, VerticalQ) else 0

    def train_round(self, round: int) -> dict[str, Any]:
        for e in range(self.cfg.train.local_steps):
            self.trainer.iteration(round * self.cfg.train.local_steps + e)
        self.env_steps = self.trainer.env_steps
        return self.trainer.take_stats()

    def evaluate(self) -> dict[str, dict[str, float]]:
        """Greedy returns per environment; the activations B sends while evaluating are not
        training traffic and are not counted."""
        train, unseen = self.cfg.data.variants
        envs = list(dict.fromkeys(train + unseen))
        saved = (self.bytes_up, self.bytes_down)
        returns = greedy_returns(
            self.cfg.data,
            lambda obs: self.learner.act_q(obs.reshape(1, -1, obs.shape[-1])).reshape(
                *obs.shape[:-1], -1
            ),
            envs,
            self.cfg.eval.episodes,
            generator(self.cfg.seed, "rl/eval"),
        )
        if isinstance(self.learner, VerticalQ):
            self.learner.wire.bytes_up, self.learner.wire.bytes_down = saved
        return by_environment(self.cfg.data, envs, returns)

    def deployed(self) -> tuple[Tree | None, dict[int, Tree]]:
        """No server model; the parties' networks (A: 0, B: 1) or the baseline's."""
        if isinstance(self.learner, VerticalQ):
            return None, {0: dict(self.learner.a.params), 1: dict(self.learner.b.params)}
        return None, {0: dict(self.learner.params)}

    def state_dict(self) -> dict[str, Any]:
        return {"learner": self.learner.state_dict(), "trainer": self.trainer.state_dict()}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        self.learner.load_state_dict(saved["learner"])
        self.trainer.load_state_dict(saved["trainer"])
        self.env_steps = self.trainer.env_steps

"""K agents' N auto-resetting environments stepped across iterations: what the learners that
continue their episodes from one iteration to the next (DQN, PPO) share.

The stream keeps the current observations, each environment's running return, the returns
of the episodes that ended since the last :meth:`EnvStream.take_returns`, and the
environment-step count; its state (environments included) goes into the run's checkpoints,
so a resumed run continues the same episodes.
"""

from __future__ import annotations

from typing import Any

import torch

from fedloom.core.rng import generator
from fedloom.rl.policy_gradient import VecEnv


class EnvStream:
    """``env``'s K x N environments (agent k's are ``k * N .. k * N + N - 1``), reset once from
    the stream (seed, ``purpose``)."""

    def __init__(self, env: VecEnv, agents: int, seed: int, purpose: str) -> None:
        self.env, self.agents = env, agents
        self.n = env.n // agents
        self.obs = env.reset(generator(seed, purpose)).reshape(agents, self.n, -1)
        self.episode_return = torch.zeros(agents, self.n)
        self.finished: list[float] = []
        self.env_steps = 0

    def step(
        self, action: torch.Tensor, gen: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Step every environment with ``action`` [K, N]; returns (the observation after the
        action, before any reset [K, N, d], reward, terminated, done = terminated or
        truncated, each [K, N]). Environments that ended are reset from ``gen``, and
        ``obs`` becomes the next observations."""
        nxt, reward, terminated, truncated = self.env.step(action.reshape(-1), gen)
        shape = (self.agents, self.n)
        reward, terminated = reward.reshape(shape), terminated.reshape(shape)
        done = terminated | truncated.reshape(shape)
        self.obs = self.env.obs.reshape(*shape, -1)
        self.env_steps += self.env.n
        self.episode_return += reward
        if bool(done.any()):
            self.finished += self.episode_return[done].tolist()
            self.episode_return = torch.where(done, 0.0, self.episode_return)
        return nxt.reshape(*shape, -1), reward, terminated, done

    def take_returns(self) -> float | None:
        """Mean return of the episodes that ended since the last call (None: none did)."""
        ret = sum(self.finished) / len(self.finished) if self.finished else None
        self.finished = []
        return ret

    def state_dict(self) -> dict[str, Any]:
        return {
            "env": self.env.state_dict(),  # type: ignore[attr-defined]
            "obs": self.obs,
            "episode_return": self.episode_return,
            "env_steps": self.env_steps,
        }

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        self.env.load_state_dict(saved["env"])  # type: ignore[attr-defined]
        self.obs = saved["obs"].clone()
        self.episode_return = saved["episode_return"].clone()
        self.env_steps = int(saved["env_steps"])

"""Any Gymnasium task with discrete actions through Gymnasium's vector API: the general path
beside the torch-batched CartPole (docs/rl.md). Shown with ``Acrobot-v1``, each
environment with its own ``LINK_MASS_2``.

The environments step one after another inside ``SyncVectorEnv`` (NumPy, per-environment
Python), so this path is slower than :mod:`fedloom.rl.cartpole` but takes any task whose
physics are attributes of ``env.unwrapped``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import gymnasium as gym
import numpy as np
import torch
from gymnasium.vector import AutoresetMode, SyncVectorEnv


def _maker(env_id: str, attributes: Mapping[str, float]) -> Callable[[], gym.Env]:
    def make() -> gym.Env:
        env = gym.make(env_id)
        for key, value in attributes.items():
            setattr(env.unwrapped, key, value)
        return env

    return make


class GymVector:
    """N Gymnasium environments (``attributes[i]`` set on the i-th's ``unwrapped``) with the
    learners' batch interface: ``reset(gen)``, ``step(action) -> (next_obs, reward,
    terminated, truncated)`` as tensors; an environment that ended is reset in the same step
    and ``next_obs`` holds its final observation."""

    def __init__(self, env_id: str, attributes: Sequence[Mapping[str, float]]) -> None:
        self.vec = SyncVectorEnv(
            [_maker(env_id, a) for a in attributes], autoreset_mode=AutoresetMode.SAME_STEP
        )
        self.n = len(attributes)
        self.obs_dim = int(np.prod(self.vec.single_observation_space.shape))
        self.num_actions = int(self.vec.single_action_space.n)
        self._obs = torch.zeros(self.n, self.obs_dim)

    def reset(self, gen: torch.Generator) -> torch.Tensor:
        seed = int(torch.randint(0, 2**31 - 1, (1,), generator=gen))
        obs, _ = self.vec.reset(seed=seed)
        self._obs = torch.as_tensor(obs, dtype=torch.float32)
        return self._obs

    @property
    def obs(self) -> torch.Tensor:
        return self._obs

    def step(
        self, action: torch.Tensor, gen: torch.Generator | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        obs, reward, terminated, truncated, info = self.vec.step(action.numpy())
        nxt = np.array(obs, dtype=np.float32)
        done = np.logical_or(terminated, truncated)
        if done.any():
            for i in np.flatnonzero(done):
                nxt[i] = info["final_obs"][i]
        self._obs = torch.as_tensor(obs, dtype=torch.float32)
        return (
            torch.as_tensor(nxt),
            torch.as_tensor(reward, dtype=torch.float32),
            torch.as_tensor(terminated),
            torch.as_tensor(truncated),
        )

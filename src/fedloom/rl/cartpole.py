"""A torch-batched CartPole with per-environment physics (docs/rl.md).

The step is Gymnasium 1.4's ``CartPole-v1`` (``cartpole.py``, Euler integration, Barto, Sutton
and Anderson 1983's equations as corrected by Florian 2007), written over tensors so that every
environment of every agent carries its own gravity, cart and pole masses and half pole length
and all of them advance in one call. :func:`cartpole_step` is a pure function of tensors (no
Python branching on values), so it can be vmapped; :class:`CartPoleBatch` adds episode
bookkeeping (step counters, the 500-step truncation, resets). The state is float64 as in
Gymnasium; observations handed to policies are float32, as Gymnasium returns them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

X_THRESHOLD = 2.4
THETA_THRESHOLD = 12 * 2 * math.pi / 360
MAX_STEPS = 500
"""CartPole-v1's TimeLimit (reward threshold 475)."""
RESET_BOUND = 0.05


@dataclass(frozen=True)
class CartPoleParams:
    """Per-environment physics, each a float64 tensor of shape [N] (Gymnasium's attribute
    names; ``length`` is half the pole's length). ``total_mass`` and ``polemass_length`` are
    derived here, as Gymnasium's ``step`` reads only the derived values."""

    length: torch.Tensor
    masspole: torch.Tensor
    masscart: torch.Tensor
    gravity: torch.Tensor
    force_mag: float = 10.0
    tau: float = 0.02

    @classmethod
    def make(
        cls,
        length: torch.Tensor | list[float],
        masspole: float | torch.Tensor = 0.1,
        masscart: float | torch.Tensor = 1.0,
        gravity: float | torch.Tensor = 9.8,
    ) -> CartPoleParams:
        """Broadcast scalars or lists to one float64 tensor per parameter."""
        length = torch.as_tensor(length, dtype=torch.float64).reshape(-1)
        n = length.shape[0]

        def full(v: float | torch.Tensor) -> torch.Tensor:
            return torch.as_tensor(v, dtype=torch.float64).reshape(-1).expand(n).clone()

        return cls(length, full(masspole), full(masscart), full(gravity))

    @property
    def total_mass(self) -> torch.Tensor:
        return self.masspole + self.masscart

    @property
    def polemass_length(self) -> torch.Tensor:
        return self.masspole * self.length


def cartpole_step(
    state: torch.Tensor, action: torch.Tensor, p: CartPoleParams
) -> tuple[torch.Tensor, torch.Tensor]:
    """One Euler step of N environments: ``state`` [N, 4] (x, x_dot, theta, theta_dot),
    ``action`` [N] in {0, 1}; returns (next state [N, 4], terminated [N] bool)."""
    x, x_dot, theta, theta_dot = state.unbind(-1)
    force = torch.where(action == 1, p.force_mag, -p.force_mag).to(state.dtype)
    costheta, sintheta = torch.cos(theta), torch.sin(theta)
    total_mass, polemass_length = p.total_mass, p.polemass_length
    temp = (force + polemass_length * theta_dot.square() * sintheta) / total_mass
    thetaacc = (p.gravity * sintheta - costheta * temp) / (
        p.length * (4.0 / 3.0 - p.masspole * costheta.square() / total_mass)
    )
    xacc = temp - polemass_length * thetaacc * costheta / total_mass
    nxt = torch.stack(
        (
            x + p.tau * x_dot,
            x_dot + p.tau * xacc,
            theta + p.tau * theta_dot,
            theta_dot + p.tau * thetaacc,
        ),
        dim=-1,
    )
    terminated = (nxt[..., 0].abs() > X_THRESHOLD) | (nxt[..., 2].abs() > THETA_THRESHOLD)
    return nxt, terminated


def reset_states(n: int, gen: torch.Generator) -> torch.Tensor:
    """Initial states uniform on [-0.05, 0.05]^4 (Gymnasium's reset), float64 [n, 4]."""
    u = torch.rand((n, 4), generator=gen, dtype=torch.float64)
    return (2 * u - 1) * RESET_BOUND


class CartPoleBatch:
    """N CartPoles with their own physics, stepped together, with auto-reset.

    ``step`` returns the observation after the action (before any reset), the reward (1 per
    step, Gymnasium's), ``terminated`` (pole fell or cart left) and ``truncated`` (500 steps);
    environments that ended are reset from ``gen`` and ``obs`` then holds their new start.
    """

    obs_dim = 4
    num_actions = 2

    def __init__(self, params: CartPoleParams, max_steps: int = MAX_STEPS) -> None:
        self.params = params
        self.n = params.length.shape[0]
        self.max_steps = max_steps
        self.state = torch.zeros(self.n, 4, dtype=torch.float64)
        self.steps = torch.zeros(self.n, dtype=torch.long)

    def reset(self, gen: torch.Generator) -> torch.Tensor:
        self.state = reset_states(self.n, gen)
        self.steps.zero_()
        return self.obs

    @property
    def obs(self) -> torch.Tensor:
        return self.state.float()

    def step(
        self, action: torch.Tensor, gen: torch.Generator | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        nxt, terminated = cartpole_step(self.state, action, self.params)
        self.steps += 1
        truncated = (self.steps >= self.max_steps) & ~terminated
        next_obs = nxt.float()
        done = terminated | truncated
        if gen is not None and bool(done.any()):
            fresh = reset_states(self.n, gen)
            nxt = torch.where(done[:, None], fresh, nxt)
            self.steps = torch.where(done, 0, self.steps)
        self.state = nxt
        return next_obs, torch.ones(self.n), terminated, truncated

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"state": self.state.clone(), "steps": self.steps.clone()}

    def load_state_dict(self, saved: dict[str, torch.Tensor]) -> None:
        self.state = saved["state"].clone()
        self.steps = saved["steps"].clone()

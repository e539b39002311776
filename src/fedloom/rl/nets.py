"""Stacked functional MLPs and Adam for many agents at once.

Parameters are trees (dicts of tensors) whose every tensor has a leading agent axis ``[K, ...]``;
:func:`mlp` runs all K networks as batched matrix products (``x`` is ``[K, ..., in]``), so K
agents x N environments are one tensor program with no Python loop over agents. Because Adam is
element-wise, one :class:`Adam` over the stacked tensors is K independent Adams, provided the
loss is the sum of the agents' own losses (then each agent's slice of the gradient is its own).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import torch

from fedloom.core.pytree import Tree

ACTIVATIONS = {"tanh": torch.tanh, "relu": torch.relu}


def init_mlp(sizes: Sequence[int], agents: int, gen: torch.Generator, prefix: str = "") -> Tree:
    """K independent initialisations of an MLP with layer sizes ``sizes`` (PyTorch's
    ``nn.Linear`` default: weights and biases uniform on +-1/sqrt(fan_in))."""
    params: Tree = {}
    for i, (fan_in, fan_out) in enumerate(itertools.pairwise(sizes)):
        bound = 1.0 / math.sqrt(fan_in)
        w = torch.rand((agents, fan_out, fan_in), generator=gen) * 2 - 1
        b = torch.rand((agents, fan_out), generator=gen) * 2 - 1
        params[f"{prefix}{i}.weight"] = w * bound
        params[f"{prefix}{i}.bias"] = b * bound
    return params


def init_orthogonal_mlp(
    sizes: Sequence[int], gen: torch.Generator, prefix: str, last_gain: float
) -> Tree:
    """One MLP (leading agent axis of 1) initialised as CleanRL's ``layer_init``: orthogonal
    weights (Saxe et al. 2014) with gain sqrt(2) on hidden layers and ``last_gain`` on the
    output layer, zero biases."""
    params: Tree = {}
    n = len(sizes) - 1
    for i, (fan_in, fan_out) in enumerate(itertools.pairwise(sizes)):
        gain = last_gain if i == n - 1 else math.sqrt(2.0)
        w = torch.nn.init.orthogonal_(torch.empty(fan_out, fan_in), gain, generator=gen)
        params[f"{prefix}{i}.weight"] = w.unsqueeze(0)
        params[f"{prefix}{i}.bias"] = torch.zeros(1, fan_out)
    return params


def layers(params: Tree, prefix: str = "") -> int:
    return sum(1 for k in params if k.startswith(prefix) and k.endswith(".weight"))


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``x`` [K, ..., in] times ``w`` [K, out, in] plus ``b`` [K, out]."""
    shape = x.shape
    flat = x.reshape(shape[0], -1, shape[-1])
    out = torch.baddbmm(b.unsqueeze(1), flat, w.transpose(1, 2))
    return out.reshape(*shape[:-1], w.shape[1])


def mlp(
    params: Tree, x: torch.Tensor, activation: str = "tanh", prefix: str = "", last: bool = True
) -> torch.Tensor:
    """The stacked MLP under ``prefix`` on ``x`` [K, ..., in]; the activation follows every
    layer but the last (and the last too when ``last`` is False: a bottom network)."""
    act = ACTIVATIONS[activation]
    n = layers(params, prefix)
    for i in range(n):
        x = linear(x, params[f"{prefix}{i}.weight"], params[f"{prefix}{i}.bias"])
        if i < n - 1 or not last:
            x = act(x)
    return x


class Adam:
    """Adam (Kingma and Ba 2015, Algorithm 1) over a tree, with its moments as explicit
    state (checkpointed with the run)."""

    def __init__(
        self, params: Tree, lr: float, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8
    ) -> None:
        self.lr, self.betas, self.eps = lr, betas, eps
        self.m = {k: torch.zeros_like(v) for k, v in params.items()}
        self.v = {k: torch.zeros_like(v) for k, v in params.items()}
        self.t = 0

    @torch.no_grad()
    def step(self, params: Tree, grads: Tree) -> None:
        """Update ``params`` in place with ``grads`` (keys absent from ``grads`` stay)."""
        self.t += 1
        b1, b2 = self.betas
        c1, c2 = 1 - b1**self.t, 1 - b2**self.t
        for k, g in grads.items():
            self.m[k].mul_(b1).add_(g, alpha=1 - b1)
            self.v[k].mul_(b2).addcmul_(g, g, value=1 - b2)
            denom = (self.v[k] / c2).sqrt_().add_(self.eps)
            params[k].addcdiv_(self.m[k], denom, value=-self.lr / c1)

    def state_dict(self) -> dict[str, object]:
        return {"m": dict(self.m), "v": dict(self.v), "t": self.t}

    def load_state_dict(self, saved: dict) -> None:
        self.m = {k: v.clone() for k, v in saved["m"].items()}
        self.v = {k: v.clone() for k, v in saved["v"].items()}
        self.t = int(saved["t"])


class OnlineAndTarget:
    """A Q-network's parameter tree, its target copy (DQN's fixed targets, Mnih et al. 2015)
    and its Adam: what a DQN learner and each party of the vertical DQN checkpoint."""

    def __init__(self, params: Tree, lr: float) -> None:
        self.params = params
        self.target = {k: v.clone() for k, v in params.items()}
        self.opt = Adam(params, lr)

    def sync_target(self) -> None:
        self.target = {k: v.clone() for k, v in self.params.items()}

    def state_dict(self) -> dict[str, object]:
        return {"params": self.params, "target": self.target, "opt": self.opt.state_dict()}

    def load_state_dict(self, saved: dict) -> None:
        self.params = {k: v.clone() for k, v in saved["params"].items()}
        self.target = {k: v.clone() for k, v in saved["target"].items()}
        self.opt.load_state_dict(saved["opt"])

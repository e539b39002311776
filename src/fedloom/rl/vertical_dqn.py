"""Vertical federated DQN (Zhuo et al. 2019, arXiv 1901.08277;
docs/rl.md).

One environment, its observation split by features. The Q-party A holds the reward, its own
features o_A, a bottom network f_A and the top Q-head; collaborator B holds o_B and a bottom
network f_B. Per batch:

1. B -> A: h_B = f_B(o_B) (+ N(0, sigma^2) noise, Zhuo's "Gaussian differentials"), [B, h];
2. A: Q(o) = top([f_A(o_A), h_B]); the TD loss with the target network; backward;
3. A -> B: dL/dh_B, [B, h]; B backpropagates it through f_B; each party takes its Adam step.

The target network is split the same way: B keeps a target f_B and sends its target activations
for the next states (forward only). Acting sends h_B for the current observations. Nothing else
crosses: A never sees o_B or f_B, B never sees the reward, o_A or the loss. The card's
baselines, Q-party alone and centralized DQN, are :class:`~fedloom.rl.dqn.StackedQ` on A's
features and on the full state.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from fedloom.core.pytree import Tree, num_bytes
from fedloom.rl.dqn import Batch, td_loss, td_target
from fedloom.rl.nets import OnlineAndTarget, init_mlp, mlp


@dataclass
class Wire:
    """The messages between the parties: bytes each way, and the shapes of the last batch's
    messages (for the exactness test)."""

    bytes_up: int = 0
    """B -> A: activations (online and target, training and acting)."""
    bytes_down: int = 0
    """A -> B: gradients of the loss with respect to B's activations."""
    shapes: deque[tuple[str, tuple[int, ...]]] = field(default_factory=lambda: deque(maxlen=8))
    """The last messages (direction, shape)."""

    def send(self, direction: str, tensor: torch.Tensor) -> torch.Tensor:
        size = num_bytes({"m": tensor})
        if direction == "up":
            self.bytes_up += size
        else:
            self.bytes_down += size
        self.shapes.append((direction, tuple(tensor.shape)))
        return tensor.detach().clone()


Party = OnlineAndTarget
"""One party's networks (a tree under its own key prefixes), target copy and Adam."""


class VerticalQ:
    """The split Q-network of a Q-party A and a collaborator B, trained by message passing."""

    def __init__(
        self,
        a_features: list[int],
        b_features: list[int],
        bottom: int,
        hidden: list[int],
        num_actions: int,
        lr: float,
        gamma: float,
        gen: torch.Generator,
        noise_std: float = 0.0,
    ) -> None:
        self.a_features, self.b_features = a_features, b_features
        a_params = init_mlp([len(a_features), bottom], 1, gen, prefix="bottom.")
        a_params |= init_mlp([2 * bottom, *hidden, num_actions], 1, gen, prefix="top.")
        self.a = Party(a_params, lr)
        self.b = Party(init_mlp([len(b_features), bottom], 1, gen, prefix="bottom."), lr)
        self.gamma, self.noise_std = gamma, noise_std
        self.wire = Wire()

    # -- B's side ------------------------------------------------------------------------
    def _b_activations(
        self, obs: torch.Tensor, params: Tree, gen: torch.Generator | None
    ) -> torch.Tensor:
        h = mlp(params, obs[..., self.b_features], "relu", "bottom.", last=False)
        if self.noise_std > 0 and gen is not None:
            noise = torch.randn(h.shape, generator=gen, dtype=h.dtype)
            h = h + self.noise_std * noise
        return h

    # -- A's side ------------------------------------------------------------------------
    def _a_q(self, obs: torch.Tensor, h_b: torch.Tensor, params: Tree) -> torch.Tensor:
        h_a = mlp(params, obs[..., self.a_features], "relu", "bottom.", last=False)
        return mlp(params, torch.cat((h_a, h_b), -1), "relu", "top.")

    @torch.no_grad()
    def act_q(self, obs: torch.Tensor, gen: torch.Generator | None = None) -> torch.Tensor:
        """Q-values [1, ..., A] for acting: B sends its activations of the current states."""
        h_b = self.wire.send("up", self._b_activations(obs, self.b.params, gen))
        return self._a_q(obs, h_b, self.a.params)

    def update(self, batch: Batch, gen: torch.Generator | None = None) -> float:
        """One training step of both parties on a batch: the protocol, then each party's
        Adam step on its own gradients."""
        loss, a_grads, b_grads = self.gradients(batch, gen)
        self.a.opt.step(self.a.params, a_grads)
        self.b.opt.step(self.b.params, b_grads)
        return float(loss)

    def gradients(
        self, batch: Batch, gen: torch.Generator | None = None
    ) -> tuple[torch.Tensor, Tree, Tree]:
        """(loss, A's gradients, B's gradients) of one batch by the protocol above."""
        with torch.no_grad():  # target: B sends target activations of the next states
            h_next = self.wire.send("up", self._b_activations(batch.next_obs, self.b.target, gen))
            q_next = self._a_q(batch.next_obs, h_next, self.a.target)
            target = td_target(q_next, batch.rewards, batch.terminated, self.gamma)
        b_leaves = {k: v.detach().requires_grad_(True) for k, v in self.b.params.items()}
        h_b = self._b_activations(batch.obs, b_leaves, gen)
        received = self.wire.send("up", h_b).requires_grad_(True)
        a_leaves = {k: v.detach().requires_grad_(True) for k, v in self.a.params.items()}
        loss = td_loss(self._a_q(batch.obs, received, a_leaves), batch.actions, target)
        a_grads = torch.autograd.grad(loss, [*a_leaves.values(), received])
        grad_h = self.wire.send("down", a_grads[-1])
        b_grads = torch.autograd.grad(h_b, list(b_leaves.values()), grad_outputs=grad_h)
        return (
            loss.detach(),
            dict(zip(a_leaves, a_grads[:-1], strict=True)),
            dict(zip(b_leaves, b_grads, strict=True)),
        )

    def sync_target(self) -> None:
        self.a.sync_target()
        self.b.sync_target()

    def centralized_params(self, target: bool = False) -> Tree:
        """The equivalent single network (``q.*`` keys, for :class:`StackedQ`): the bottom
        networks as one first layer with a block-diagonal weight, then A's top network."""
        a = self.a.target if target else self.a.params
        b = self.b.target if target else self.b.params
        wa, wb = a["bottom.0.weight"], b["bottom.0.weight"]
        h = wa.shape[1]
        d = len(self.a_features) + len(self.b_features)
        w = torch.zeros(1, 2 * h, d, dtype=wa.dtype)
        w[:, :h, self.a_features] = wa
        w[:, h:, self.b_features] = wb
        out = {"q.0.weight": w, "q.0.bias": torch.cat((a["bottom.0.bias"], b["bottom.0.bias"]), -1)}
        tops = sorted({k.split(".")[1] for k in a if k.startswith("top.")}, key=int)
        for i in tops:
            for part in ("weight", "bias"):
                out[f"q.{int(i) + 1}.{part}"] = a[f"top.{i}.{part}"].clone()
        return out

    def state_dict(self) -> dict[str, object]:
        return {
            "a": self.a.state_dict(),
            "b": self.b.state_dict(),
            "bytes_up": self.wire.bytes_up,
            "bytes_down": self.wire.bytes_down,
        }

    def load_state_dict(self, saved: dict) -> None:
        self.a.load_state_dict(saved["a"])
        self.b.load_state_dict(saved["b"])
        self.wire.bytes_up, self.wire.bytes_down = int(saved["bytes_up"]), int(saved["bytes_down"])

"""REINFORCE with normalized reward-to-go for K agents at once (Williams 1992; docs/rl.md
2.1), the local update of PAvg and of its personalized variant.

One iteration: every agent samples one episode in each of its environments with its own policy
(all K x N environments step together), then takes one Adam step on

    L_k(theta_k) = - sum_{t,i} log pi_k(a_t^i | s_t^i) G^_t^i / (number of live steps),

where G_t = sum_{t' >= t} gamma^{t'-t} r_t' is the reward-to-go and G^ is G standardised over
agent k's live steps. The agents' losses are summed, so each agent's gradient slice is its own.
With ``mu`` > 0 the gradient gets FedProx's proximal term mu (theta_k - theta_global).
The personalized variant (Jin et al. 2022, section 5) concatenates a learned per-environment
embedding e_k to the state: e_k is trained locally and never averaged.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from fedloom.core.pytree import Tree
from fedloom.rl.nets import mlp
from fedloom.solvers.steps import proximal_gradient

EMBEDDING = "embedding"


class VecEnv(Protocol):
    """What the learners need of a batch of environments (``CartPoleBatch``, ``GymVector``)."""

    n: int
    obs_dim: int
    num_actions: int

    def reset(self, gen: torch.Generator) -> torch.Tensor: ...

    def step(
        self, action: torch.Tensor, gen: torch.Generator | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]: ...


def embedded(params: Tree, obs: torch.Tensor) -> torch.Tensor:
    """``obs`` [K, ..., d], concatenated with agent k's ``embedding`` [K, e] when ``params``
    has one (the personalized variant, Jin et al. 2022, section 5)."""
    emb = params.get(EMBEDDING)
    if emb is None:
        return obs
    shape = (*obs.shape[:-1], emb.shape[-1])
    e = emb.reshape(emb.shape[0], *([1] * (obs.dim() - 2)), emb.shape[-1]).expand(shape)
    return torch.cat((obs, e.to(obs.dtype)), dim=-1)


def with_mean_embedding(params: Tree) -> Tree:
    """``params`` with a virtual agent K appended: agent 0's network (the global one after a
    broadcast) and the agents' mean embedding, which plays the unseen environments."""
    out = {k: torch.cat((v, v[:1])) for k, v in params.items()}
    out[EMBEDDING][-1] = params[EMBEDDING].mean(0)
    return out


def policy_logits(params: Tree, obs: torch.Tensor, activation: str = "tanh") -> torch.Tensor:
    """Action logits of K stacked policies on ``obs`` [K, ..., d] (:func:`embedded` first)."""
    return mlp(params, embedded(params, obs), activation, prefix="pi.")


@dataclass
class Episodes:
    """One batch of episodes: tensors [T, K, N] (obs [T, K, N, d]); ``live`` marks the steps
    taken before the episode ended."""

    obs: torch.Tensor
    actions: torch.Tensor
    rewards: torch.Tensor
    live: torch.Tensor

    @property
    def returns(self) -> torch.Tensor:
        """Undiscounted return of each episode, [K, N]."""
        return (self.rewards * self.live).sum(0)


@torch.no_grad()
def rollout(
    env: VecEnv,
    logits_fn: Callable[[torch.Tensor], torch.Tensor],
    agents: int,
    gen: torch.Generator,
    greedy: bool = False,
    max_steps: int = 500,
) -> Episodes:
    """One episode in each of ``env``'s K x N environments (environment ``k * N + i`` is agent
    k's i-th), actions sampled from (or, ``greedy``, the argmax of) ``logits_fn(obs)``, which
    maps observations [K, N, d] to action logits or Q-values [K, N, A]."""
    n = env.n // agents
    obs = env.reset(gen).reshape(agents, n, -1)
    alive = torch.ones(agents, n, dtype=torch.bool)
    steps: list[tuple[torch.Tensor, ...]] = []
    for _ in range(max_steps):
        logits = logits_fn(obs)
        if greedy:
            action = logits.argmax(-1)
        else:
            probs = torch.softmax(logits, -1).reshape(-1, logits.shape[-1])
            action = torch.multinomial(probs, 1, generator=gen).reshape(agents, n)
        nxt, reward, terminated, truncated = env.step(action.reshape(-1))
        steps.append((obs, action, reward.reshape(agents, n), alive))
        alive = alive & ~(terminated | truncated).reshape(agents, n)
        if not bool(alive.any()):
            break
        obs = torch.where(alive[..., None], nxt.reshape(agents, n, -1), 0.0)
    o, a, r, live = (torch.stack(x) for x in zip(*steps, strict=True))
    return Episodes(o, a, r, live.float())


def reward_to_go(rewards: torch.Tensor, live: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_t = sum_{t' >= t} gamma^{t'-t} r_t' over live steps, for tensors [T, ...]: one
    matrix product with the upper-triangular discount matrix."""
    t = rewards.shape[0]
    idx = torch.arange(t, dtype=torch.float64)
    power = idx[None, :] - idx[:, None]
    disc = torch.where(power >= 0, gamma**power, 0.0).to(rewards.dtype)
    flat = (rewards * live).reshape(t, -1)
    return (disc @ flat).reshape(rewards.shape)


def reinforce_loss(
    params: Tree, ep: Episodes, gamma: float, activation: str = "tanh"
) -> torch.Tensor:
    """The sum over agents of each agent's REINFORCE loss with its reward-to-go standardised
    over its own live steps."""
    g = reward_to_go(ep.rewards, ep.live, gamma)
    count = ep.live.sum((0, 2))  # [K]
    mean = (g * ep.live).sum((0, 2)) / count
    var = (((g - mean[None, :, None]) ** 2) * ep.live).sum((0, 2)) / count
    adv = (g - mean[None, :, None]) / (var.sqrt()[None, :, None] + 1e-8)
    obs = ep.obs.transpose(0, 1)  # [K, T, N, d]
    logp = torch.log_softmax(policy_logits(params, obs, activation), -1)
    chosen = logp.gather(-1, ep.actions.transpose(0, 1)[..., None]).squeeze(-1)
    per_agent = -(chosen * adv.transpose(0, 1) * ep.live.transpose(0, 1)).sum((1, 2)) / count
    return per_agent.sum()


def reinforce_grads(
    params: Tree,
    ep: Episodes,
    gamma: float,
    activation: str = "tanh",
    anchor: Tree | None = None,
    mu: float = 0.0,
) -> tuple[Tree, float]:
    """Gradients of :func:`reinforce_loss` (plus FedProx's proximal term towards ``anchor``,
    the last global policy broadcast to every agent, when ``mu`` > 0) and the loss value."""
    leaves = {k: v.detach().requires_grad_(True) for k, v in params.items()}
    loss = reinforce_loss(leaves, ep, gamma, activation)
    grads = dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values())), strict=True))
    if anchor is not None:
        prox = proximal_gradient({k: params[k] for k in anchor}, anchor, mu)
        for k, v in (prox or {}).items():
            grads[k] = grads[k] + v
    return grads, float(loss.detach())

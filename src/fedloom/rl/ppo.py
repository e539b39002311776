"""PPO (Schulman et al. 2017, "Proximal Policy Optimization Algorithms", arXiv 1707.06347) with
GAE (Schulman et al., ICLR 2016, arXiv 1506.02438) for K agents at once: the local update of
PAvg with PPO agents (docs/rl.md). Hyperparameters and implementation details follow CleanRL's
``ppo.py`` (Huang et al., JMLR 2022): separate actor and critic MLPs with orthogonal
initialisation, Adam with eps 1e-5 and a linearly annealed step size, advantages standardised
per minibatch, the clipped value loss, each agent's gradient clipped to a global norm.

One iteration: every agent steps each of its N environments ``num_steps`` times (episodes
continue across iterations, auto-reset), then takes ``update_epochs`` passes over its
num_steps x N transitions in ``num_minibatches`` shuffled minibatches, one Adam step on each:

    L_k = E[max(-A r_t, -A clip(r_t, 1 - c, 1 + c))] - ent_coef E[H(pi_k(.|s))]
          + vf_coef 0.5 E[max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2)],

with r_t = pi_k(a|s) / pi_old(a|s) (the clipped surrogate, Schulman et al. 2017, eq. (7)),
R = A + V_old and A from GAE. The K agents' losses are summed, so each agent's gradient slice
is its own, and one Adam over the stacked tensors is K Adams (rl/nets.py). Every tensor
carries the agent axis: no Python loop over agents.

Truncation (the 500-step limit) is not termination (Pardo et al., ICML 2018): a truncated
episode bootstraps from the value of its last state. With no truncation in a rollout, the
advantages are exactly CleanRL's (tests/rl/test_ppo.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from fedloom.core.pytree import Tree
from fedloom.core.rng import generator
from fedloom.rl.config import PPOKeys
from fedloom.rl.nets import Adam, mlp
from fedloom.rl.policy_gradient import VecEnv, embedded, policy_logits
from fedloom.rl.stream import EnvStream
from fedloom.solvers.steps import proximal_gradient

ACTOR, CRITIC = "pi.", "v."


def state_value(params: Tree, obs: torch.Tensor, activation: str = "tanh") -> torch.Tensor:
    """V_k(s) of K stacked critics (``v.*`` keys) on ``obs`` [K, ..., d]: a tensor [K, ...]."""
    return mlp(params, embedded(params, obs), activation, prefix=CRITIC).squeeze(-1)


def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    next_values: torch.Tensor,
    terminated: torch.Tensor,
    done: torch.Tensor,
    gamma: float,
    lam: float,
) -> torch.Tensor:
    """Generalized advantage estimates over tensors [T, ...] (Schulman et al. 2016, eq. (16)):

        delta_t = r_t + gamma (1 - terminated_t) V(s'_t) - V(s_t),
        A_t = delta_t + gamma lambda (1 - done_t) A_{t+1},   A_T = 0,

    where s'_t is the state after step t before any reset (``next_values``) and ``done`` is
    terminated or truncated: a truncated episode bootstraps from its last state, no episode
    leaks into the next."""
    delta = rewards + gamma * (1.0 - terminated) * next_values - values
    keep = gamma * lam * (1.0 - done)
    adv = torch.empty_like(delta)
    last = torch.zeros_like(delta[0])
    for t in range(delta.shape[0] - 1, -1, -1):
        last = delta[t] + keep[t] * last
        adv[t] = last
    return adv


def clipped_surrogate(ratio: torch.Tensor, adv: torch.Tensor, clip: float) -> torch.Tensor:
    """The negated clipped surrogate per sample (Schulman et al. 2017, eq. (7)):
    max(-A r, -A clip(r, 1 - c, 1 + c))."""
    return torch.max(-adv * ratio, -adv * ratio.clamp(1.0 - clip, 1.0 + clip))


def clipped_value_loss(
    new: torch.Tensor, old: torch.Tensor, returns: torch.Tensor, clip: float | None
) -> torch.Tensor:
    """0.5 max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2) per sample (CleanRL's
    clipped value loss); 0.5 (V - R)^2 when ``clip`` is None."""
    plain = (new - returns).square()
    if clip is None:
        return 0.5 * plain
    clipped = (old + (new - old).clamp(-clip, clip) - returns).square()
    return 0.5 * torch.max(plain, clipped)


def standardized(adv: torch.Tensor) -> torch.Tensor:
    """(A - mean) / (std + 1e-8) along the last axis (each agent's minibatch; the std with
    Bessel's correction, as ``torch.Tensor.std``)."""
    return (adv - adv.mean(-1, keepdim=True)) / (adv.std(-1, keepdim=True) + 1e-8)


@dataclass
class Transitions:
    """Rollout data with the agent axis first: tensors [K, B] (``obs`` [K, B, d])."""

    obs: torch.Tensor
    actions: torch.Tensor
    logp: torch.Tensor
    values: torch.Tensor
    advantages: torch.Tensor
    returns: torch.Tensor

    def take(self, idx: torch.Tensor) -> Transitions:
        """Each agent's rows ``idx[k]`` ([K, M] indices)."""
        obs = self.obs.gather(1, idx[..., None].expand(-1, -1, self.obs.shape[-1]))
        rest = (x.gather(1, idx) for x in (self.actions, self.logp, self.values))
        adv, ret = (x.gather(1, idx) for x in (self.advantages, self.returns))
        return Transitions(obs, *rest, adv, ret)


def ppo_losses(
    params: Tree, mb: Transitions, algo: PPOKeys, activation: str = "tanh"
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Each agent's PPO loss on its minibatch (module docstring), a tensor [K], and detached
    diagnostics [K]: policy loss, value loss, entropy, approximate KL (Schulman's
    (r - 1) - log r estimator) and the clipped fraction."""
    logp_all = torch.log_softmax(policy_logits(params, mb.obs, activation), -1)
    logp = logp_all.gather(-1, mb.actions[..., None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    logratio = logp - mb.logp
    ratio = logratio.exp()
    adv = standardized(mb.advantages) if algo.norm_adv else mb.advantages
    pg = clipped_surrogate(ratio, adv, algo.clip_coef).mean(-1)
    clip_v = algo.clip_coef if algo.clip_vloss else None
    v = clipped_value_loss(state_value(params, mb.obs, activation), mb.values, mb.returns, clip_v)
    v = v.mean(-1)
    ent = entropy.mean(-1)
    loss = pg - algo.ent_coef * ent + algo.vf_coef * v
    with torch.no_grad():
        stats = {
            "policy_loss": pg.detach(),
            "value_loss": v.detach(),
            "entropy": ent.detach(),
            "approx_kl": ((ratio - 1) - logratio).mean(-1),
            "clipfrac": ((ratio - 1.0).abs() > algo.clip_coef).float().mean(-1),
        }
    return loss, stats


def clip_by_agent_norm(grads: Tree, max_norm: float) -> Tree:
    """Each agent's gradient scaled to global norm at most ``max_norm`` (``torch.nn.utils.
    clip_grad_norm_`` per agent: factor min(1, max_norm / (norm + 1e-6)))."""
    sq = sum(g.reshape(g.shape[0], -1).square().sum(-1) for g in grads.values())
    factor = (max_norm / (sq.sqrt() + 1e-6)).clamp(max=1.0)
    return {k: g * factor.reshape(-1, *([1] * (g.dim() - 1))) for k, g in grads.items()}


def epoch_permutations(agents: int, batch: int, epochs: int, gen: torch.Generator) -> torch.Tensor:
    """An independent random permutation of each agent's ``batch`` rows per epoch,
    [epochs, K, batch]."""
    return torch.rand(epochs, agents, batch, generator=gen).argsort(-1)


def ppo_update(
    params: Tree,
    opt: Adam,
    data: Transitions,
    algo: PPOKeys,
    gen: torch.Generator,
    activation: str = "tanh",
    anchor: Tree | None = None,
    mu: float = 0.0,
) -> dict[str, float]:
    """``update_epochs`` passes of ``num_minibatches`` Adam steps on :func:`ppo_losses`
    (plus FedProx's proximal gradient towards ``anchor`` when ``mu`` > 0), each agent's
    gradient clipped to ``max_grad_norm``; updates ``params`` in place and returns the last
    epoch's mean diagnostics over agents and minibatches."""
    k, b = data.actions.shape
    size = b // algo.num_minibatches
    sums: dict[str, float] = {}
    for perm in epoch_permutations(k, b, algo.update_epochs, gen):
        sums = {}
        for start in range(0, b, size):
            mb = data.take(perm[:, start : start + size])
            leaves = {key: v.detach().requires_grad_(True) for key, v in params.items()}
            loss, stats = ppo_losses(leaves, mb, algo, activation)
            values = torch.autograd.grad(loss.sum(), list(leaves.values()))
            grads = dict(zip(leaves, values, strict=True))
            if anchor is not None:
                prox = proximal_gradient({key: params[key] for key in anchor}, anchor, mu)
                for key, g in (prox or {}).items():
                    grads[key] = grads[key] + g
            opt.step(params, clip_by_agent_norm(grads, algo.max_grad_norm))
            stats["loss"] = loss.detach()
            for key, value in stats.items():
                sums[key] = sums.get(key, 0.0) + float(value.mean()) / algo.num_minibatches
    return sums


class PPOTrainer:
    """The PPO loop of K agents in K x N auto-resetting environments (module docstring); the
    parameters and their Adam belong to the caller."""

    def __init__(
        self, env: VecEnv, agents: int, algo: PPOKeys, seed: int, total: int, lr: float, act: str
    ) -> None:
        self.algo, self.agents, self.seed, self.total = algo, agents, seed, total
        self.lr, self.activation = lr, act
        self.stream = EnvStream(env, agents, seed, "rl/ppo_reset")
        self.stats: list[dict[str, float]] = []

    @property
    def env_steps(self) -> int:
        return self.stream.env_steps

    @torch.no_grad()
    def collect(self, params: Tree, gen: torch.Generator) -> Transitions:
        """``num_steps`` steps of every environment with the agents' stochastic policies, and
        their GAE advantages and returns, flattened to [K, num_steps x N] (row t * N + i)."""
        algo, act, stream = self.algo, self.activation, self.stream
        rows: list[tuple[torch.Tensor, ...]] = []
        for _ in range(algo.num_steps):
            obs = stream.obs
            logp_all = torch.log_softmax(policy_logits(params, obs, act), -1)
            probs = logp_all.exp().reshape(-1, logp_all.shape[-1])
            action = torch.multinomial(probs, 1, generator=gen).reshape(obs.shape[:-1])
            logp = logp_all.gather(-1, action[..., None]).squeeze(-1)
            nxt, reward, terminated, done = stream.step(action, gen)
            rows.append((obs, action, logp, reward, terminated.float(), done.float(), nxt))
        stacked = (torch.stack(x) for x in zip(*rows, strict=True))
        obs, actions, logp, rewards, terminated, done, nxt = stacked
        t, k, n = actions.shape
        values = state_value(params, obs.transpose(0, 1), act).transpose(0, 1)  # [T, K, N]
        next_values = state_value(params, nxt.transpose(0, 1), act).transpose(0, 1)
        adv = gae(rewards, values, next_values, terminated, done, algo.gamma, algo.gae_lambda)

        def flat(x: torch.Tensor) -> torch.Tensor:  # [T, K, N, ...] -> [K, T * N, ...]
            return x.transpose(0, 1).reshape(k, t * n, *x.shape[3:])

        return Transitions(
            flat(obs), flat(actions), flat(logp), flat(values), flat(adv), flat(adv + values)
        )

    def iteration(
        self, it: int, params: Tree, opt: Adam, anchor: Tree | None = None, mu: float = 0.0
    ) -> None:
        """PPO iteration ``it``: a rollout (stream (seed, "rl/ppo", it)), then the update
        (stream (seed, "rl/ppo_minibatch", it)) with Adam's step size annealed to
        lr (1 - it / total)."""
        data = self.collect(params, generator(self.seed, "rl/ppo", round=it))
        if self.algo.anneal_lr:
            opt.lr = self.lr * (1.0 - it / self.total)
        gen = generator(self.seed, "rl/ppo_minibatch", round=it)
        self.stats.append(
            ppo_update(params, opt, data, self.algo, gen, self.activation, anchor, mu)
        )

    def take_stats(self) -> dict[str, Any]:
        """Mean return of the training episodes that ended and the mean PPO loss (and its
        parts) since the last call."""
        keys = self.stats[0] if self.stats else {}
        means = {f"train_{key}": sum(s[key] for s in self.stats) / len(self.stats) for key in keys}
        self.stats = []
        return {"train_return": self.stream.take_returns(), **means}

    def state_dict(self) -> dict[str, Any]:
        return self.stream.state_dict()

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        self.stream.load_state_dict(saved)

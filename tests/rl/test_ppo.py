"""PPO agents (rl/ppo.py, docs/rl.md): GAE, the clipped losses and the orthogonal initialisation
against hand-computed values, one update of two stacked agents against a transcription of
CleanRL's ``ppo.py`` update (torch.nn, torch.optim.Adam, clip_grad_norm_), and federated PPO
learning CartPole (heavy; numbers in docs/rl.md)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.distributions import Categorical

import fedloom
from fedloom.core.rng import generator
from fedloom.engine.threads import torch_threads
from fedloom.errors import ConfigError
from fedloom.rl.config import PAvgPPOConfig, parse_rl_config
from fedloom.rl.envs import make_env
from fedloom.rl.nets import Adam, init_orthogonal_mlp
from fedloom.rl.ppo import (
    ACTOR,
    CRITIC,
    PPOTrainer,
    clipped_surrogate,
    clipped_value_loss,
    epoch_permutations,
    gae,
    ppo_update,
)


def test_gae_by_hand():
    """T = 3, one environment, gamma 0.9, lambda 0.5; step 1 terminates, step 2 is truncated
    (bootstraps from V(s'_2) = 2)."""
    r = torch.tensor([1.0, 1.0, 1.0])
    v = torch.tensor([0.5, 0.4, 0.3])
    v_next = torch.tensor([0.4, 7.0, 2.0])  # V(s'_1) = 7 must not count: terminated
    term = torch.tensor([0.0, 1.0, 0.0])
    done = torch.tensor([0.0, 1.0, 1.0])
    adv = gae(r, v, v_next, term, done, 0.9, 0.5)
    # delta = [1 + 0.9*0.4 - 0.5, 1 - 0.4, 1 + 0.9*2 - 0.3] = [0.86, 0.6, 2.5]
    # A_2 = 2.5; A_1 = 0.6 (done); A_0 = 0.86 + 0.45 * 0.6 = 1.13
    assert torch.allclose(adv, torch.tensor([1.13, 0.6, 2.5]))


def _cleanrl_gae(rewards, values, dones, next_value, next_done, gamma, lam):
    """CleanRL ppo.py's loop: ``dones[t]`` marks obs[t] as the first of a new episode."""
    steps = rewards.shape[0]
    advantages = torch.zeros_like(rewards)
    lastgaelam = 0
    for t in reversed(range(steps)):
        if t == steps - 1:
            nextnonterminal = 1.0 - next_done
            nextvalues = next_value
        else:
            nextnonterminal = 1.0 - dones[t + 1]
            nextvalues = values[t + 1]
        delta = rewards[t] + gamma * nextvalues * nextnonterminal - values[t]
        advantages[t] = lastgaelam = delta + gamma * lam * nextnonterminal * lastgaelam
    return advantages


def test_gae_equals_cleanrl_without_truncation():
    gen = torch.Generator().manual_seed(0)
    t, n = 40, 6
    rewards = torch.rand(t, n, generator=gen)
    values = torch.randn(t + 1, n, generator=gen)  # V(obs_0..obs_T)
    dones = (torch.rand(t + 1, n, generator=gen) < 0.1).float()  # CleanRL's flags per obs
    ref = _cleanrl_gae(rewards, values[:-1], dones[:-1], values[-1], dones[-1], 0.99, 0.95)
    # ours: done_t ends step t, s'_t = obs_{t+1} when the episode goes on
    ours = gae(rewards, values[:-1], values[1:], dones[1:], dones[1:], 0.99, 0.95)
    assert torch.allclose(ours, ref, atol=1e-6)


def test_clipped_surrogate_and_value_loss_by_hand():
    ratio = torch.tensor([0.5, 1.1, 1.5, 0.7])
    adv = torch.tensor([1.0, 1.0, 1.0, -2.0])
    # max(-A r, -A clip(r, 0.8, 1.2)): [-0.5, -1.1, -1.2, max(1.4, 1.6) = 1.6]
    assert torch.allclose(clipped_surrogate(ratio, adv, 0.2), torch.tensor([-0.5, -1.1, -1.2, 1.6]))
    new, old, ret = torch.tensor([1.0, 3.0]), torch.tensor([0.0, 2.9]), torch.tensor([2.0, 0.0])
    # V_clipped = [0.2, 3.0]: 0.5 max((V - R)^2, (V_clipped - R)^2) = [0.5 * 3.24, 0.5 * 9]
    assert torch.allclose(clipped_value_loss(new, old, ret, 0.2), torch.tensor([0.5 * 3.24, 4.5]))
    assert torch.allclose(clipped_value_loss(new, old, ret, None), torch.tensor([0.5, 4.5]))


def test_orthogonal_init_is_cleanrls_layer_init():
    params = init_orthogonal_mlp([4, 8, 8, 2], torch.Generator().manual_seed(0), ACTOR, 0.01)
    w0, w2 = params[f"{ACTOR}0.weight"][0], params[f"{ACTOR}2.weight"][0]
    assert torch.allclose(w0.T @ w0, 2.0 * torch.eye(4), atol=1e-5)  # gain sqrt(2), 8 x 4
    assert torch.allclose(w2 @ w2.T, 1e-4 * torch.eye(2), atol=1e-9)  # gain 0.01, 2 x 8
    assert all(float(params[f"{ACTOR}{i}.bias"].abs().max()) == 0.0 for i in range(3))


def _cleanrl_agent(params: dict, k: int, hidden: int) -> nn.Module:
    """CleanRL's ``Agent`` (critic and actor MLPs, tanh) holding our agent k's parameters."""

    def net(prefix: str, out: int) -> nn.Sequential:
        seq = nn.Sequential(
            nn.Linear(4, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(),
            nn.Linear(hidden, out),
        )  # fmt: skip
        with torch.no_grad():
            for i, layer in enumerate((seq[0], seq[2], seq[4])):
                layer.weight.copy_(params[f"{prefix}{i}.weight"][k])
                layer.bias.copy_(params[f"{prefix}{i}.bias"][k])
        return seq

    agent = nn.Module()
    agent.critic, agent.actor = net(CRITIC, 1), net(ACTOR, 2)
    return agent


def _cleanrl_update(agent, b, perms, args, lr):
    """CleanRL ppo.py's update phase on one agent's flattened batch ``b``, with ``perms``
    (one permutation per epoch) for its ``np.random.shuffle``."""
    optimizer = torch.optim.Adam(agent.parameters(), lr=lr, eps=1e-5)
    minibatch_size = b["obs"].shape[0] // args.num_minibatches
    for epoch in range(args.update_epochs):
        b_inds = perms[epoch]
        for start in range(0, b["obs"].shape[0], minibatch_size):
            mb_inds = b_inds[start : start + minibatch_size]
            logits = agent.actor(b["obs"][mb_inds])
            probs = Categorical(logits=logits)
            newlogprob = probs.log_prob(b["actions"][mb_inds])
            entropy = probs.entropy()
            newvalue = agent.critic(b["obs"][mb_inds])
            logratio = newlogprob - b["logprobs"][mb_inds]
            ratio = logratio.exp()
            mb_advantages = b["advantages"][mb_inds]
            mb_advantages = (mb_advantages - mb_advantages.mean()) / (mb_advantages.std() + 1e-8)
            pg_loss1 = -mb_advantages * ratio
            pg_loss2 = -mb_advantages * torch.clamp(ratio, 1 - args.clip_coef, 1 + args.clip_coef)
            pg_loss = torch.max(pg_loss1, pg_loss2).mean()
            newvalue = newvalue.view(-1)
            v_loss_unclipped = (newvalue - b["returns"][mb_inds]) ** 2
            v_clipped = b["values"][mb_inds] + torch.clamp(
                newvalue - b["values"][mb_inds], -args.clip_coef, args.clip_coef
            )
            v_loss_clipped = (v_clipped - b["returns"][mb_inds]) ** 2
            v_loss = 0.5 * torch.max(v_loss_unclipped, v_loss_clipped).mean()
            loss = pg_loss - args.ent_coef * entropy.mean() + v_loss * args.vf_coef
            optimizer.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)
            optimizer.step()


def test_update_of_stacked_agents_equals_cleanrl():
    """Two agents, their own rollouts in CartPoles of two pole lengths: one PPO update (2
    epochs x 4 minibatches, large enough steps that ratios get clipped) equals CleanRL's
    update of each agent alone, parameter by parameter (one torch thread, as RL runs use:
    tiny tensors)."""
    with torch_threads(1):
        _update_equals_cleanrl()


def _update_equals_cleanrl() -> None:
    cfg = parse_rl_config(
        {
            "data": {"name": "cartpole", "num_clients": 2, "envs_per_client": 2},
            "algorithm": {"name": "pavg_ppo", "num_steps": 16, "update_epochs": 2},
        }
    )
    algo = cfg.algorithm
    assert isinstance(algo, PAvgPPOConfig)
    env = make_env(cfg.data, [0.5, 1.5], 2)
    hidden, lr = 8, 0.02
    params = {
        **init_orthogonal_mlp([4, hidden, hidden, 1], generator(0, "t"), CRITIC, 1.0),
        **init_orthogonal_mlp([4, hidden, hidden, 2], generator(0, "t"), ACTOR, 0.01),
    }
    params = {k: torch.cat((v, 1.1 * v)) for k, v in params.items()}  # two different agents
    trainer = PPOTrainer(env, 2, algo, 0, 1, lr, "tanh")
    data = trainer.collect(params, generator(0, "rollout"))
    refs = [_cleanrl_agent(params, k, hidden) for k in range(2)]
    stats = ppo_update(params, Adam(params, lr, eps=1e-5), data, algo, generator(0, "mb"))
    assert stats["clipfrac"] > 0  # the clipping is exercised
    perms = epoch_permutations(2, 32, algo.update_epochs, generator(0, "mb"))
    for k, ref in enumerate(refs):
        b = {
            "obs": data.obs[k],
            "actions": data.actions[k],
            "logprobs": data.logp[k],
            "values": data.values[k],
            "advantages": data.advantages[k],
            "returns": data.returns[k],
        }
        _cleanrl_update(ref, b, perms[:, k], algo, lr)
        for prefix, net in ((ACTOR, ref.actor), (CRITIC, ref.critic)):
            for i, layer in enumerate((net[0], net[2], net[4])):
                assert torch.allclose(layer.weight, params[f"{prefix}{i}.weight"][k], atol=2e-6)
                assert torch.allclose(layer.bias, params[f"{prefix}{i}.bias"][k], atol=2e-6)


def test_rollout_is_agent_major_and_returns_are_advantages_plus_values():
    """Row t * N + i of agent k is its environment i at step t, and R = A + V."""
    cfg = parse_rl_config(
        {"data": {"name": "cartpole", "num_clients": 2, "envs_per_client": 3},
         "algorithm": {"name": "local_ppo", "num_steps": 5, "num_minibatches": 1}}
    )  # fmt: skip
    env = make_env(cfg.data, [0.25, 3.0], 3)
    params = init_orthogonal_mlp([4, 8, 1], generator(1, "t"), CRITIC, 1.0)
    params |= init_orthogonal_mlp([4, 8, 2], generator(1, "t"), ACTOR, 0.01)
    params = {k: v.expand(2, *v.shape[1:]).clone() for k, v in params.items()}
    trainer = PPOTrainer(env, 2, cfg.algorithm, 0, 1, 1e-3, "tanh")
    first = trainer.stream.obs.clone()  # [K, N, d]
    data = trainer.collect(params, generator(0, "r"))
    assert data.obs.shape == (2, 5 * 3, 4)
    assert torch.equal(data.obs[:, :3], first)
    assert torch.allclose(data.returns, data.advantages + data.values)
    assert trainer.env_steps == 5 * 6


def test_ppo_config_errors_name_the_key():
    with pytest.raises(ConfigError, match=r"algorithm\.num_minibatches 3 must divide"):
        parse_rl_config({"data": {"envs_per_client": 4}, "algorithm": {"name": "pavg_ppo",
                         "num_minibatches": 3}})  # fmt: skip
    with pytest.raises(ConfigError, match="acrobot"):
        parse_rl_config({"data": {"name": "acrobot"}, "algorithm": {"name": "pavg_ppo"}})
    with pytest.raises(ConfigError, match="does not aggregate"):
        parse_rl_config({"algorithm": {"name": "local_ppo"}, "aggregator": {"kind": "median"}})


def test_ppo_agents_share_actor_and_critic_not_the_embedding():
    cfg = {
        "seed": 1,
        "data": {"name": "cartpole", "num_clients": 2, "envs_per_client": 2,
                 "cartpole": {"lengths": [0.5, 1.0], "unseen_lengths": [2.0]}},
        "model": {"hidden": [8]},
        "algorithm": {"name": "pavg_ppo_embedding", "num_steps": 8},
        "train": {"rounds": 1, "local_steps": 2},
        "eval": {"episodes": 2},
    }  # fmt: skip
    result = fedloom.run(cfg, write=False)
    a, b = result.client_params[0], result.client_params[1]
    assert set(result.global_params) == set(a) - {"embedding"}
    assert all(torch.equal(a[k], b[k]) for k in result.global_params)
    assert not torch.equal(a["embedding"], b["embedding"])
    n = sum(v.numel() for v in result.global_params.values())
    assert result.summary["communication"] == {"bytes_up": 2 * 4 * n, "bytes_down": 2 * 4 * n}
    assert result.summary["rl"]["learner"] == "ppo"
    assert math.isfinite(result.history[-1]["train_loss"])

"""docs/rl.md, "Tests", 1: the batched CartPole step equals Gymnasium's CartPole-v1 step."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import torch

from fedloom.rl.cartpole import MAX_STEPS, CartPoleBatch, CartPoleParams, cartpole_step


def _gym_step(env, state, action, length, masspole, masscart, gravity):
    u = env.unwrapped
    u.length, u.masspole, u.masscart, u.gravity = length, masspole, masscart, gravity
    u.total_mass = masspole + masscart  # step() reads only the derived values
    u.polemass_length = masspole * length
    u.state = np.array(state, dtype=np.float64)
    u.steps_beyond_terminated = None
    env.step(int(action))
    return np.array(u.state), bool(
        abs(u.state[0]) > u.x_threshold or abs(u.state[2]) > u.theta_threshold_radians
    )


def test_step_matches_gymnasium_float64():
    rng = np.random.default_rng(0)
    n = 1000
    # states on both sides of the thresholds, so that termination flags take both values
    state = rng.uniform([-2.6, -3, -0.25, -3], [2.6, 3, 0.25, 3], size=(n, 4))
    action = rng.integers(0, 2, n)
    length, masspole = rng.uniform(0.1, 3.0, n), rng.uniform(0.05, 1.0, n)
    masscart, gravity = rng.uniform(0.5, 3.0, n), rng.uniform(5.0, 15.0, n)
    params = CartPoleParams.make(
        length, torch.tensor(masspole), torch.tensor(masscart), torch.tensor(gravity)
    )
    nxt, terminated = cartpole_step(torch.tensor(state), torch.tensor(action), params)
    env = gym.make("CartPole-v1").unwrapped
    env.reset(seed=0)
    env.action_space.seed(0)
    want = [
        _gym_step(env, state[i], action[i], length[i], masspole[i], masscart[i], gravity[i])
        for i in range(n)
    ]
    ref = np.stack([w[0] for w in want])
    ref_term = np.array([w[1] for w in want])
    assert np.max(np.abs(nxt.numpy() - ref)) <= 1e-12
    assert (terminated.numpy() == ref_term).all()
    assert 0 < ref_term.sum() < n


def test_episode_matches_gymnasium_terminated_and_truncated():
    """A whole episode under a fixed action sequence, through Gymnasium's own reset and
    TimeLimit: same states, rewards and termination step; a balanced pole is truncated at
    500 steps."""
    env = gym.make("CartPole-v1")
    env.reset(seed=3)
    batch = CartPoleBatch(CartPoleParams.make([0.5]))
    batch.state = torch.tensor(env.unwrapped.state, dtype=torch.float64)[None]
    actions = [0, 1] * 20 + [1] * 40
    for t, a in enumerate(actions):
        _, r, term, trunc, _ = env.step(a)
        b_obs, b_r, b_term, b_trunc = batch.step(torch.tensor([a]))
        assert np.array_equal(b_obs[0].numpy(), np.asarray(env.unwrapped.state, np.float32))
        assert (bool(b_term), bool(b_trunc), float(b_r)) == (term, trunc, r), t
        if term:
            break
    assert term
    batch = CartPoleBatch(CartPoleParams.make([0.5]))
    batch.steps[:] = MAX_STEPS - 1
    _, _, term, trunc = batch.step(torch.tensor([0]))
    assert bool(trunc) and not bool(term)


def test_reset_is_uniform_in_bounds_and_per_stream():
    a = CartPoleBatch(CartPoleParams.make([0.5] * 500))
    s = a.reset(torch.Generator().manual_seed(1))
    assert s.abs().max() <= 0.05 and s.abs().max() > 0.045
    b = CartPoleBatch(CartPoleParams.make([0.5] * 500))
    assert torch.equal(b.reset(torch.Generator().manual_seed(1)), s)


def test_step_is_vmappable_over_agents():
    """torch.func.vmap over an agent axis (each agent its own pole length) gives the flat
    batched step exactly."""
    k, n = 3, 5
    gen = torch.Generator().manual_seed(2)
    state = 0.05 * torch.randn(k, n, 4, generator=gen, dtype=torch.float64)
    action = torch.randint(0, 2, (k, n), generator=gen)
    lengths = torch.tensor([0.25, 0.5, 1.0], dtype=torch.float64)

    def one_agent(s, a, length):
        full = torch.ones(n, dtype=torch.float64)
        return cartpole_step(s, a, CartPoleParams(length * full, 0.1 * full, full, 9.8 * full))

    nxt, term = torch.func.vmap(one_agent)(state, action, lengths)
    flat = CartPoleParams.make(lengths.repeat_interleave(n))
    ref, ref_term = cartpole_step(state.reshape(-1, 4), action.reshape(-1), flat)
    assert torch.equal(nxt.reshape(-1, 4), ref)
    assert torch.equal(term.reshape(-1), ref_term)

"""docs/rl.md, "Tests", 3: the vertical federated DQN (sigma = 0) is exactly the centralized
network whose first layer is block-diagonal: same Q-values, same gradients, and only [B, h]
activations forward and [B, h] gradients backward cross between the parties."""

from __future__ import annotations

import torch

from fedloom.rl.dqn import Batch, td_loss, td_target
from fedloom.rl.nets import mlp
from fedloom.rl.vertical_dqn import VerticalQ

B, H = 16, 8


def _batch(gen: torch.Generator) -> Batch:
    return Batch(
        obs=torch.randn(1, B, 4, generator=gen),
        actions=torch.randint(0, 2, (1, B), generator=gen),
        rewards=torch.ones(1, B),
        next_obs=torch.randn(1, B, 4, generator=gen),
        terminated=(torch.rand(1, B, generator=gen) < 0.2).float(),
    )


def _vq(noise: float = 0.0) -> VerticalQ:
    gen = torch.Generator().manual_seed(0)
    vq = VerticalQ([0, 1], [2, 3], H, [16], 2, 1e-3, 0.99, gen, noise)
    # a target network different from the online one, as after some training
    vq.a.target = {k: v + 0.05 for k, v in vq.a.target.items()}
    vq.b.target = {k: v - 0.05 for k, v in vq.b.target.items()}
    return vq


def test_split_q_values_and_gradients_equal_the_block_diagonal_network():
    vq = _vq()
    batch = _batch(torch.Generator().manual_seed(1))
    central = {k: v.requires_grad_(True) for k, v in vq.centralized_params().items()}
    target_net = vq.centralized_params(target=True)
    q_central = mlp(central, batch.obs, "relu", "q.")
    assert torch.allclose(vq.act_q(batch.obs), q_central.detach(), atol=1e-6, rtol=0)

    target = td_target(
        mlp(target_net, batch.next_obs, "relu", "q."), batch.rewards, batch.terminated, 0.99
    )
    loss_c = td_loss(q_central, batch.actions, target)
    grads_c = dict(zip(central, torch.autograd.grad(loss_c, list(central.values())), strict=True))
    vq.wire.shapes.clear()
    loss, ga, gb = vq.gradients(batch)
    assert abs(float(loss) - float(loss_c.detach())) <= 1e-6
    w = grads_c["q.0.weight"][0]
    assert torch.allclose(w[:H, [0, 1]], ga["bottom.0.weight"][0], atol=1e-6, rtol=0)
    assert torch.allclose(w[H:, [2, 3]], gb["bottom.0.weight"][0], atol=1e-6, rtol=0)
    assert torch.allclose(grads_c["q.0.bias"][0, :H], ga["bottom.0.bias"][0], atol=1e-6, rtol=0)
    assert torch.allclose(grads_c["q.0.bias"][0, H:], gb["bottom.0.bias"][0], atol=1e-6, rtol=0)
    for i in range(2):
        for part in ("weight", "bias"):
            assert torch.allclose(grads_c[f"q.{i + 1}.{part}"], ga[f"top.{i}.{part}"], atol=1e-6)
    # the messages of one batch: B's target and online activations up, A's gradient down
    assert [d for d, _ in vq.wire.shapes] == ["up", "up", "down"]
    for _, shape in vq.wire.shapes:
        assert shape[-2:] == (B, H) and torch.Size(shape).numel() == B * H


def test_update_moves_both_parties_and_counts_bytes():
    vq = _vq()
    batch = _batch(torch.Generator().manual_seed(2))
    a0 = {k: v.clone() for k, v in vq.a.params.items()}
    b0 = {k: v.clone() for k, v in vq.b.params.items()}
    vq.update(batch)
    assert all(not torch.equal(a0[k], vq.a.params[k]) for k in a0)
    assert all(not torch.equal(b0[k], vq.b.params[k]) for k in b0)
    assert vq.wire.bytes_up == 2 * B * H * 4 and vq.wire.bytes_down == B * H * 4


def test_noise_protects_the_activations_only():
    """sigma > 0: B's messages carry N(0, sigma^2) noise (their gradients flow unchanged to
    f_B); sigma = 0 sends f_B(o_B) exactly."""
    obs = torch.randn(1, B, 4, generator=torch.Generator().manual_seed(3))
    clean, noisy = _vq(0.0), _vq(0.5)
    h = clean._b_activations(obs, clean.b.params, torch.Generator().manual_seed(4))
    hn = noisy._b_activations(obs, noisy.b.params, torch.Generator().manual_seed(4))
    diff = hn - h
    assert 0.4 < float(diff.std()) < 0.6
    assert torch.equal(clean._b_activations(obs, clean.b.params, None), h)

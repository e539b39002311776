"""The target networks of QAvg and DQN agents (docs/rl.md): Double DQN's target by hand, and
QAvg's target copies replaced by the round's global Q-network."""

from __future__ import annotations

import pytest
import torch

import fedloom
from fedloom.rl.dqn import td_target


def test_double_dqn_target_by_hand():
    """The online network picks argmax 0, the target network values it at 1 (not its max
    5): r + gamma * 1."""
    q_target, q_online = torch.tensor([[1.0, 5.0]]), torch.tensor([[3.0, 2.0]])
    r, term = torch.tensor([0.5]), torch.tensor([0.0])
    assert torch.allclose(td_target(q_target, r, term, 0.9), torch.tensor([0.5 + 4.5]))
    assert torch.allclose(td_target(q_target, r, term, 0.9, q_online), torch.tensor([1.4]))
    assert torch.allclose(td_target(q_target, r, torch.ones(1), 0.9, q_online), r)


@pytest.mark.parametrize("global_target", [True, False])
def test_qavg_target_copies_become_the_global_network(global_target):
    """Rounds of 2 iterations, a target copy every 3: round 1 (iterations 2, 3) makes one, so
    after it every agent's target is the broadcast global network (or, with
    ``global_target: false``, the agent's own pre-averaging copy, which differs)."""
    cfg = {
        "seed": 0,
        "data": {"name": "cartpole", "num_clients": 2, "envs_per_client": 4},
        "model": {"hidden": [8]},
        "algorithm": {"name": "qavg", "double": True, "learning_starts": 4, "batch_size": 4,
                      "target_every": 3, "global_target": global_target},
        "train": {"rounds": 2, "local_steps": 2},
        "eval": {"every": 2, "episodes": 1},
    }  # fmt: skip
    result = fedloom.run(cfg, write=False)
    q = result.extras["learner"].q
    same = [torch.equal(q.target[k][a], v) for k, v in result.global_params.items() for a in (0, 1)]
    assert all(same) == global_target
    if not global_target:
        assert not torch.equal(q.target["q.0.weight"][0], q.target["q.0.weight"][1])

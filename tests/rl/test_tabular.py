"""docs/rl.md, "Tests", 2: tabular QAvg with E = 1 is value iteration on the averaged MDP."""

from __future__ import annotations

import torch

from fedloom.rl.tabular import qavg, random_mdp, value_iteration

GAMMA = 0.9


def _mdp():
    return random_mdp(6, 2, 4, torch.Generator().manual_seed(0))


def test_qavg_e1_is_value_iteration_on_the_mean_mdp():
    p, r = _mdp()
    q_star = value_iteration(p.mean(0), r, GAMMA)
    q = qavg(p, r, GAMMA, local_sweeps=1)
    assert float((q - q_star).abs().max()) <= 1e-8
    # and not the optimum of any single agent's MDP
    assert min(float((q - value_iteration(p[k], r, GAMMA)).abs().max()) for k in range(4)) > 1e-3


def test_qavg_e5_gap_shrinks_as_the_kernels_become_equal():
    p, r = _mdp()
    p_bar = p.mean(0)
    gaps = []
    for lam in (1.0, 0.5, 0.1, 0.0):  # P_k(lam) = P_bar + lam (P_k - P_bar): same mean
        pk = p_bar + lam * (p - p_bar)
        q = qavg(pk, r, GAMMA, local_sweeps=5)
        gaps.append(float((q - value_iteration(p_bar, r, GAMMA)).abs().max()))
    assert gaps[0] > 1e-3  # E > 1: a different fixed point (measured 0.028)
    assert gaps[0] > gaps[1] > gaps[2] > gaps[3]
    assert gaps[3] <= 1e-8

"""Tabular QAvg and its value-iteration oracle (Jin et al., AISTATS 2022, arXiv 2204.02634;
docs/rl.md).

K agents share states, actions and rewards but not transitions: P_k [S, A, S']. The Bellman
operator of agent k is (T_k Q)(s, a) = r(s, a) + gamma sum_s' P_k(s' | s, a) max_a' Q(s', a').
QAvg: every round each agent starts from the server's Q, applies E full sweeps of its own T_k,
and the server averages. With E = 1, (1/K) sum_k T_k Q = r + gamma P_bar max Q: QAvg is value
iteration on the averaged MDP P_bar and converges to Q*(P_bar). With E > 1 its fixed point
differs from Q*(P_bar) by a gap that grows with the heterogeneity of the P_k.
"""

from __future__ import annotations

import torch

from fedloom.core.pytree import weighted_average


def bellman(q: torch.Tensor, p: torch.Tensor, r: torch.Tensor, gamma: float) -> torch.Tensor:
    """T Q for transitions ``p`` [..., S, A, S'], rewards ``r`` [S, A] and ``q`` [..., S, A]."""
    v = q.max(-1).values  # [..., S']
    return r + gamma * torch.einsum("...sat,...t->...sa", p, v)


def value_iteration(
    p: torch.Tensor, r: torch.Tensor, gamma: float, tol: float = 1e-13, max_iter: int = 100_000
) -> torch.Tensor:
    """Q* of one MDP by value iteration, to sup-norm change below ``tol``."""
    q = torch.zeros_like(r)
    for _ in range(max_iter):
        nxt = bellman(q, p, r, gamma)
        if float((nxt - q).abs().max()) < tol:
            return nxt
        q = nxt
    return q


def qavg(
    p: torch.Tensor,
    r: torch.Tensor,
    gamma: float,
    local_sweeps: int = 1,
    weights: list[float] | None = None,
    tol: float = 1e-13,
    max_rounds: int = 100_000,
) -> torch.Tensor:
    """The server's Q after QAvg with ``local_sweeps`` (E) full Bellman sweeps per round, run
    until a round changes it by less than ``tol`` (``p``: [K, S, A, S'])."""
    k = p.shape[0]
    weights = weights or [1.0] * k
    q = torch.zeros_like(r)
    for _ in range(max_rounds):
        local = q.expand(k, *q.shape)
        for _ in range(local_sweeps):
            local = bellman(local, p, r, gamma)
        nxt = weighted_average([{"q": local[i]} for i in range(k)], weights)["q"]
        if float((nxt - q).abs().max()) < tol:
            return nxt
        q = nxt
    return q


def random_mdp(
    states: int, actions: int, agents: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """K random transition kernels [K, S, A, S'] (rows Dirichlet(1)) and rewards [S, A] in
    [0, 1), float64."""
    e = -torch.log(
        torch.rand((agents, states, actions, states), generator=gen, dtype=torch.float64)
    )
    p = e / e.sum(-1, keepdim=True)
    r = torch.rand((states, actions), generator=gen, dtype=torch.float64)
    return p, r

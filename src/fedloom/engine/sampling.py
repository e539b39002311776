"""Which clients take part in a round, and which of them straggle (seeded per round)."""

from __future__ import annotations

import math

import torch

from fedloom.rng import generator


def sample_clients(seed: int, round: int, eligible: list[int], per_round: int | None) -> list[int]:
    """Uniform sampling without replacement of ``per_round`` clients (all when None), sorted."""
    if per_round is None or per_round >= len(eligible):
        return list(eligible)
    perm = torch.randperm(len(eligible), generator=generator(seed, "sample", round))
    return sorted(eligible[i] for i in perm[:per_round].tolist())


def straggler_steps(
    seed: int, round: int, clients: list[int], full_steps: list[int], fraction: float
) -> list[int]:
    """Local steps each client completes: a ``fraction`` of the sampled clients (chosen at
    random) straggle and finish only a uniform draw from 1..S of their S steps, as in the
    FedProx paper's systems-heterogeneity setting."""
    if fraction <= 0 or not clients:
        return list(full_steps)
    gen = generator(seed, "stragglers", round)
    num = math.floor(fraction * len(clients))
    chosen = set(torch.randperm(len(clients), generator=gen)[:num].tolist())
    steps = list(full_steps)
    for i in sorted(chosen):
        steps[i] = int(torch.randint(1, max(1, full_steps[i]) + 1, (1,), generator=gen))
    return steps

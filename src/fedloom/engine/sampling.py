"""Which clients take part in a round (seeded per round); how much work they do is
fedloom.engine.workload."""

from __future__ import annotations

import torch

from fedloom.core.rng import generator


def sample_clients(seed: int, round: int, eligible: list[int], per_round: int | None) -> list[int]:
    """Uniform sampling without replacement of ``per_round`` clients (all when None), sorted."""
    if per_round is None or per_round >= len(eligible):
        return list(eligible)
    perm = torch.randperm(len(eligible), generator=generator(seed, "sample", round))
    return sorted(eligible[i] for i in perm[:per_round].tolist())

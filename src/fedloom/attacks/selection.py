"""Which clients are malicious: floor(fraction x N) of the N training clients, drawn once per
run from the stream (seed, 'attack/malicious'), so a resumed run and every executor see the same
set."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from fedloom.core.rng import generator


def malicious_clients(seed: int, train_ids: Sequence[int], fraction: float) -> list[int]:
    """The malicious clients among ``train_ids``, ascending."""
    num = math.floor(fraction * len(train_ids))
    order = torch.randperm(len(train_ids), generator=generator(seed, "attack/malicious"))
    return sorted(train_ids[i] for i in order[:num].tolist())

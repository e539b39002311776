"""Clients that vanish mid-round (``train.dropout``), and when.

Each round, floor(dropout x sampled) of the sampled clients vanish, chosen from the stream
(seed, round, 'dropout'), each at a stage drawn uniformly from secure aggregation's three
(secure/base.py ``DropStage``): after advertising its keys, after sharing them, or after sending
its masked input. A client that vanishes at the first two never uploads (it does no local work
in the simulation); one that vanishes at the last has uploaded, and every protocol sums it
(SecAgg rebuilds its self mask from the others' shares). The same draw serves every
``secure_aggregation.kind``, plain aggregation included, so two runs that differ only in the
protocol lose the same clients and show what each protocol survives.
"""

from __future__ import annotations

import math

import torch

from fedloom.core.rng import generator
from fedloom.secure.base import DROP_STAGES, DropStage


def dropouts(seed: int, round: int, clients: list[int], fraction: float) -> dict[int, DropStage]:
    """client -> the stage at which it vanishes in ``round`` (only the clients that do)."""
    num = math.floor(fraction * len(clients))
    if num == 0:
        return {}
    gen = generator(seed, "dropout", round)
    chosen = torch.randperm(len(clients), generator=gen)[:num].tolist()
    stages = torch.randint(len(DROP_STAGES), (num,), generator=gen).tolist()
    return {clients[i]: DROP_STAGES[s] for i, s in zip(chosen, stages, strict=True)}


def uploads(stage: DropStage | None) -> bool:
    """Whether a client that vanishes at ``stage`` (None: stays) has uploaded its input."""
    return stage is None or stage == "unmask"

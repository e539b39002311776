"""Which clients take part in a round (seeded per round); how much work they do is
fedloom.engine.workload."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fedloom.core.protocol import ClientData
from fedloom.core.rng import generator
from fedloom.data.federated import FederatedData


def sample_clients(seed: int, round: int, eligible: list[int], per_round: int | None) -> list[int]:
    """Uniform sampling without replacement of ``per_round`` clients (all when None), sorted."""
    if per_round is None or per_round >= len(eligible):
        return list(eligible)
    perm = torch.randperm(len(eligible), generator=generator(seed, "sample", round))
    return sorted(eligible[i] for i in perm[:per_round].tolist())


POOLED_CLIENT = -1
"""Client id of the one client of a pooled view (the centralized baseline)."""


@dataclass(frozen=True)
class TrainingClients:
    """The clients that train, by id, and how many of them a round samples: the federated
    view (each training client, ``train.clients_per_round``) or, for an algorithm that trains
    on pooled data (the centralized baseline), one client holding every training client's
    samples, in every round."""

    data: dict[int, ClientData]
    per_round: int | None
    poisson: bool = False
    """Draw each client independently with probability per_round / clients (differential
    privacy's Poisson sampling: a round may hold any number of clients, none too)."""

    @classmethod
    def view(
        cls,
        data: FederatedData,
        ids: list[int],
        per_round: int | None,
        pooled: bool,
        poisson: bool = False,
    ) -> TrainingClients:
        if not pooled:
            return cls({c: data.clients[c] for c in ids}, per_round, poisson)
        parts = [data.clients[c] for c in ids]
        joined = ClientData(
            *(torch.cat([getattr(p, key) for p in parts]) for key in ClientData.__annotations__)
        )
        return cls({POOLED_CLIENT: joined}, None)

    def sample(self, seed: int, round: int) -> list[int]:
        if self.poisson and self.per_round is not None:
            return poisson_clients(seed, round, list(self.data), self.per_round / len(self.data))
        return sample_clients(seed, round, list(self.data), self.per_round)


def poisson_clients(seed: int, round: int, eligible: list[int], rate: float) -> list[int]:
    """Each of ``eligible`` independently with probability ``rate``, from the round's stream."""
    draws = torch.rand(len(eligible), generator=generator(seed, "sample/poisson", round))
    return [c for c, u in zip(eligible, draws.tolist(), strict=True) if u < rate]

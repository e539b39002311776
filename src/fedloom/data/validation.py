"""A validation split that no client trains on: what hyperparameter search, keeping the best
model and contribution evaluation read, so that the test sets stay untouched."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from fedloom.core.protocol import ClientData
from fedloom.core.rng import generator
from fedloom.data.federated import FederatedData


def hold_out_validation(
    data: FederatedData, fraction: float, seed: int, clients: Sequence[int] | None = None
) -> tuple[FederatedData, list[ClientData]]:
    """``data`` with ``fraction`` of each listed client's train set moved to a validation
    set (default: every client), and those validation sets, one per client (empty for the
    others).

    The split is drawn once per client from the stream (seed, 'validation', client), so
    it is the same on every executor and after a resume. A client keeps at least one
    training sample. The validation sets are ``ClientData`` with the samples in ``x_test`` /
    ``y_test`` and an empty train part, so every evaluation helper reads them unchanged.
    """
    chosen = set(range(data.num_clients) if clients is None else clients)
    trained: list[ClientData] = []
    held: list[ClientData] = []
    for cid, client in enumerate(data.clients):
        n = client.num_train
        n_val = min(int(fraction * n), n - 1) if cid in chosen else 0
        perm = torch.randperm(n, generator=generator(seed, "validation", client=cid))
        val, keep = perm[:n_val].sort().values, perm[n_val:].sort().values
        x, y = client.x_train, client.y_train
        trained.append(ClientData(x[keep], y[keep], client.x_test, client.y_test))
        held.append(ClientData(x[:0], y[:0], x[val], y[val]))
    return replace(data, clients=trained), held


def pooled(sets: Sequence[ClientData]) -> ClientData:
    """All validation sets as one (the server's held-out set)."""
    first = sets[0]
    return ClientData(
        first.x_train,
        first.y_train,
        torch.cat([s.x_test for s in sets]),
        torch.cat([s.y_test for s in sets]),
    )

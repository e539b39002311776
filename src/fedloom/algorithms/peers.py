"""Other clients' models on the server: the pieces the algorithms that personalize through
their peers' models share (FedFomo, FedAMP; algorithms/fedfomo.py, algorithms/fedamp.py).

The server keeps a *model table*: every training client's latest uploaded parameters, one row
per client, stored as a tree of (m, *shape) tensors (m training clients, ids 0 .. m-1; a client
never sampled keeps the common initialization). The engine hands one message to all of a
round's clients, so a message carries a whole table and each client reads the rows meant for
it; the algorithm's ``wire`` counts what a real deployment sends, only those rows
(algorithms/wire.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fedloom.algorithms.base import AlgorithmContext
from fedloom.core.protocol import ClientResult
from fedloom.core.pytree import Tree


def training_clients(ctx: AlgorithmContext, name: str) -> int:
    """m, the number of training clients, which the model table indexes 0 .. m-1 (held-out
    new clients have larger ids)."""
    m = len(ctx.population) if ctx.population else ctx.num_clients
    assert sorted(ctx.population or range(m)) == list(range(m)), (
        f"{name} indexes the training clients 0 .. m-1"
    )
    return m


def model_table(params: Tree, m: int) -> Tree:
    """The table of m copies of ``params`` (every client at the common initialization)."""
    return {k: v.detach().unsqueeze(0).repeat(m, *([1] * v.dim())) for k, v in params.items()}


def row(table: Tree, j: int | torch.Tensor) -> Tree:
    """Client j's model out of the table (j may be a 0-d tensor, also under vmap)."""
    return {k: v[j] for k, v in table.items()}


def rows(table: Tree, ids: torch.Tensor) -> Tree:
    """The models of clients ``ids`` as a smaller table (len(ids), *shape)."""
    return {k: v[ids] for k, v in table.items()}


def with_uploads(table: Tree, results: Sequence[ClientResult]) -> Tree:
    """The table with each result's uploaded ``params`` in its client's row (a new table)."""
    new = {k: v.clone() for k, v in table.items()}
    for r in results:
        for k, v in r.upload["params"].items():
            new[k][r.client_id] = v
    return new


def flat_rows(table: Tree) -> torch.Tensor:
    """The table as one (m, d) matrix, its keys concatenated in order."""
    return torch.cat([v.reshape(v.shape[0], -1) for v in table.values()], dim=1)


def table_mean(table: Tree) -> Tree:
    """The unweighted mean of the table's rows (where a held-out new client starts)."""
    return {k: v.mean(dim=0) for k, v in table.items()}

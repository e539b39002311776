"""CFL, clustered federated learning (Sattler, Mueller, Samek, IEEE TNNLS 2021, "Clustered
Federated Learning: Model-Agnostic Distributed Multitask Optimization Under Privacy
Constraints", arXiv:1910.01991, Algorithms 1-2, criteria (28) and (29)).

FedAvg within each cluster of a growing partition of the clients; a cluster whose FedAvg has
reached a stationary point while its clients still move apart is split in two by the cosine
similarity of their updates. One round::

    client i in cluster c:  dtheta_i <- SGD(theta_c, D_i) - theta_c        # FedAvg's local SGD
    server, each cluster c of the round:
        dtheta_c  <- sum_{i in c} n_i dtheta_i / sum_{i in c} n_i           # FedAvg's average
        if ||dtheta_c|| < eps1                                              # (28) stationary
           and max_{i in c} ||dtheta_i|| > eps2                             # (29) incongruent
           and |c| >= min_split_size and round > warmup_rounds
           and every client of c took part in the round:
            alpha_ij <- <dtheta_i, dtheta_j> / (||dtheta_i|| ||dtheta_j||)
            c1, c2   <- argmin_{c1 u c2 = c} max_{i in c1, j in c2} alpha_ij   # Algorithm 1
            theta_c1 <- theta_c + dtheta_c1,  theta_c2 <- theta_c + dtheta_c2  # each its own
        else:
            theta_c  <- theta_c + dtheta_c

``bipartition: optimal`` is the paper's Algorithm 1: merge the clients pairwise in order of
decreasing similarity until two groups remain (single linkage), which gives the bipartition
of the smallest largest cross-cluster similarity exactly; ``complete`` is the complete-linkage
agglomerative clustering of the authors' code (``AgglomerativeClustering(linkage="complete")``
on -alpha), a heuristic for the same objective. Defaults are the authors' code's: eps1 0.4,
eps2 1.6, a cluster of more than 2 clients, no split in the first 20 rounds; both norms
depend on the model and the learning rate, and summary.json's ``extras`` reports the latest
of each cluster (``mean_update_norm``, ``max_update_norm``) to set them by.

The server keeps the cluster models stacked (one row a cluster, rows added as clusters
split), each training client's cluster and the round count; checkpoints hold all three. The
split needs every client of the cluster in the round (the paper's clients all take part
every round): with ``train.clients_per_round`` a cluster splits in a round all its clients
were sampled in. A cluster that never splits (eps1 = 0 or eps2 = inf) is FedAvg exactly.

Deployment: a training client deploys its cluster's model; a held-out new client (cold start)
the cluster model of lowest mean loss on its own training data (IFCA's rule,
algorithms/clusters.py), as the paper assigns new clients to the cluster that fits them.
Communication: one cluster model down and one model up a client.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch
from pydantic import Field
from scipy.cluster.hierarchy import fcluster, linkage
from scipy.spatial.distance import squareform

from fedloom.algorithms.base import Algorithm, AlgorithmConfig
from fedloom.algorithms.capabilities import Capabilities
from fedloom.algorithms.clusters import (
    DisjointSets,
    average_into,
    best_cluster,
    identity_extras,
    num_clusters,
    pick,
    stack,
)
from fedloom.algorithms.sgd_program import PlainSGDProgram
from fedloom.algorithms.wire import Wire
from fedloom.core.protocol import ClientResult, ClientTask, Message, State
from fedloom.core.pytree import Tree, flatten64
from fedloom.solvers import ClientProgram


class CFLConfig(AlgorithmConfig):
    eps1: float = Field(
        default=0.4,
        ge=0.0,
        description="split when the norm of the cluster's mean update is below this, (28)",
    )
    eps2: float = Field(
        default=1.6,
        ge=0.0,
        allow_inf_nan=True,
        description="... and its largest client update norm above this, (29)",
    )
    min_split_size: int = Field(
        default=3, ge=2, description="clients a cluster needs to split (authors' code: > 2)"
    )
    warmup_rounds: int = Field(
        default=20, ge=0, description="rounds before the first split (authors' code: 20)"
    )
    bipartition: Literal["optimal", "complete"] = Field(
        default="optimal",
        description="optimal: the paper's Algorithm 1 (single linkage); complete: complete "
        "linkage (the authors' code)",
    )


def cosine_similarities(updates: torch.Tensor) -> torch.Tensor:
    """alpha_ij = <u_i, u_j> / (||u_i|| ||u_j||) of the rows of ``updates`` (a zero update has
    similarity 0 with every other)."""
    unit = updates / updates.norm(dim=1, keepdim=True).clamp_min(1e-30)
    return unit @ unit.T


def optimal_bipartition(similarity: torch.Tensor) -> list[int]:
    """Algorithm 1 of Sattler et al.: labels 0/1 of the bipartition c1, c2 minimising
    max_{i in c1, j in c2} alpha_ij, found by merging clients in order of decreasing
    similarity until two groups remain (Kruskal's maximum spanning tree less its weakest
    edge). Ties go by index; client 0's group is 0."""
    m = similarity.shape[0]
    sets = DisjointSets(m)
    rows, cols = torch.triu_indices(m, m, offset=1)
    values = similarity[rows, cols]
    order = sorted(range(values.numel()), key=lambda e: (-float(values[e]), e))
    groups = m
    for e in order:
        if groups == 2:
            break
        if sets.union(int(rows[e]), int(cols[e])):
            groups -= 1
    first = sets.find(0)
    return [0 if sets.find(i) == first else 1 for i in range(m)]


def complete_bipartition(similarity: torch.Tensor) -> list[int]:
    """Labels 0/1 of complete-linkage agglomerative clustering into two groups on the
    distances 1 - alpha_ij (the authors' code's rule; client 0's group is 0)."""
    distance = (1.0 - similarity).clamp_min(0.0).double().numpy()
    distance = (distance + distance.T) / 2
    distance[range(len(distance)), range(len(distance))] = 0.0
    labels = fcluster(linkage(squareform(distance), method="complete"), 2, "maxclust")
    return [0 if label == labels[0] else 1 for label in labels]


def cross_similarity(similarity: torch.Tensor, labels: Sequence[int]) -> float:
    """max_{i in c1, j in c2} alpha_ij of the bipartition ``labels`` (alpha_cross^max)."""
    side = torch.tensor(labels, dtype=torch.bool)
    return float(similarity[side][:, ~side].max())


BIPARTITIONS = {"optimal": optimal_bipartition, "complete": complete_bipartition}


class CFL(Algorithm):
    name = "cfl"
    summary = "CFL: FedAvg per cluster; split a cluster by update similarity (Sattler et al.)"
    Config = CFLConfig
    capabilities = Capabilities(has_global_model=False)
    wire = Wire(
        rows={"clusters": 1, "cluster_buffers": 1}, routing=("identity",), delta_from="clusters"
    )

    def training_clients(self) -> list[int]:
        """The clients that train (held-out new clients excluded)."""
        return sorted(self.ctx.population) or list(range(self.ctx.num_clients))

    # -- server ---------------------------------------------------------------------------
    def init_server_state(self, params: Tree, buffers: Tree) -> State:
        identity = torch.full((self.ctx.num_clients,), -1, dtype=torch.long)
        identity[self.training_clients()] = 0
        return {
            "clusters": stack([params], list(params)),
            "buffers": stack([buffers], list(buffers)),
            "identity": identity,
            "rounds": torch.tensor(0, dtype=torch.long),
            "born": torch.zeros(1, dtype=torch.long),
            "norms": torch.zeros(1, 2, dtype=torch.float64),
        }

    def server_message(self, server: State, round: int = 0) -> Message:
        return {
            "clusters": server["clusters"],
            "cluster_buffers": server["buffers"],
            "identity": server["identity"],
        }

    def aggregate(self, server: State, results: list[ClientResult]) -> State:
        clusters = {key: value.clone() for key, value in server["clusters"].items()}
        buffers = {key: value.clone() for key, value in server["buffers"].items()}
        identity, norms = server["identity"].clone(), server["norms"].clone()
        rounds = int(server["rounds"]) + 1
        present = {r.client_id for r in results}
        by_cluster: dict[int, list[ClientResult]] = {}
        for r in results:
            by_cluster.setdefault(int(identity[r.client_id]), []).append(r)
        split_off: list[tuple[Tree, Tree]] = []  # the second halves, appended as new rows
        for c, members in sorted(by_cluster.items()):
            start = flatten64(pick(clusters, c), list(clusters))
            updates = torch.stack(
                [flatten64(r.upload["params"], list(clusters)) - start for r in members]
            )
            average_into(self.ctx.aggregate, clusters, buffers, c, members)
            mean = float((flatten64(pick(clusters, c), list(clusters)) - start).norm())
            norms[c] = torch.tensor([mean, float(updates.norm(dim=1).max())])
            whole = set(torch.nonzero(identity == c).flatten().tolist()) <= present
            if not (whole and self.splits(mean, float(norms[c, 1]), len(members), rounds)):
                continue
            labels = BIPARTITIONS[self.config.bipartition](cosine_similarities(updates))
            stay = [r for r, side in zip(members, labels, strict=True) if side == 0]
            leave = [r for r, side in zip(members, labels, strict=True) if side == 1]
            row = {k: v[c : c + 1].clone() for k, v in clusters.items()}
            row_buffers = {k: v[c : c + 1].clone() for k, v in buffers.items()}
            average_into(self.ctx.aggregate, row, row_buffers, 0, leave)
            split_off.append((pick(row, 0), pick(row_buffers, 0)))
            average_into(self.ctx.aggregate, clusters, buffers, c, stay)
            for r in leave:
                identity[r.client_id] = num_clusters(clusters) + len(split_off) - 1
        born = server["born"]
        if split_off:
            clusters = grow(clusters, [p for p, _ in split_off])
            buffers = grow(buffers, [b for _, b in split_off])
            born = torch.cat([born, torch.full((len(split_off),), rounds, dtype=torch.long)])
            norms = torch.cat([norms, norms.new_zeros(len(split_off), 2)])
        return {
            "clusters": clusters,
            "buffers": buffers,
            "identity": identity,
            "rounds": torch.tensor(rounds, dtype=torch.long),
            "born": born,
            "norms": norms,
        }

    def splits(self, mean_norm: float, max_norm: float, size: int, rounds: int) -> bool:
        """Whether a cluster whose every client took part splits after round ``rounds``: (28)
        and (29), its size and the warm-up."""
        cfg = self.config
        return (
            mean_norm < cfg.eps1
            and max_norm > cfg.eps2
            and size >= cfg.min_split_size
            and rounds > cfg.warmup_rounds
        )

    def summary_extras(self, server: State) -> dict[str, Any]:
        """summary.json extras: each client's cluster (-1: a held-out new client), the cluster
        sizes, the round each cluster was split off in (0: the first) and the latest norm of
        each cluster's mean update and largest client update (the quantities of (28), (29))."""
        norms = server["norms"].tolist()
        return {
            **identity_extras(server["identity"], num_clusters(server["clusters"])),
            "cluster_born": server["born"].tolist(),
            "mean_update_norm": [n[0] for n in norms],
            "max_update_norm": [n[1] for n in norms],
        }

    # -- client ---------------------------------------------------------------------------
    def make_program(self) -> ClientProgram:
        return PlainSGDProgram(self, start=cluster_model)

    def deployed_model(
        self, server: State, state: State | None, task: ClientTask
    ) -> tuple[Tree, Tree]:
        c = int(server["identity"][task.client_id])
        if c < 0:  # a held-out new client: the cluster that fits its training data
            k = num_clusters(server["clusters"])
            c = best_cluster(self.ctx.model, server["clusters"], server["buffers"], task.data, k)
        return pick(server["clusters"], c), pick(server["buffers"], c)


def grow(stacked: Tree, rows: Sequence[Tree]) -> Tree:
    """``stacked`` with ``rows`` appended as new clusters."""
    return {k: torch.cat([v, stack(rows, [k])[k]]) for k, v in stacked.items()}


def cluster_model(message: Message, state: State | None, task: Any) -> tuple[Tree, Tree]:
    """CFL's start: the model of the client's cluster."""
    c = int(message["identity"][task.client_id])
    return pick(message["clusters"], c), pick(message["cluster_buffers"], c)

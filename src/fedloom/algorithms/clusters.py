"""Cluster bookkeeping shared by the clustered algorithms, IFCA (algorithms/ifca.py), CFL
(algorithms/cfl.py) and FPFC (algorithms/fpfc.py): cluster models kept stacked along a
leading cluster axis, the loss of each on a client's data, the per-cluster average of the
uploads, the identity summary, a score against planted groups (docs/clustering.md) and the
disjoint sets that merge clients into groups."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from scipy.optimize import linear_sum_assignment

from fedloom.core.functional import FunctionalModel
from fedloom.core.protocol import ClientData, ClientResult
from fedloom.core.pytree import Tree

Aggregate = Callable[[list[Tree], list[float]], Tree]
"""(trees, weights) -> their weighted mean, or a robust rule's combination (ctx.aggregate)."""


class DisjointSets:
    """Union-find on 0..m-1 (path halving); a merged set's root is its smallest member."""

    def __init__(self, m: int) -> None:
        self.parent = list(range(m))

    def find(self, i: int) -> int:
        """The root of ``i``'s set."""
        parent = self.parent
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    def union(self, i: int, j: int) -> bool:
        """Merge the sets of ``i`` and ``j``; whether they were apart."""
        a, b = self.find(i), self.find(j)
        if a != b:
            self.parent[max(a, b)] = min(a, b)
        return a != b


def pick(stacked: Tree, cluster: int) -> Tree:
    """Cluster ``cluster``'s tree out of the (k, ...) stacked trees."""
    return {key: value[cluster] for key, value in stacked.items()}


def stack(trees: Sequence[Tree], keys: Sequence[str]) -> Tree:
    """The (k, ...) stacked trees of ``trees`` (the order is the cluster index)."""
    return {key: torch.stack([tree[key] for tree in trees]) for key in keys}


def cluster_losses(
    model: FunctionalModel, clusters: Tree, buffers: Tree, data: ClientData, k: int
) -> list[float]:
    """F_i(theta_j) for j = 1..k: the mean loss of each cluster model on the client's training
    data (evaluation mode)."""
    n = max(data.num_train, 1)
    return [
        model.evaluate(pick(clusters, j), pick(buffers, j), data.x_train, data.y_train)[0] / n
        for j in range(k)
    ]


def best_cluster(
    model: FunctionalModel, clusters: Tree, buffers: Tree, data: ClientData, k: int
) -> int:
    """The cluster identity estimate argmin_j F_i(theta_j) (the first of equal losses)."""
    losses = cluster_losses(model, clusters, buffers, data, k)
    return min(range(k), key=losses.__getitem__)


def num_clusters(stacked: Tree) -> int:
    """How many cluster models the stacked trees hold."""
    return int(next(iter(stacked.values())).shape[0])


def average_into(
    aggregate: Aggregate,
    clusters: Tree,
    buffers: Tree,
    cluster: int,
    members: Sequence[ClientResult],
) -> None:
    """Write the average (``aggregate``, weighted by the results' weights) of ``members``'
    uploaded models into row ``cluster`` of the stacked ``clusters`` and ``buffers`` (in
    place: callers hand over copies)."""
    weights = [r.weight for r in members]
    new = aggregate([r.upload["params"] for r in members], weights)
    for key, value in new.items():
        clusters[key][cluster] = value
    if buffers:
        mean = aggregate([r.upload["buffers"] for r in members], weights)
        for key, value in mean.items():
            buffers[key][cluster] = value


def identity_extras(identity: torch.Tensor, k: int) -> dict[str, Any]:
    """summary.json extras: each client's cluster (-1: none yet) and how many hold each."""
    found = identity.tolist()
    return {"cluster_identity": found, "cluster_sizes": [found.count(j) for j in range(k)]}


def cluster_agreement(found: Sequence[int], planted: Sequence[int]) -> float:
    """The fraction of clients whose found cluster matches its planted group under the best
    one-to-one relabelling of the clusters (clients with found identity -1 count as wrong)."""
    labels_f, labels_p = sorted(set(found) - {-1}), sorted(set(planted))
    counts = torch.zeros(len(labels_f), len(labels_p))
    for f, p in zip(found, planted, strict=True):
        if f != -1:
            counts[labels_f.index(f), labels_p.index(p)] += 1
    rows, cols = linear_sum_assignment(counts.numpy(), maximize=True)
    return float(counts[rows, cols].sum()) / max(len(found), 1)
